"""Sharded aggregation: the round driver's path above the crossover, one of the rounds
mode's aggregations (covey.coordinator.aggregation picks it from the run spec).

When a round closes with at least `trust.sharded_above_peers` accepted contributions and
staked aggregators (validators) have joined, the driver (covey.coordinator.rounds) does
not aggregate: `ShardedAggregation.begin` opens the round's shard board (covey.coordinator.
sharding) from a beacon over the closed input set, and every tick `advance` moves it on:

- a shard whose aggregator is silent past `shard_publish_timeout_s` passes to the next in
  its drawn order (`ShardBoard.expire`); a proven liar is slashed and its shards passed on;
- a shard nobody is left to publish is aggregated by the coordinator itself, so a round is
  never lost (it costs the coordinator that shard's byte ranges of every contribution);
- once every shard is published and every drawn check agreed, the coordinator fetches the
  new shards (O(model) bytes, never O(peers x model)), checks each against its signed
  hash, assembles the state, binds its digest into the shard certificate (stored in the
  database as meta `shards/<round>`) and commits the round with the ordinary certificate,
  whose `new_hash` is that digest: bit-identical to the unsharded `apply_round`;
- after the commit, the round's late check (covey.coordinator.shard_audit) recomputes every
  certified shard in a thread; the next round's `begin` waits for it before it draws.

Crash safety: nothing of a sharded round is durable before its commit; a coordinator
killed while one is open reopens the round on restart (its contributions are stored), it
closes again on the same inputs, the beacon draws the same aggregators, and they publish
again. Its `router` holds the `/v1/shards` routes, which the HTTP app includes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import torch

from covey.algorithms import TrainState
from covey.algorithms.aggregation import NormClip, l2_norm
from covey.algorithms.shards import (
    codec_align,
    flat_state,
    new_shard,
    plan_shards,
    read_slice,
    shard_hash,
    shard_to_bytes,
    state_from_flat,
)
from covey.blobs import BlobStore
from covey.config import RunConfig
from covey.peer.aggregator import certified_shard
from covey.protocol.checkpoint import state_from_file
from covey.trust.identity import (
    Identity,
    canonical_json,
    request_message,
    request_purpose,
    verify,
)
from covey.trust.shard_evidence import read_inputs

from .accounts import Accounts
from .db import Database
from .model import RunModel
from .shard_audit import LateChecks
from .shard_routes import shard_router
from .sharding import ShardBoard, ShardError
from .views import OpenRound

log = logging.getLogger("covey.coordinator")

#: an aggregator that said it is ready within this long is in the draw
READY_S = 60.0
READY_PURPOSE = request_purpose("/v1/shards/ready")
#: a sharded round still open this many publish timeouts after it closed is finished by
#: the coordinator (workers wait limits.coordinator_lost_s past the deadline for it)
OVERDUE = 2.0


class RoundsState(Protocol):
    """What sharded aggregation reads of the rounds mode when a round closes: its current
    (start) state, that state's content id and its weights hash."""

    state: TrainState
    state_cid: str
    state_hash: str


class Commit(Protocol):
    """Commits a closed round with its accepted rows and the state its shards assembled
    into (the rounds mode's close, covey.coordinator.rounds.Rounds._close)."""

    def __call__(
        self, rnd: OpenRound, reason: str, assembled: tuple[list[Any], TrainState]
    ) -> None: ...


@dataclass
class Pending:
    """The sharded round the driver waits on: what `_close` will commit."""

    rnd: OpenRound
    rows: list[Any]
    reason: str
    began: float


def input_beacon(run_id: str, rnd: OpenRound, start_hash: str, rows: list[Any]) -> str:
    """The round's beacon: a hash of its closed input set, unknown before intake closed."""
    inputs = [[r["peer_id"], r["cid"], r["tokens"]] for r in rows]
    body = {"run_id": run_id, "round": rnd.round, "attempt": rnd.attempt,
            "start_hash": start_hash, "inputs": inputs}  # fmt: skip
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


