"""Wire schemas of the coordinator's /v1 API (pydantic). Requests forbid unknown fields
and bound every string and number, so a malformed request fails validation with a 4xx
before any handler runs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

PEER_ID_PATTERN = r"^[0-9a-f]{32}$"  # sha256(public key)[:32]
PeerId = Annotated[str, StringConstraints(pattern=PEER_ID_PATTERN)]
PublicKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Signature = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{128}$")]
Nonce = Annotated[str, StringConstraints(pattern=r"^[0-9]{13}-[0-9a-f]{16}$")]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
ContentId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
RunId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
Url = Annotated[str, StringConstraints(pattern=r"^https?://[^\s]{1,200}$")]
# the largest integer a request may carry: exact in a JSON double and in SQLite's INTEGER
MAX_INT = 2**53 - 1


def _whole(value: object) -> object:
    """JSON Schema counts 2.0 as an integer, strict validation would not: take it as 2."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# a request's integers, 2 or 2.0 (the bounds sit inside, so that the schema of an optional
# one still names them as minimum and maximum)
Count = Annotated[Annotated[int, Field(ge=0, le=MAX_INT)], BeforeValidator(_whole)]
Positive = Annotated[Annotated[int, Field(gt=0, le=MAX_INT)], BeforeValidator(_whole)]


class ErrorReply(BaseModel):
    """The body of every refusal (4xx): what was wrong, and for an invalid request (422)
    each field's problem."""

    error: str
    problems: list[str] | None = None


