"""Pay per verified microbatch: a trainer's evidence of an agreed check, and what the swarm
coordinator checks before it pays anyone for it.

A check (covey.swarm.trainer: `verify_rate` of hops) sends one request to two servers of a
stage. When both signed replies agree, the trainer reports the evidence: the request bytes
and, per server, its reply, the state id it computed on and its signature over (stage,
state, sha256(request), sha256(reply)) (covey.swarm.wire.reply_message). The coordinator
pays only evidence that passes every test here, each request once; the first server (the
one the trainer routed the hop to) is paid 1 / verify_rate microbatches (its unchecked hops
are paid through its checked ones, as a sample), the second 1 (its check hop).

What a pair that lies can still gain, and its bound (README, SWARM "Pay"):
- a trainer and a server colluding cannot be paid for work the server did not do: each paid
  request carries the signature of a second server of the stage (not the trainer) over a
  reply that agrees with the first; a lie there is a dispute that slashes the liar. They can
  route all the colluding server's hops to checks, so it earns up to 1 / verify_rate times
  its real, correct work, on requests of the trainer's choosing (useless work is real work).
- two colluding servers and a trainer can agree on replies nobody computed: a
  `spot_check_rate` share of evidence, drawn by the coordinator's own signature over the
  evidence id (unpredictable to them, replayable by anyone with its public key), is
  recomputed by the referee; a wrong reply slashes both (slash_fraction of stake) and bans
  them. Before the first catch they expect 1 / spot_check_rate fake checks, at most
  (1 / verify_rate + 1) / spot_check_rate microbatches of pay: a stake above that makes it
  a loss.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from covey.protocol.swarm import SwarmCheck
from covey.trust.identity import Identity, verify


class EvidenceError(ValueError):
    """Evidence that pays nobody; the message says why (the report answers with it)."""


@dataclass(frozen=True)
class Check:
    id: str  # sha256 over (stage, kind, sha256(request)): a request is paid once
    stage: int
    kind: str
    request: bytes
    servers: tuple[str, str]  # (first: the routed hop, second: the check)
    state: str
    replies: tuple[bytes, bytes]
    sigs: tuple[str, str]

    def dispute_body(self) -> dict[str, Any]:
        """The evidence in the shape the referee settles (covey.swarm.referee)."""
        return {
            "stage": self.stage,
            "kind": self.kind,
            "request": base64.b64encode(self.request).decode(),
            "replies": [
                {"server": s, "state": self.state, "sig": g,
                 "reply": base64.b64encode(r).decode()}
                for s, r, g in zip(self.servers, self.replies, self.sigs, strict=True)
            ],
        }  # fmt: skip


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse(item: Any, n_stages: int) -> Check:
    """A Check from one item of a report's `checks` (covey.protocol.swarm.SwarmCheck, and
    a stage of this run); EvidenceError naming what is wrong."""
    try:
        check = SwarmCheck.model_validate(item)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in p['loc']) or 'check'}: {p['msg']}" for p in e.errors()
        )
        raise EvidenceError(f"malformed check: {problems[:300]}") from None
    stage, kind = check.stage, check.kind
    if not 0 <= stage < n_stages:
        raise EvidenceError(f"stage {stage!r}: stages are 0..{n_stages - 1}")
    try:
        request = base64.b64decode(check.request, validate=True)
        bodies = tuple(base64.b64decode(r.reply, validate=True) for r in check.replies)
    except (binascii.Error, ValueError) as e:
        raise EvidenceError(f"malformed check: not base64: {e}") from None
    servers = tuple(r.server for r in check.replies)
    states = {r.state for r in check.replies}
    sigs = tuple(r.sig for r in check.replies)
    if servers[0] == servers[1]:
        raise EvidenceError(f"both replies are from server {servers[0][:12]}")
    if len(states) != 1:
        raise EvidenceError("the replies were computed on different states")
    ident = _sha(f"covey-swarm-check/v1\n{stage}\n{kind}\n{_sha(request)}".encode())
    return Check(ident, stage, kind, request, servers, states.pop(), bodies, sigs)  # type: ignore[arg-type]


def verify_agreement(check: Check, keys: dict[str, str], tolerance: float) -> None:
    """EvidenceError unless both servers signed their reply to this request on this state
    and the replies agree within `tolerance` (covey.swarm.compute.reply_distance)."""
    from covey.swarm import compute
    from covey.swarm.wire import reply_message

    for server, reply, sig in zip(check.servers, check.replies, check.sigs, strict=True):
        message = reply_message(check.stage, check.state, _sha(check.request), _sha(reply))
        if server not in keys or not verify(keys[server], message, sig):
            raise EvidenceError(f"server {server[:12]}'s signature does not verify")
    d = compute.reply_distance(*check.replies)
    if not d <= tolerance:  # nan and inf included
        raise EvidenceError(f"the replies disagree ({d:.3g} > {tolerance}): file a dispute")


def drawn(identity: Identity, check_id: str, rate: float) -> bool:
    """Whether the referee recomputes this evidence: sha256 of the coordinator's signature
    over its id, as a number in [0, 1), below `rate`. Ed25519 signatures are deterministic,
    so the draw is fixed by the id (the coordinator cannot redraw) and unknown to anyone
    without the coordinator's key until it is made."""
    sig = identity.sign(f"covey-swarm-spot-check/v1\n{check_id}".encode())
    return int(_sha(sig.encode())[:16], 16) / 2**64 < rate


def tokens_paid(microbatch: int, seq_len: int, verify_rate: float) -> tuple[int, int]:
    """Tokens paid for one verified check: (first server, second server)."""
    one = microbatch * seq_len
    return (math.ceil(one / verify_rate) if verify_rate > 0 else one), one
