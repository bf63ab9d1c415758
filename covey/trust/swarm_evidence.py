"""What a SWARM stage server's conviction rests on, checked from outside the coordinator.

A duplicated hop sends one request to two servers of a stage; each signs its reply over
(stage, state, sha256(request), sha256(reply)) (`reply_message`). When the referee
(covey.swarm.referee) convicts one of them, on a trainer's dispute or on a spot check of
agreed evidence, the coordinator keeps the request, both replies and the stage state in
its blob store (content ids are sha256, the very hashes the servers signed) and writes
the "dispute" entry with `evidence`:

    {"kind": "swarm", "stage", "hop": "forward"|"backward", "request": cid,
     "state": cid, "replies": [{"server", "reply": cid, "sig"}, two of them],
     "tolerance", "distances": {server: the referee's relative L2 distance to the truth}}

`check_disputes` (every `covey ledger verify`) needs only the ledger: both replies carry
their servers' own signatures over the request and reply ids, so the coordinator can put
neither reply in a server's mouth; the convicted peer is one of the two; the referee's
distance of the convicted one is above the tolerance. `covey ledger verify --recompute`
then recomputes the reply from the state and the request with the stage code the servers
run (covey.swarm.ledger_evidence) and holds each conviction to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from covey.trust.identity import verify
from covey.trust.ledger import Entry, LedgerError

KIND = "swarm"


def reply_message(stage: int, state: str, input_sha: str, output_sha: str) -> bytes:
    """The bytes a stage server signs for its reply to a request on a state."""
    return f"covey-swarm-reply/v1\n{stage}\n{state}\n{input_sha}\n{output_sha}".encode()


def evidence(
    stage: int,
    hop: str,
    request: str,
    state: str,
    replies: Sequence[tuple[str, str, str]],
    tolerance: float,
    distances: dict[str, float],
) -> dict[str, Any]:
    """A conviction's `evidence` (see the module): `replies` (server, reply cid, sig)."""
    return {"kind": KIND, "stage": stage, "hop": hop, "request": request, "state": state,
            "replies": [{"server": s, "reply": r, "sig": g} for s, r, g in replies],
            "tolerance": float(tolerance),
            "distances": {s: float(d) for s, d in distances.items()}}  # fmt: skip


@dataclass(frozen=True)
class SwarmVerdict:
    """A conviction of a stage server whose evidence holds up on the ledger alone."""

    index: int  # of the dispute entry
    liar: str
    stage: int
    hop: str
    request: str
    state: str
    replies: tuple[tuple[str, str], ...]  # (server, reply cid)
    tolerance: float


def check_disputes(entries: Sequence[Entry]) -> list[SwarmVerdict]:
    """Every "dispute" that carries SWARM evidence, checked against the ledger (see the
    module): their verdicts, or LedgerError naming the first whose evidence does not hold.
    A "verification" naming a peer that is no validator (only SWARM writes one: a stage
    server whose reply agreed with a convicted one) must be backed by such a dispute of
    the same item whose evidence holds that server's reply; else LedgerError naming it."""
    keys: dict[str, str] = {}
    roles: dict[str, str] = {}
    agreed: dict[tuple[int, str], set[str]] = {}  # (round, peer) -> who agreed on it
    unbacked: dict[tuple[int, str, str], int] = {}  # (round, peer, server) -> entry index
    verdicts = []
    for e in entries:
        p = e.payload
        if e.type == "join":
            keys[p["peer_id"]], roles[p["peer_id"]] = p["public_key"], p.get("role", "")
        elif e.type == "verification" and p.get("outcome") == "agree":
            agreed.setdefault((p["round"], p["peer_id"]), set()).add(p["validator_id"])
            if roles.get(p["validator_id"], "validator") != "validator":
                unbacked.setdefault((p["round"], p["peer_id"], p["validator_id"]), e.index)
        elif (
            e.type == "dispute"
            and isinstance(ev := p.get("evidence"), dict)
            and ev.get("kind") == KIND
        ):
            v = _check(e, keys)
            # a missed fraud needs the agreeing server's reply among the evidence's
            servers = {s for s, _ in v.replies}
            others = agreed.get((p["round"], v.liar), set()) - servers
            if others:
                raise LedgerError(
                    e.index, f"conviction of stage server {v.liar}: {sorted(others)[0]} is "
                    "written as agreeing with it, but no reply of it is in the evidence",
                )  # fmt: skip
            for s in servers:
                unbacked.pop((p["round"], v.liar, s), None)
            verdicts.append(v)
    if unbacked:
        (r, peer, server), i = min(unbacked.items(), key=lambda x: x[1])
        raise LedgerError(
            i, f"verification: {server} is no validator, and no SWARM conviction of {peer} "
            f"in round {r} holds a reply of it",
        )  # fmt: skip
    return verdicts


def _check(e: Entry, keys: dict[str, str]) -> SwarmVerdict:
    p, i = e.payload, e.index
    liar = p["peer_id"]

    def fail(why: str) -> LedgerError:
        return LedgerError(i, f"conviction of stage server {liar}: {why}")

    if p.get("outcome") != "fraud":
        raise fail(f"its evidence rides on a dispute of outcome {p.get('outcome')!r}")
    ev = p["evidence"]
    try:
        stage, hop = int(ev["stage"]), str(ev["hop"])
        request, state, tolerance = str(ev["request"]), str(ev["state"]), float(ev["tolerance"])
        replies = [(str(r["server"]), str(r["reply"]), str(r["sig"])) for r in ev["replies"]]
        distances = {str(s): float(d) for s, d in dict(ev["distances"]).items()}
    except (KeyError, TypeError, ValueError) as err:
        raise fail(f"malformed evidence ({str(err)[:200]})") from None
    if hop not in ("forward", "backward") or len(replies) != 2:
        raise fail(f"evidence of a {hop!r} hop with {len(replies)} replies, not 2")
    if replies[0][0] == replies[1][0]:
        raise fail("both replies are from one server")
    if not (math.isfinite(tolerance) and tolerance > 0):
        raise fail(f"tolerance {tolerance!r} is no positive number")
    for server, reply, sig in replies:
        message = reply_message(stage, state, request, reply)
        if server not in keys or not verify(keys[server], message, sig):
            raise fail(f"the reply it cites of {server} is not signed by it")
    if liar not in {s for s, _, _ in replies}:
        raise fail("it is neither of the two servers whose replies the evidence cites")
    if not distances.get(liar, 0.0) > tolerance:  # nan included
        raise fail(f"the referee's distance {distances.get(liar)!r} is within {tolerance}")
    return SwarmVerdict(
        i, liar, stage, hop, request, state, tuple((s, r) for s, r, _ in replies), tolerance
    )
