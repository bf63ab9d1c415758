"""Sharded aggregation's coordinator side (docs/sharded-aggregation.md): it certifies
shard hashes, never tensors.

For each sharded round r a `ShardBoard` draws, from a beacon (the hash of round r's
closed input set, unknown before its inputs were fixed), an ordered list of staked aggregators
per shard: the first aggregates, the rest are its fallbacks in order. Aggregators publish
each new shard's hash, signed (`POST /v1/shards/{r}/publish`); a drawn share of shards
is re-aggregated by the next aggregator in the shard's order (`POST /v1/shards/{r}/check`).
A check that disagrees goes to the referee, which recomputes the shard from the committed
inputs (the certified contributions and round r's start state): a published hash that
differs is fraud -- the aggregator is slashed (a "slash" ledger entry, which bans it) and
the shard passes to the next aggregator, so the round is not lost; a checker that was
wrong changes nothing. Once every shard holds a published hash and every drawn check
agreed, the coordinator signs the shard certificate; peers fetch the shards from the
aggregators and compare each hash with it (covey.peer.aggregator). After the commit,
every certified shard is recomputed once more (covey.coordinator.shard_audit): a wrong one
convicts its aggregator late, and each checker that agreed with it pays missed fraud.

The draws (`assign_shards`, `drawn_for_check`) are pure functions of public values, so
anyone recomputes them. The round driver's use of the board (open at close, commit on
the certificate) is covey.coordinator.shard_rounds.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from covey.algorithms.shards import (
    ShardPlan,
)
from covey.peer.aggregator import certificate_message, shard_purpose
from covey.trust.identity import Identity, request_message, verify
from covey.trust.shard_evidence import board_digest, board_fields, evidence

log = logging.getLogger("covey.coordinator")

#: domain tag of the draw that picks shards for a re-aggregation check
CHECK_DOMAIN = "covey-shard-check/v1"


def shard_rank(beacon: str, round: int, shard: int, peer_id: str) -> str:
    """An aggregator's place in a shard's order (lower first): public, unpredictable
    before the beacon."""
    message = f"covey-shard-assign/v1\n{beacon}\n{round}\n{shard}\n{peer_id}"
    return hashlib.sha256(message.encode()).hexdigest()


def assign_shards(
    beacon: str, round: int, shards: int, aggregators: Sequence[str]
) -> list[tuple[str, ...]]:
    """Per shard, every aggregator in order: [0] aggregates, the rest are fallbacks (and
    [1] checks it when drawn). The first places are balanced: no aggregator is first for
    more than ceil(shards / aggregators) shards; within that, each shard takes its
    best-ranked aggregator. ValueError with no aggregators."""
    pool = sorted(set(aggregators))
    if not pool:
        raise ValueError("no staked aggregators to assign shards to")
    cap, load = -(-shards // len(pool)), dict.fromkeys(pool, 0)
    out = []
    for s in range(shards):
        ranked = sorted(pool, key=lambda p: shard_rank(beacon, round, s, p))
        first = next(p for p in ranked if load[p] < cap)
        load[first] += 1
        out.append((first, *[p for p in ranked if p != first]))
    return out


def drawn_for_check(beacon: str, round: int, shard: int, rate: float) -> bool:
    """Whether shard `shard` of round `round` is re-aggregated by a second aggregator."""
    digest = hashlib.sha256(f"{CHECK_DOMAIN}\n{beacon}\n{round}\n{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < rate * 2**64


@dataclass
class ShardRound:
    """One round's board: its inputs and what the aggregators said about each shard."""

    round: int
    start_hash: str
    beacon: str
    plan: ShardPlan
    orders: list[tuple[str, ...]]
    checked: set[int]  # shards drawn for a check
    inputs: dict[str, Any]  # what aggregators need: contributions, weights, norms
    opened_at: float = 0.0
    turn: list[int] = field(default_factory=list)  # position in each order now aggregating
    turn_since: list[float] = field(default_factory=list)  # when each shard's turn began
    published: dict[int, dict[str, Any]] = field(default_factory=dict)
    agreed: set[int] = field(default_factory=set)
    frauds: list[dict[str, Any]] = field(default_factory=list)
    new_hash: str | None = None  # the assembled state's digest, once the driver has it
    late: dict[str, Any] = field(default_factory=lambda: {"status": "not started"})

    def current(self, shard: int) -> str | None:
        order, k = self.orders[shard], self.turn[shard]
        return order[k] if k < len(order) else None

    def checker(self, shard: int, banned: Callable[[str], bool]) -> str | None:
        """The drawn checker: the first aggregator after the current one not banned."""
        order, k = self.orders[shard], self.turn[shard]
        return next((p for p in order[k + 1 :] if not banned(p)), None)