class Request(BaseModel):
    """A request body. Strict: a value is taken only in the JSON type its schema names
    (no "1" for 1, no 1 for true; an integer takes 2.0 as 2, as JSON Schema does), so
    what the served OpenAPI document forbids is exactly what is refused (422)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Signed(Request):
    """A state-changing request: signed by the sender's key over (purpose, run id, round,
    content id, nonce), the purpose being the endpoint it is sent to; see
    covey.trust.identity."""

    nonce: Nonce
    signature: Signature


class JoinRequest(Signed):
    run_id: RunId
    peer_id: PeerId
    public_key: PublicKey
    name: Name = "peer"
    stake: float = Field(0.0, ge=0, le=1e15, allow_inf_nan=False, description="credits staked")
    device: str = Field("cpu", max_length=64, description="e.g. cpu, cuda:0 (H100)")
    step_time_s: float = Field(gt=0, le=3600, description="measured seconds per inner step")
    bandwidth_mbps: float | None = Field(None, gt=0, le=1e6, description="link estimate")
    accepts_connections: bool = Field(False, description="its blob server is reachable")
    blob_url: Url | None = None


class JoinReply(BaseModel):
    peer_id: str
    run_id: str
    heartbeat_s: float
    dead_after_s: float
    lease_s: float  # a worker stops training when no heartbeat renewed its lease this long


class HeartbeatRequest(Signed):
    run_id: RunId
    peer_id: PeerId
    step_time_s: float | None = Field(None, gt=0, le=3600)


class LeaveRequest(Signed):
    run_id: RunId
    peer_id: PeerId
    reason: str = Field("shutdown", max_length=200)


class HaltRequest(Signed):
    """POST /v1/halt: the run owner stops the run (covey.trust.halt), signed with the owner
    key (the spec's owner_key, else the coordinator's key)."""

    run_id: RunId
    owner_key: PublicKey
    reason: str = Field("halted by the run owner", min_length=1, max_length=200)


class DepositRequest(Signed):
    """POST /v1/ledger/deposit: the run owner credits a key from the run's treasury
    (covey.trust.treasury), signed with the owner key (as a HALT is)."""

    run_id: RunId
    owner_key: PublicKey
    to: PublicKey = Field(description="the public key credited")
    amount: float = Field(gt=0, le=1e15, allow_inf_nan=False, description="credits")


class AssignmentOut(BaseModel):
    inner_steps: int
    data_key: str


class RoundInfo(BaseModel):
    """GET /v1/round: what a peer should do now."""

    run_id: str
    phase: Literal["open", "waiting", "finished", "halted"]
    round: int  # the open round, or the next one to open
    halted: str | None = None  # phase "halted": the owner's reason; no round opens again
    attempt: int = 0
    start_cid: str | None = None
    start_hash: str | None = None
    start_size: int | None = None
    providers: list[str] = []
    deadline_in_s: float | None = None
    member: bool = False
    assignment: AssignmentOut | None = None
    # what a peer's loop branches on ("open:3:0", "waiting:4", "finished:9", "halted"):
    # GET /v1/round?after=TAG&wait=S is held until there is news past it (a long-poll)
    tag: str = ""


class CommitmentIn(Request):
    """The worker's state after `step` inner steps: count sketches, and a hash at step 0
    (the round's start); an intermediate commitment's hash is "" (covey.trust.sketch,
    NO_HASH), or 64 hex digits as older workers sent it."""

    step: Count
    hash: Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{64})?$")]
    sketch: dict[
        Annotated[str, StringConstraints(pattern=r"^[a-z]{1,16}$")],
        Annotated[list[Annotated[float, Field(allow_inf_nan=False)]], Field(max_length=1024)],
    ] = Field(
        max_length=4,
        # pydantic documents the key pattern as patternProperties, which alone would let
        # any other key through; the validator refuses other keys, and so does the schema
        json_schema_extra={"additionalProperties": False},
    )

    @model_validator(mode="after")
    def _start_is_hashed(self) -> CommitmentIn:
        if self.step == 0 and not self.hash:
            raise ValueError("commitment 0 (the round's start state) must carry its hash")
        return self


class ContributionRequest(Signed):
    """POST /v1/rounds/{round}/contributions: the metadata of a contribution whose bytes are
    the blob `cid` (uploaded first, or served by the peer's own blob server)."""

    run_id: RunId
    round: Count
    attempt: Count
    peer_id: PeerId
    cid: ContentId
    start_hash: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="the weights hash the peer trained from"
    )
    size: Positive
    tokens: Positive
    inner_steps: Positive
    fragment: Count | None = None
    train_loss: float | None = Field(None, allow_inf_nan=False)
    compute_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    wall_s: float = Field(0.0, ge=0, allow_inf_nan=False, description="round open to submit")
    commitments: list[CommitmentIn] = Field([], max_length=10_000)
    # the local-state chain (covey.algorithms.base): for strategies that carry local
    # state from round to round; all None for those that start every round fresh
    local_state_cid: ContentId | None = Field(
        None,
        description="the local state this round started from: the end_state_cid of this "
        "peer's contribution to the previous round (None: the algorithm's fresh start)",
    )
    end_state_cid: ContentId | None = Field(
        None, description="the local state after this round's work (uploaded like `cid`)"
    )
    end_state_size: Positive | None = None


class AcceptedContribution(BaseModel):
    peer_id: str
    name: str = ""
    cid: str
    size: int
    tokens: int
    inner_steps: int
    fragment: int | None
    weight: float
    providers: list[str]


class Rejection(BaseModel):
    peer_id: str
    name: str = ""
    reason: str


class LedgerHead(BaseModel):
    """The coordinator's signed head of the run's ledger (covey.trust.heads): `length`
    entries, the last with hash `hash`. Peers keep these; `covey ledger verify --heads`
    refuses a ledger shorter than one, or different at its length."""

    run_id: str = Field(pattern=r"^[0-9a-z_-]{1,64}$")
    length: int = Field(ge=1, le=2**53)
    hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    signature: str = Field(pattern=r"^[0-9a-f]{128}$")


class Certificate(BaseModel):
    """The outcome of a round: what every peer applies and the hash it must reach."""

    run_id: str
    round: int
    attempt: int
    start_hash: str
    new_hash: str
    new_cid: str
    new_size: int
    accepted: list[AcceptedContribution]
    rejected: list[Rejection]
    closed_at: float
    reason: str
    # the ledger's signed head as of the commit (before the round's own entries); None in
    # certificates of covey versions without heads, whose signatures leave it out
    ledger_head: LedgerHead | None = None
    signature: str = ""  # the coordinator's, over the rest (covey.trust.identity)


class CheckpointEntry(BaseModel):
    round: int  # rounds applied to reach it
    cid: str
    size: int
    weights_hash: str
    providers: list[str]


# --- validators ---------------------------------------------------------------------------


class ValidatorJoin(Signed):
    """POST /v1/validators/join. A first join stakes `stake` (at least the run's
    trust.min_validator_stake): a false accusation or a passed canary costs a share of it."""

    run_id: RunId
    validator_id: PeerId
    public_key: PublicKey
    name: Name = "validator"
    stake: float = Field(0.0, ge=0, le=1e15, allow_inf_nan=False, description="credits staked")


class ClaimRequest(Signed):
    """POST /v1/verify/claim: give this validator a sampled contribution to re-execute."""

    run_id: RunId
    validator_id: PeerId


class VerifyTask(BaseModel):
    """A sampled contribution and everything needed to re-execute it."""

    task_id: int
    round: int
    peer_id: str
    cid: str
    size: int
    tokens: int
    inner_steps: int
    fragment: int | None
    data_key: str
    start_cid: str
    start_hash: str
    start_size: int
    commitments: list[dict]
    providers: list[str]
    # the local-state chain: the worker's committed local states (None: the round started fresh)
    local_state_cid: str | None = None
    local_state_size: int | None = None
    previous_accepted: bool = True  # did the previous round's certificate accept it
    end_state_cid: str | None = None
    end_state_size: int | None = None


class VerifyReport(Signed):
    """POST /v1/verify/report: the outcome of a re-execution. On a disagreement the
    validator names the first diverging segment and backs its claim: its own commitment at
    the segment's end (or, for the last segment, its payload `payload_cid`), and its local
    state at the segment's start (`state_cid`, not needed for segment 0)."""

    run_id: RunId
    round: Count
    validator_id: PeerId
    task_id: Count
    # "withheld": the worker's providers did not deliver the evidence the check needs
    # within covey.trust.policy.evidence_deadline_s (signed: it is an attestation)
    outcome: Literal["agree", "disagree", "withheld"]
    worker_id: PeerId | None = None  # the checked contribution's worker (a "withheld" names it)
    exact: bool = False
    distance: float | None = Field(None, ge=0, allow_inf_nan=False)
    segment: Count | None = None
    detail: str = Field("", max_length=500)
    state_cid: ContentId | None = None
    payload_cid: ContentId | None = None
    claim: CommitmentIn | None = None
    compute_s: float = Field(0.0, ge=0, allow_inf_nan=False)
