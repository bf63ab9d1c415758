"""Wire schemas of the coordinator's /v1 API (pydantic). Requests forbid unknown fields
and bound every string and number, so a malformed request fails validation with a 4xx
before any handler runs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

PeerId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
ContentId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
RunId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
Url = Annotated[str, StringConstraints(pattern=r"^https?://[^\s]{1,200}$")]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JoinRequest(Request):
    run_id: RunId
    peer_id: PeerId
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


class HeartbeatRequest(Request):
    run_id: RunId
    peer_id: PeerId
    step_time_s: float | None = Field(None, gt=0, le=3600)


class LeaveRequest(Request):
    run_id: RunId
    peer_id: PeerId
    reason: str = Field("shutdown", max_length=200)


class AssignmentOut(BaseModel):
    inner_steps: int
    data_key: str


class RoundInfo(BaseModel):
    """GET /v1/round: what a peer should do now."""

    run_id: str
    phase: Literal["open", "waiting", "finished"]
    round: int  # the open round, or the next one to open
    attempt: int = 0
    start_cid: str | None = None
    start_hash: str | None = None
    start_size: int | None = None
    providers: list[str] = []
    deadline_in_s: float | None = None
    member: bool = False
    assignment: AssignmentOut | None = None


class ContributionRequest(Request):
    """POST /v1/rounds/{round}/contributions: the metadata of a contribution whose bytes are
    the blob `cid` (uploaded first, or served by the peer's own blob server)."""

    run_id: RunId
    round: int = Field(ge=0)
    attempt: int = Field(ge=0)
    peer_id: PeerId
    cid: ContentId
    start_hash: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="the weights hash the peer trained from"
    )
    size: int = Field(gt=0)
    tokens: int = Field(gt=0)
    inner_steps: int = Field(gt=0)
    fragment: int | None = Field(None, ge=0)
    train_loss: float | None = Field(None, allow_inf_nan=False)
    compute_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    wall_s: float = Field(0.0, ge=0, allow_inf_nan=False, description="round open to submit")


class AcceptedContribution(BaseModel):
    peer_id: str
    cid: str
    size: int
    tokens: int
    inner_steps: int
    fragment: int | None
    weight: float
    providers: list[str]


class Rejection(BaseModel):
    peer_id: str
    reason: str


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


class CheckpointEntry(BaseModel):
    round: int  # rounds applied to reach it
    cid: str
    size: int
    weights_hash: str
    providers: list[str]