class ShardedAggregation:
    """The coordinator's side of sharded rounds (see the module docstring)."""

    name = "sharded"

    def __init__(
        self,
        cfg: RunConfig,
        *,
        run_id: str,
        identity: Identity,
        db: Database,
        accounts: Accounts,
        blobs: BlobStore,
        model: RunModel,
        rounds: RoundsState,
        commit: Commit,
    ) -> None:
        """Sharded aggregation of a DiLoCo run (`cfg.algorithm` has the outer step's
        parameters). `rounds` gives the start state of a closing round; `commit` commits a
        round once its shards are assembled."""
        self.run_id, self.identity, self.db = run_id, identity, db
        self.accounts, self.blobs = accounts, blobs
        self.rounds, self.commit = rounds, commit
        self.strategy, self.template = model.strategy, model.template
        self.algo, self.trust = cfg.algorithm, cfg.trust
        self.names = list(self.strategy.names)
        self.numel = sum(self.template.params[n].numel() for n in self.names)
        self.plan = plan_shards(
            self.numel, self.trust.shards, codec_align(self.strategy.codec) or 1
        )
        self.with_momentum = getattr(self.algo, "outer_momentum", 0.0) != 0
        self.pending: Pending | None = None
        self.http = httpx.Client(timeout=30.0, trust_env=False)
        self._start: tuple[str, torch.Tensor, torch.Tensor | None] | None = None
        book = accounts.book
        self.board = ShardBoard(
            run_id,
            identity,
            public_key=lambda p: a.public_key if (a := book.accounts.get(p)) else None,
            is_banned=lambda p: (a := book.accounts.get(p)) is None or a.banned,
            referee=lambda r, s: self.compute(r, s)[2],
            reads=self.reads,
            slash=self.slash,
            check_rate=self.trust.shard_check_rate,
            publish_timeout_s=self.trust.shard_publish_timeout_s,
        )
        self.late = LateChecks(self.board, accounts, lambda r, s: self.compute(r, s)[2])
        self.router = shard_router(
            self.board,
            waiting_round=lambda: None if (p := self.pending) is None else p.rnd.round,
            stored=self.stored,
            ready=self.ready,
        )

    @property
    def waiting(self) -> bool:
        """A closed round waits on its aggregators (the driver only calls `advance`)."""
        return self.pending is not None

    def close(self) -> None:
        self.http.close()

    # -- the committed inputs, recomputed here (referee, fallback) -------------------------

    def compute(self, round_: int, shard: int) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        """Shard `shard` of round `round_` from its board's inputs, as stored here: (params,
        momentum, hash). Reads only the shard's byte ranges of each contribution."""
        inputs = self.board.inputs(round_)
        cid = inputs["start_cid"]
        start_state = self._start  # one read: the late check's thread computes too
        if start_state is None or start_state[0] != cid:
            state = state_from_file(self.blobs.path(cid), self.template)
            start_state = self._start = (cid, *flat_state(state, self.names))
        _, params, momentum = start_state
        start, end = self.plan.span(shard)
        codec = self.strategy.codec
        slices = [
            read_slice(codec, self.numel, start, end, _reader(self.blobs.view(c["cid"])))
            for c in inputs["contributions"]
        ]
        new_p, new_m = new_shard(
            self.strategy.aggregator,
            slices,
            inputs["weights"],
            inputs["norms"],
            params[start:end],
            None if momentum is None else momentum[start:end],
            lr=self.algo.outer_lr,  # type: ignore[union-attr]
            momentum_coef=self.algo.outer_momentum,  # type: ignore[union-attr]
            nesterov=self.algo.nesterov,  # type: ignore[union-attr]
        )
        return new_p, new_m, shard_hash(round_, shard, start, new_p, new_m)

    def reads(self, round_: int, shard: int) -> str:
        """The digest of the byte ranges an aggregator of `shard` reads of each of the
        round's contributions (covey.trust.shard_evidence.reads_digest), from the blobs
        here: a publish must name it. Reads only the shard's ranges."""
        readers = [
            _reader(self.blobs.view(c["cid"])) for c in self.board.inputs(round_)["contributions"]
        ]
        return read_inputs(self.strategy.codec, self.numel, self.plan.span(shard), readers)[1]

    def slash(self, round_: int, peer_id: str, reason: str, evidence: dict[str, Any]) -> None:
        """A "slash" entry with what it rests on (covey.trust.shard_evidence)."""
        accounts = self.accounts
        with accounts.transaction() as c:
            amount = accounts.book.slash_amount(peer_id)
            payload = {"round": round_, "peer_id": peer_id, "amount": amount, "reason": reason,
                       "evidence": evidence}  # fmt: skip
            accounts.append(c, "slash", payload, time.time())
        log.warning("[round %d] aggregator %s slashed: %s", round_, peer_id[:12], reason)

    def aggregators(self, now: float) -> list[str]:
        """The draw's pool: staked, unbanned validators that said they aggregate (`POST
        /v1/shards/ready`) within READY_S; a validator that only re-executes is never
        drawn, so it costs no round a publish timeout."""
        least = self.trust.min_validator_stake
        ready = {
            r["key"].removeprefix("aggregator/")
            for r in self.db.query("SELECT key, value FROM meta WHERE key LIKE 'aggregator/%'")
            if now - float(r["value"]) < READY_S
        }
        return [
            a.peer_id
            for a in self.accounts.book.accounts.values()
            if a.role == "validator"
            and not a.banned
            and a.stake > 0
            and a.stake >= least
            and a.peer_id in ready
        ]

    def ready(self, body: dict[str, Any], now: float) -> dict[str, Any]:
        """A validator's signed "I aggregate" (fresh nonce), kept in the database so a
        restarted coordinator still draws it. ShardError for anything else."""
        peer = body.get("peer_id")
        if body.get("run_id") != self.run_id or not isinstance(peer, str):
            raise ShardError(
                422, f"need this run's run_id and a peer_id, got {body.get('run_id')!r}"
            )
        account = self.accounts.book.accounts.get(peer)
        nonce, signature = str(body.get("nonce", "")), body.get("signature")
        message = request_message(body, -1, READY_PURPOSE)
        if account is None or not isinstance(signature, str):
            raise ShardError(401, f"peer {peer[:12]} has not joined as a validator")
        if not verify(account.public_key, message, signature):
            raise ShardError(401, f"bad signature from {peer[:12]} on its shard readiness")
        if not nonce[:13].isdigit() or abs(now - int(nonce[:13]) / 1000) > READY_S:
            raise ShardError(401, f"stale readiness from {peer[:12]} (nonce {nonce[:20]!r})")
        if account.role != "validator" or account.banned:
            raise ShardError(
                403, f"peer {peer[:12]} is excluded (not a validator in good standing)"
            )
        with self.db.transaction() as c:
            c.execute(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)", (f"aggregator/{peer}", repr(now))
            )
        return {"ok": True, "stake": account.stake}

    # -- the round driver's hooks ------------------------------------------------------------

    def begin(self, rnd: OpenRound, rows: list[Any], reason: str) -> bool:
        """Open `rnd`'s shard board instead of aggregating, when it is big enough and has
        aggregators: True (the driver then waits for `advance`); False: the driver
        aggregates as below the crossover."""
        above = self.trust.sharded_above_peers
        if not above or len(rows) < above:
            return False
        if not self.late.wait():  # a liar of the last round is banned before this draw
            log.warning("[round %d] the last round's late check is still running", rnd.round)
        pool = self.aggregators(time.time())
        if not pool:
            log.warning("[round %d] %d contributions but no staked aggregators: the "
                        "coordinator aggregates", rnd.round, len(rows))  # fmt: skip
            return False
        rule, blobs = self.strategy.aggregator, self.blobs
        norms = None
        if isinstance(rule, NormClip) and rule.factor > 0:
            # Not done yet: contributors should commit block sums in their signed
            # submissions (shards.block_square_sums) so this decode leaves the coordinator
            codec = self.strategy.codec
            norms = [l2_norm(codec.decode(blobs.view(r["cid"]), self.numel)) for r in rows]
        inputs = {
            "codec": self.strategy.codec.name,
            "start_cid": self.rounds.state_cid,  # the start state, on this blob plane
            "contributions": [
                {"peer_id": r["peer_id"], "cid": r["cid"], "size": r["size"]} for r in rows
            ],
            "weights": [float(r["tokens"]) for r in rows],
            "norms": norms,
        }
        beacon = input_beacon(self.run_id, rnd, self.rounds.state_hash, rows)
        now = time.time()
        self.board.drop_before(rnd.round - 3)
        self.board.discard(rnd.round)  # an earlier attempt's board
        self.board.open(rnd.round, self.rounds.state_hash, beacon, self.plan, pool, inputs, now)
        self.pending = Pending(rnd, rows, reason, now)
        log.info("[round %d] sharded: %d contributions, %d shards, %d aggregators",
                 rnd.round, len(rows), self.plan.count, len(pool))  # fmt: skip
        return True

    def advance(self, now: float) -> None:
        """One driver tick of the pending sharded round: pass late shards on, aggregate
        orphaned ones here, and commit once the shard certificate is complete."""
        p = self.pending
        if p is None:
            return
        r = p.rnd.round
        self.board.expire(r, now)
        if now - p.began > OVERDUE * self.trust.shard_publish_timeout_s:
            self._overdue(r)  # workers wait for the certificate: finish it here
        for s in self.board.orphans(r):
            new_p, new_m, h = self.compute(r, s)
            self.board.take_over(r, s, h, self.blobs.put(shard_to_bytes(new_p, new_m)))
            log.warning("[round %d] no aggregator delivered shard %d: the coordinator "
                        "aggregated it", r, s)  # fmt: skip
        cert = self.board.certificate(r)
        if cert is None:
            return
        state = self._assemble(r, cert)
        if state is None:
            return  # a shard was taken over at assembly: its certificate changed
        final = self.board.finish(r, state.digest())
        with self.db.transaction() as c:  # peers fetch shard by shard with it
            c.execute(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)", (f"shards/{r}", json.dumps(final))
            )
        self.pending = None
        log.info("[round %d] shards certified after %.1f s", r, now - p.began)
        self.commit(p.rnd, p.reason, (p.rows, state))
        self.late.start(r)  # every certified shard recomputed, off the critical path

    def _overdue(self, r: int) -> None:
        """Past the round's sharding deadline: aggregate every unpublished shard here, and
        do every drawn check still open here (a wrong shard: its aggregator is slashed and
        the shard taken over)."""
        missing, unchecked = self.board.unfinished(r)
        published = self.board.view(r)["shards"]
        for s in missing + unchecked:
            new_p, new_m, h = self.compute(r, s)
            pub = published[s]["published"]
            if pub is not None and pub["hash"] == h:
                self.board.agree(r, s)
                continue
            if pub is not None:
                why = f"shard {s} of round {r}: published {pub['hash'][:16]}, is {h[:16]}"
                self.slash(r, pub["aggregator"], why, self.board.evidence(r, s, h))
            self.board.take_over(r, s, h, self.blobs.put(shard_to_bytes(new_p, new_m)))
        if missing or unchecked:
            log.warning("[round %d] sharding overdue: the coordinator aggregated shards %s "
                        "and checked %s itself", r, missing, unchecked)  # fmt: skip

    def _assemble(self, r: int, cert: dict[str, Any]) -> TrainState | None:
        """The new state from the certified shards, each fetched from its providers and
        checked against its hash (kept here too: the coordinator is a last provider). A
        shard nobody serves is recomputed here; if its certified hash is not the truth,
        its aggregator is slashed, the shard taken over, and None returned."""
        params, momenta = [], []
        for shard in cert["shards"]:
            i = shard["index"]
            got = self._fetch(cert, i)
            if got is None:
                new_p, new_m, h = self.compute(r, i)
                if h != shard["hash"]:
                    why = f"shard {i} of round {r}: published {shard['hash'][:16]}, is {h[:16]}"
                    self.slash(r, shard["aggregator"], why, self.board.evidence(r, i, h))
                    cid = self.blobs.put(shard_to_bytes(new_p, new_m))
                    self.board.take_over(r, i, h, cid)
                    return None
                got = (new_p, new_m)
            params.append(got[0])
            momenta.append(got[1])
        momentum = torch.cat(momenta) if self.with_momentum else None  # type: ignore[arg-type]
        return state_from_flat(self.rounds.state, self.names, torch.cat(params), momentum)

    def _fetch(self, cert: dict[str, Any], i: int) -> tuple[torch.Tensor, Any] | None:
        shard = cert["shards"][i]
        if self.blobs.has(shard["cid"]):
            data = self.blobs.get(shard["cid"])
            try:
                return certified_shard(cert, i, data, self.with_momentum)
            except ValueError:
                pass
        for url in shard["providers"]:
            if not url:
                continue
            try:
                resp = self.http.get(f"{url.rstrip('/')}/v1/blobs/{shard['cid']}")
                if resp.status_code != 200:
                    raise ValueError(f"{resp.status_code}")
                got = certified_shard(cert, i, resp.content, self.with_momentum)
            except (ValueError, httpx.HTTPError) as e:
                log.warning("[round %d] shard %d from %s: %s", cert["round"], i, url, e)
                continue
            self.blobs.put(resp.content)
            return got
        return None

    def stored(self, round_: int) -> dict[str, Any] | None:
        """The final shard certificate of a committed sharded round."""
        raw = self.db.get_meta(f"shards/{round_}")
        return json.loads(raw) if raw else None


def _reader(view: memoryview) -> Callable[[int, int], bytes]:
    return lambda a, b: bytes(view[a:b])