class ShardError(Exception):
    """A refused request: `status` (HTTP) and a message naming the values."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class ShardBoard:
    """The shard rounds of one run. Thread-safe; clock-free; knows nothing of HTTP.

    `public_key(peer_id)` gives a peer's key (None: unknown); `is_banned(peer_id)` its
    standing; `referee(round, shard)` recomputes a shard's hash from the committed inputs
    (raising when it cannot: then nobody is slashed); `slash(round, peer_id, reason,
    evidence)` writes the penalty with what it rests on (`evidence`); `reads(round, shard)`,
    if given, is the digest of the byte ranges of the round's contributions an aggregator
    of the shard reads (covey.trust.shard_evidence.reads_digest): a publish must name it.
    """

    def __init__(
        self,
        run_id: str,
        identity: Identity,
        *,
        public_key: Callable[[str], str | None],
        is_banned: Callable[[str], bool],
        referee: Callable[[int, int], str],
        slash: Callable[[int, str, str, dict[str, Any]], None],
        check_rate: float,
        publish_timeout_s: float,
        reads: Callable[[int, int], str] | None = None,
    ) -> None:
        self.run_id, self.identity = run_id, identity
        self._public_key, self._is_banned = public_key, is_banned
        self._referee, self._slash, self.check_rate = referee, slash, check_rate
        self._reads = reads
        self.publish_timeout_s = publish_timeout_s
        self._rounds: dict[int, ShardRound] = {}
        self._lock = threading.RLock()

    def open(
        self,
        round: int,
        start_hash: str,
        beacon: str,
        plan: ShardPlan,
        aggregators: Sequence[str],
        inputs: dict[str, Any],
        now: float,
    ) -> ShardRound:
        """Open round `round`'s board at time `now` (idempotent: an open board is returned
        as it is)."""
        with self._lock:
            if round in self._rounds:
                return self._rounds[round]
            orders = assign_shards(beacon, round, plan.count, aggregators)
            checked = {
                s
                for s in range(plan.count)
                if drawn_for_check(beacon, round, s, self.check_rate) and len(orders[s]) > 1
            }
            rnd = ShardRound(round, start_hash, beacon, plan, orders, checked, inputs, now)
            rnd.turn, rnd.turn_since = [0] * plan.count, [now] * plan.count
            self._rounds[round] = rnd
            return rnd

    def has(self, round: int) -> bool:
        return round in self._rounds

    def inputs(self, round: int) -> dict[str, Any]:
        with self._lock:
            return self._get(round).inputs

    def evidence(self, round: int, shard: int, truth: str) -> dict[str, Any]:
        """What a slash for shard `shard`'s published hash rests on, for the ledger
        (covey.trust.shard_evidence): the aggregator's signed publish, the round's inputs
        and the referee's hash. KeyError when the shard holds no signed publish."""
        with self._lock:
            return self._evidence(self._get(round), shard, truth)

    @staticmethod
    def _board(rnd: ShardRound, shard: int) -> dict[str, Any]:
        """What an aggregator of `shard` computes from (covey.trust.shard_evidence)."""
        ins = rnd.inputs
        rows = zip(ins["contributions"], ins["weights"], strict=True)
        return board_fields(
            rnd.round, rnd.start_hash, rnd.plan.span(shard), rnd.plan.numel,
            [(c["peer_id"], c["cid"], w) for c, w in rows], ins["norms"],
        )  # fmt: skip

    def _evidence(self, rnd: ShardRound, shard: int, truth: str) -> dict[str, Any]:
        signed, board = rnd.published[shard]["signed"], self._board(rnd, shard)
        return evidence(rnd.round, shard, signed, board, rnd.inputs["start_cid"], truth)

    def discard(self, round: int) -> None:
        with self._lock:
            self._rounds.pop(round, None)

    def _get(self, round: int) -> ShardRound:
        if round not in self._rounds:
            raise ShardError(404, f"round {round} has no shard board (not committed yet?)")
        return self._rounds[round]

    def _authentic(self, round: int, action: str, body: dict[str, Any]) -> tuple[str, int, str]:
        """(peer id, shard, hash) of a signed body, or ShardError."""
        peer, shard, value = body.get("peer_id"), body.get("index"), body.get("hash")
        if body.get("run_id") != self.run_id:
            raise ShardError(422, f"run_id {body.get('run_id')!r} is not this run's")
        if not isinstance(peer, str) or not isinstance(shard, int) or not isinstance(value, str):
            raise ShardError(422, "need peer_id (text), index (int), hash (text)")
        key = self._public_key(peer)
        signature = body.get("signature")
        message = request_message(body, round, shard_purpose(round, action))
        if key is None or not isinstance(signature, str) or not verify(key, message, signature):
            raise ShardError(401, f"bad signature from {peer[:12]} on its shard {action}")
        if self._is_banned(peer):
            raise ShardError(403, f"peer {peer[:12]} is excluded from this run")
        return peer, shard, value

    def publish(self, round: int, body: dict[str, Any]) -> dict[str, Any]:
        """An aggregator's signed hash of a new shard, with the URL that serves its blob
        (`cid`). Only from the aggregator whose turn the shard is; ShardError otherwise."""
        with self._lock:
            rnd = self._get(round)
            peer, shard, value = self._authentic(round, "publish", body)
            if not 0 <= shard < rnd.plan.count:
                raise ShardError(422, f"shard {shard} does not exist ({rnd.plan.count} shards)")
            if rnd.current(shard) != peer:
                raise ShardError(409, f"shard {shard} of round {round} is not {peer[:12]}'s")
            if shard in rnd.published:
                raise ShardError(409, f"shard {shard} of round {round} is published already")
            if self._reads is not None and body.get("reads") != self._reads(round, shard):
                # else a liar could name bytes it never read and void its own slash
                raise ShardError(
                    422, f"the publish names reads {str(body.get('reads'))[:16]!r}: not the "
                    f"digest of the contributions' bytes of shard {shard}",
                )  # fmt: skip
            if body.get("board") != board_digest(**self._board(rnd, shard)):
                raise ShardError(
                    422, f"the publish names board {str(body.get('board'))[:16]!r}, not this "
                    f"round's board of shard {shard} (board_digest of round, start, span, inputs)",
                )  # fmt: skip
            rnd.published[shard] = {
                "hash": value,
                "aggregator": peer,
                "cid": str(body.get("cid", "")),
                "providers": [str(body.get("url", ""))],
                "signed": dict(body),  # the evidence should the hash prove wrong
            }
            return {"ok": True, "shard": shard}

    def check(self, round: int, body: dict[str, Any], now: float) -> dict[str, Any]:
        """A drawn checker's own hash of a published shard. Equal: the shard is checked
        (the checker becomes a second source). Different: the referee recomputes; fraud
        slashes the aggregator and passes the shard to the next in its order."""
        with self._lock:
            rnd = self._get(round)
            peer, shard, value = self._authentic(round, "check", body)
            if shard not in rnd.checked or rnd.checker(shard, self._is_banned) != peer:
                raise ShardError(409, f"{peer[:12]} is not the drawn checker of shard {shard}")
            pub = rnd.published.get(shard)
            if pub is None:
                raise ShardError(404, f"shard {shard} of round {round} is not published yet")
            if value == pub["hash"]:
                rnd.agreed.add(shard)
                pub["providers"].append(str(body.get("url", "")))
                # the checker's signed word: should a late check prove the shard wrong,
                # it pays for having agreed (covey.coordinator.shard_audit)
                pub.setdefault("checks", []).append(dict(body))
                return {"ok": True, "outcome": "agree"}
        # recomputation can take a while: outside the lock, then decided under it
        try:
            truth = self._referee(round, shard)
        except Exception as e:  # a failed referee convicts nobody (docs/trust.md)
            return {"ok": True, "outcome": "inconclusive", "detail": str(e)[:200]}
        with self._lock:
            if rnd.published.get(shard) is not pub:
                return {"ok": True, "outcome": "stale"}
            if truth == pub["hash"]:
                return {"ok": True, "outcome": "checker wrong"}
            liar = pub["aggregator"]
            reason = (
                f"shard {shard} of round {round}: published {pub['hash'][:16]}, is {truth[:16]}"
            )
            proof = self._evidence(rnd, shard, truth)
            self._slash(round, liar, f"wrong aggregate: {reason}", proof)
            rnd.frauds.append({"shard": shard, "aggregator": liar, "checker": peer})
            rnd.checked.discard(shard)  # the next aggregator is the one who proved it
            for s, other in list(rnd.published.items()):  # nothing unchecked of a liar stays
                if other["aggregator"] == liar and s not in rnd.agreed:
                    del rnd.published[s]
                    self._next_turn(rnd, s, now)
            for s in range(rnd.plan.count):  # nor does a turn it has not used yet wait on it
                if s not in rnd.published and rnd.current(s) == liar:
                    self._next_turn(rnd, s, now)
            return {"ok": True, "outcome": "fraud", "next": rnd.current(shard)}

    def _next_turn(self, rnd: ShardRound, shard: int, now: float) -> None:
        """Pass `shard` to the next aggregator in its order that is not banned."""
        rnd.turn[shard] += 1
        while rnd.current(shard) is not None and self._is_banned(rnd.current(shard) or ""):
            rnd.turn[shard] += 1
        rnd.turn_since[shard] = now

    def take_over(self, round: int, shard: int, value: str, cid: str, url: str = "") -> None:
        """The coordinator's own shard: when no aggregator is left to publish it, or the
        published one proved wrong at assembly. Counts as published and checked."""
        with self._lock:
            rnd = self._get(round)
            rnd.published[shard] = {
                "hash": value,
                "aggregator": self.identity.peer_id,
                "cid": cid,
                "providers": [url] if url else [],
            }
            rnd.agreed.add(shard)

    def certified(self, round: int) -> list[tuple[int, dict[str, Any]]]:
        """(shard, a copy of what was published) of each shard an aggregator published
        (with its signed publish and the signed checks that agreed with it): what a late
        check recomputes (covey.coordinator.shard_audit). The coordinator's own are left
        out."""
        with self._lock:
            rnd = self._get(round)
            return [
                (s, {**pub, "checks": list(pub.get("checks", []))})
                for s, pub in sorted(rnd.published.items())
                if "signed" in pub
            ]

    def set_late(self, round: int, **status: Any) -> None:
        """Record where round `round`'s late check stands (shown on its board)."""
        with self._lock:
            if round in self._rounds:
                self._rounds[round].late = {**self._rounds[round].late, **status}

    def unfinished(self, round: int) -> tuple[list[int], list[int]]:
        """(shards not published, shards published but drawn for a check that has not
        agreed yet): what keeps the certificate back."""
        with self._lock:
            rnd = self._get(round)
            missing = [s for s in range(rnd.plan.count) if s not in rnd.published]
            unchecked = [
                s
                for s in sorted(rnd.checked)
                if s in rnd.published
                and s not in rnd.agreed
                and rnd.checker(s, self._is_banned) is not None
            ]
            return missing, unchecked

    def agree(self, round: int, shard: int) -> None:
        """The coordinator checked a published shard itself and it was right."""
        with self._lock:
            self._get(round).agreed.add(shard)

    def orphans(self, round: int) -> list[int]:
        """Shards nobody is left to publish (every aggregator in the order failed)."""
        with self._lock:
            rnd = self._get(round)
            return [
                s
                for s in range(rnd.plan.count)
                if s not in rnd.published and rnd.current(s) is None
            ]

    def finish(self, round: int, new_hash: str) -> dict[str, Any]:
        """Bind the assembled state's digest into the shard certificate: the final,
        signed certificate (ValueError if not every shard is published and checked)."""
        with self._lock:
            rnd = self._get(round)
            rnd.new_hash = new_hash
            cert = self._certificate(rnd)
            if cert is None:
                raise ValueError(f"round {round}: shards are still missing or unchecked")
            return cert

    def certificate(self, round: int) -> dict[str, Any] | None:
        with self._lock:
            return self._certificate(self._get(round))

    def drop_before(self, round: int) -> None:
        """Forget the boards of rounds before `round` (their certificates are stored)."""
        with self._lock:
            for r in [r for r in self._rounds if r < round]:
                del self._rounds[r]

    def expire(self, round: int, now: float) -> list[int]:
        """Pass every shard whose aggregator did not publish within `publish_timeout_s`
        of its turn to its next aggregator (a failed aggregator loses the turn, not the
        round); the shards passed on."""
        with self._lock:
            rnd = self._get(round)
            passed = []
            for s in range(rnd.plan.count):
                late = now - rnd.turn_since[s] > self.publish_timeout_s
                if s not in rnd.published and rnd.current(s) is not None and late:
                    self._next_turn(rnd, s, now)
                    passed.append(s)
            return passed

    def view(self, round: int) -> dict[str, Any]:
        """What aggregators and peers read: the plan, each shard's order, turn and drawn
        check, what was published, the inputs, and the certificate once there is one."""
        with self._lock:
            rnd = self._get(round)
            shards = []
            for s in range(rnd.plan.count):
                start, end = rnd.plan.span(s)
                shards.append(
                    {
                        "index": s,
                        "start": start,
                        "end": end,
                        "aggregator": rnd.current(s),
                        "checker": rnd.checker(s, self._is_banned) if s in rnd.checked else None,
                        "published": rnd.published.get(s),
                        "agreed": s in rnd.agreed,
                    }
                )
            return {
                "round": round,
                "start_hash": rnd.start_hash,
                "beacon": rnd.beacon,
                "numel": rnd.plan.numel,
                "shards": shards,
                "inputs": rnd.inputs,
                "frauds": list(rnd.frauds),
                "late_check": dict(rnd.late),
                "certificate": self._certificate(rnd),
            }

    def _certificate(self, rnd: ShardRound) -> dict[str, Any] | None:
        done = all(
            s in rnd.published
            and (
                s not in rnd.checked
                or s in rnd.agreed
                or rnd.checker(s, self._is_banned) is None  # nobody left to check it
            )
            for s in range(rnd.plan.count)
        )
        if not done:
            return None
        body = {
            "run_id": self.run_id,
            "round": rnd.round,
            "start_hash": rnd.start_hash,
            "new_hash": rnd.new_hash,
            "numel": rnd.plan.numel,
            "bounds": list(rnd.plan.bounds),
            "shards": [
                {
                    "index": s,
                    "hash": rnd.published[s]["hash"],
                    "cid": rnd.published[s]["cid"],
                    "aggregator": rnd.published[s]["aggregator"],
                    "providers": rnd.published[s]["providers"],
                }
                for s in range(rnd.plan.count)
            ],
        }
        return {**body, "signature": self.identity.sign(certificate_message(body))}
