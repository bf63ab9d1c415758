"""Wire schemas of the SWARM coordinator's /v1/swarm API (pydantic), and of the JSON a stage
server puts in its replies to trainers.

Like covey.protocol.schemas: strict, unknown fields forbidden, every string, list, mapping
and number bounded, so a malformed body is refused with a 422 naming its problems before a
handler runs. Signatures are checked by the services over the body exactly as sent
(covey.coordinator.auth), so a model here never changes what is signed. What depends on
the run (stage ranges, the stake minimum) is checked by the service, covey.swarm.service.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from covey.protocol.multiplier import CostsReport
from covey.protocol.schemas import (
    MAX_INT,
    ContentId,
    Name,
    PeerId,
    PublicKey,
    Request,
    RunId,
    Signature,
    Signed,
    Url,
)

MAX_CHECKS_PER_REPORT = 256  # evidence items one trainer report may carry
MAX_SERVERS_PER_REPORT = 256  # servers one report may name (served, measured, banned)
MAX_SERVED_PER_REPORT = 10_000  # microbatches one report may claim for one server
MAX_THROUGHPUT = 1e6  # samples/s: above any real server; larger values are refused
MAX_SKETCH = 4096  # per-parameter numbers in a stage server's reply

# base64 text (the decoder checks the padding); its length is bounded by the app's body
# limit (the run's max_body_bytes), which is refused with 413 before a model is built
Base64 = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9+/]*={0,2}$")]
Reason = Annotated[str, StringConstraints(max_length=200)]
Throughput = Annotated[float, Field(ge=0, le=MAX_THROUGHPUT, allow_inf_nan=False)]
# integers are JSON integers only: 4.0 is refused where 4 is meant (a sum's sample count
# weighs it in its round), unlike covey.protocol.schemas.Count
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Step = Annotated[int, Field(ge=-1, le=MAX_INT)]  # a server's stage step; -1: no state yet
ServedCount = Annotated[int, Field(ge=0, le=MAX_SERVED_PER_REPORT)]  # microbatches


class SwarmJoin(Signed):
    """POST /v1/swarm/join: a stage server (`url`, `blob_url`; `stage`, the one it asks
    for) or a trainer joins with its key. The peer id must be the hash of `public_key`."""

    run_id: RunId
    peer_id: PeerId
    public_key: PublicKey
    role: Literal["server", "trainer"]
    name: Name = "peer"
    stake: float = Field(0.0, ge=0, le=1e15, allow_inf_nan=False, description="credits staked")
    url: Url | None = Field(None, description="a server's address for trainers' requests")
    blob_url: Url | None = Field(None, description="a server's blob server (stage states)")
    device: str = Field("cpu", max_length=80, description="e.g. cpu, cuda:NVIDIA H100")
    stage: Count | None = Field(None, description="the stage a server asks for")


class SwarmHeartbeat(Signed):
    """POST /v1/swarm/heartbeat: a server's stage, state and load (claims: rebalancing and
    pay rest on trainers' measurements and checks, covey.swarm.observed)."""

    run_id: RunId
    peer_id: PeerId
    stage: Count
    step: Step
    state: ContentId | None = None
    pending: Count = 0
    throughput: Throughput = 0.0
    queue: Count = 0
    # seconds since it began heartbeating, and of those, computing requests (covey.swarm.costs)
    uptime_s: float = Field(0.0, ge=0, le=1e9, allow_inf_nan=False)
    busy_s: float = Field(0.0, ge=0, le=1e9, allow_inf_nan=False)


class SwarmRoundReport(Signed):
    """POST /v1/swarm/round: a round member's gradient sum (safetensors, base64), whose
    sha256 is `cid` (covey.swarm.sums checks its form)."""

    run_id: RunId
    peer_id: PeerId
    stage: Count
    round: Count
    cid: ContentId
    samples: Count
    data: Base64


class SwarmStateUpload(Signed):
    """POST /v1/swarm/state: a copy of a stage's agreed state (base64), by content id."""

    run_id: RunId
    peer_id: PeerId
    stage: Count | None = None
    cid: ContentId
    data: Base64


class SwarmReply(Request):
    """One server's signed reply to a duplicated request: its sig is over (stage, state,
    sha256(request), sha256(reply)) (covey.swarm.wire.reply_message)."""

    server: PeerId
    state: ContentId
    sig: Signature
    reply: Base64


class SwarmCheck(Request):
    """Evidence of an agreed check (covey.swarm.evidence): a request and two replies."""

    stage: Count
    kind: Literal["forward", "backward"]
    request: Base64
    replies: list[SwarmReply] = Field(min_length=2, max_length=2)


class SwarmReport(Signed):
    """POST /v1/swarm/report: a trainer's progress, what it saw of servers and its evidence.
    `checks` are judged one by one (a malformed one is answered "refused: why" and the
    others stand), each against `SwarmCheck`."""

    run_id: RunId
    peer_id: PeerId
    samples: Count
    loss: float | None = Field(None, allow_inf_nan=False)
    reroutes: Count
    banned: dict[PeerId, Reason] = Field({}, max_length=MAX_SERVERS_PER_REPORT)
    next: Count = 0
    served: dict[PeerId, ServedCount] = Field({}, max_length=MAX_SERVERS_PER_REPORT)
    measured: dict[PeerId, Throughput] = Field({}, max_length=MAX_SERVERS_PER_REPORT)
    checks: list[Any] = Field([], max_length=MAX_CHECKS_PER_REPORT)
    # what this trainer's hops cost so far (covey.swarm.costs): shown and summed only
    costs: CostsReport | None = None


class SwarmDispute(Signed):
    """POST /v1/swarm/dispute: two servers of a stage disagreed on one request."""

    run_id: RunId
    peer_id: PeerId
    stage: Count
    kind: Literal["forward", "backward"]
    request: Base64
    replies: list[SwarmReply] = Field(min_length=2, max_length=2)

    def evidence(self) -> dict[str, Any]:
        """The dispute without the sender's fields: what the referee settles and what a
        replay is recognized by."""
        return self.model_dump(include={"stage", "kind", "request", "replies"})


class ReplyMeta(BaseModel):
    """The JSON part of a stage server's reply to a trainer (covey.swarm.compute):
    the last stage's loss (None elsewhere) and per-parameter gradient norms."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    loss: float | None = Field(None, allow_inf_nan=False)
    sketch: list[float] = Field(max_length=MAX_SKETCH)
