"""Sharded rounds: the round driver's path above the crossover (issue 13 §1).

When a round closes with at least `trust.sharded_above_peers` accepted contributions and
staked aggregators (validators) have joined, the driver (covey.coordinator.rounds) does
not aggregate: `ShardRounds.begin` opens the round's shard board (covey.coordinator.
sharding) from a beacon over the closed input set, and every tick `advance` moves it on:

- a shard whose aggregator is silent past `shard_publish_timeout_s` passes to the next in
  its drawn order (`ShardBoard.expire`); a proven liar is slashed and its shards passed on;
- a shard nobody is left to publish is aggregated by the coordinator itself, so a round is
  never lost (it costs the coordinator that shard's byte ranges of every contribution);
- once every shard is published and every drawn check agreed, the coordinator fetches the
  new shards (O(model) bytes, never O(peers x model)), checks each against its signed
  hash, assembles the state, binds its digest into the shard certificate (stored in the
  database as meta `shards/<round>`) and commits the round with the ordinary certificate,
  whose `new_hash` is that digest: bit-identical to the unsharded `apply_round`.

Crash safety: nothing of a sharded round is durable before its commit; a coordinator
killed while one is open reopens the round on restart (its contributions are stored), it
closes again on the same inputs, the beacon draws the same aggregators, and they publish
again. `mount` adds the `/v1/shards` routes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi import Path as PathParam
from starlette.concurrency import run_in_threadpool

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
from covey.config import DiLoCoConfig, StreamingDiLoCoConfig
from covey.peer.aggregator import certified_shard
from covey.protocol import schemas
from covey.protocol.checkpoint import state_from_file
from covey.trust.identity import canonical_json, request_message, request_purpose, verify
from covey.trust.shard_evidence import read_inputs

from .openapi import errors
from .rejected import Rejected
from .sharding import ShardBoard, ShardError
from .views import OpenRound

if TYPE_CHECKING:
    from .service import Coordinator

log = logging.getLogger("covey.coordinator")

#: an aggregator that said it is ready within this long is in the draw
READY_S = 60.0
READY_PURPOSE = request_purpose("/v1/shards/ready")
#: a sharded round still open this many publish timeouts after it closed is finished by
#: the coordinator (workers wait limits.coordinator_lost_s past the deadline for it)
OVERDUE = 2.0


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


class ShardRounds:
    """The coordinator's side of sharded rounds (see the module docstring)."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord, self.rounds = coord, coord.rounds
        self.strategy, self.algo, self.trust = (
            coord.rounds.strategy,
            coord.cfg.algorithm,
            coord.cfg.trust,
        )
        self.names = list(self.strategy.names)
        self.numel = sum(self.rounds.template.params[n].numel() for n in self.names)
        self.plan = plan_shards(
            self.numel, self.trust.shards, codec_align(self.strategy.codec) or 1
        )
        self.with_momentum = getattr(self.algo, "outer_momentum", 0.0) != 0
        self.pending: Pending | None = None
        self.http = httpx.Client(timeout=30.0, trust_env=False)
        self._start: tuple[str, torch.Tensor, torch.Tensor | None] | None = None
        book = coord.accounts.book
        self.board = ShardBoard(
            coord.run_id,
            coord.identity,
            public_key=lambda p: a.public_key if (a := book.accounts.get(p)) else None,
            is_banned=lambda p: (a := book.accounts.get(p)) is None or a.banned,
            referee=lambda r, s: self.compute(r, s)[2],
            reads=self.reads,
            slash=self.slash,
            check_rate=self.trust.shard_check_rate,
            publish_timeout_s=self.trust.shard_publish_timeout_s,
        )

    # -- the committed inputs, recomputed here (referee, fallback) -------------------------

    def compute(self, round_: int, shard: int) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        """Shard `shard` of round `round_` from its board's inputs, as stored here: (params,
        momentum, hash). Reads only the shard's byte ranges of each contribution."""
        inputs = self.board.inputs(round_)
        cid = inputs["start_cid"]
        if self._start is None or self._start[0] != cid:
            state = state_from_file(self.coord.blobs.path(cid), self.rounds.template)
            self._start = (cid, *flat_state(state, self.names))
        _, params, momentum = self._start
        start, end = self.plan.span(shard)
        codec = self.strategy.codec
        slices = [
            read_slice(codec, self.numel, start, end, _reader(self.coord.blobs.view(c["cid"])))
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
            _reader(self.coord.blobs.view(c["cid"]))
            for c in self.board.inputs(round_)["contributions"]
        ]
        return read_inputs(self.strategy.codec, self.numel, self.plan.span(shard), readers)[1]

    def slash(self, round_: int, peer_id: str, reason: str, evidence: dict[str, Any]) -> None:
        """A "slash" entry with what it rests on (covey.trust.shard_evidence)."""
        accounts = self.coord.accounts
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
            for r in self.coord.db.query(
                "SELECT key, value FROM meta WHERE key LIKE 'aggregator/%'"
            )
            if now - float(r["value"]) < READY_S
        }
        return [
            a.peer_id
            for a in self.coord.accounts.book.accounts.values()
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
        if body.get("run_id") != self.coord.run_id or not isinstance(peer, str):
            raise ShardError(
                422, f"need this run's run_id and a peer_id, got {body.get('run_id')!r}"
            )
        account = self.coord.accounts.book.accounts.get(peer)
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
        with self.coord.db.transaction() as c:
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
        pool = self.aggregators(time.time())
        if not pool:
            log.warning("[round %d] %d contributions but no staked aggregators: the "
                        "coordinator aggregates", rnd.round, len(rows))  # fmt: skip
            return False
        rule, blobs = self.strategy.aggregator, self.coord.blobs
        norms = None
        if isinstance(rule, NormClip) and rule.factor > 0:
            # TODO(issue 13): contributors should commit block sums in their signed
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
        beacon = input_beacon(self.coord.run_id, rnd, self.rounds.state_hash, rows)
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
            self.board.take_over(r, s, h, self.coord.blobs.put(shard_to_bytes(new_p, new_m)))
            log.warning("[round %d] no aggregator delivered shard %d: the coordinator "
                        "aggregated it", r, s)  # fmt: skip
        cert = self.board.certificate(r)
        if cert is None:
            return
        state = self._assemble(r, cert)
        if state is None:
            return  # a shard was taken over at assembly: its certificate changed
        final = self.board.finish(r, state.digest())
        with self.coord.db.transaction() as c:  # peers fetch shard by shard with it
            c.execute(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)", (f"shards/{r}", json.dumps(final))
            )
        self.pending = None
        log.info("[round %d] shards certified after %.1f s", r, now - p.began)
        self.rounds._close(p.rnd, p.reason, assembled=(p.rows, state))

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
            self.board.take_over(r, s, h, self.coord.blobs.put(shard_to_bytes(new_p, new_m)))
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
                    cid = self.coord.blobs.put(shard_to_bytes(new_p, new_m))
                    self.board.take_over(r, i, h, cid)
                    return None
                got = (new_p, new_m)
            params.append(got[0])
            momenta.append(got[1])
        momentum = torch.cat(momenta) if self.with_momentum else None  # type: ignore[arg-type]
        return state_from_flat(self.rounds.state, self.names, torch.cat(params), momentum)

    def _fetch(self, cert: dict[str, Any], i: int) -> tuple[torch.Tensor, Any] | None:
        shard = cert["shards"][i]
        if self.coord.blobs.has(shard["cid"]):
            data = self.coord.blobs.get(shard["cid"])
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
            self.coord.blobs.put(resp.content)
            return got
        return None

    def stored(self, round_: int) -> dict[str, Any] | None:
        """The final shard certificate of a committed sharded round."""
        raw = self.coord.db.get_meta(f"shards/{round_}")
        return json.loads(raw) if raw else None


def _reader(view: memoryview) -> Callable[[int, int], bytes]:
    return lambda a, b: bytes(view[a:b])


def mount(app: FastAPI, coord: Coordinator) -> ShardBoard | None:
    """Make sharded rounds the driver's path above the crossover and add `/v1/shards`.
    DiLoCo (outer Nesterov SGD) only: another method is logged and left without (None)."""
    algo = coord.cfg.algorithm
    if not isinstance(algo, DiLoCoConfig) or isinstance(algo, StreamingDiLoCoConfig):
        log.info("sharded aggregation supports DiLoCo only, not %r: left off", algo.method)
        return None
    sharded = ShardRounds(coord)
    coord.rounds.sharding = sharded
    board = sharded.board

    async def body_of(request: Request) -> dict[str, Any]:
        """The JSON object a peer sent; 400 naming the problem when it is not one."""
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise Rejected(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise Rejected(400, f"the body must be a JSON object, not {type(body).__name__}")
        return body

    def answer(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            return fn()
        except ShardError as e:
            raise Rejected(e.status, e.message) from None

    def read(round_: int) -> dict[str, Any]:
        if board.has(round_):
            board.expire(round_, time.time())
            return board.view(round_)
        stored = sharded.stored(round_)
        if stored is None:
            raise ShardError(404, f"round {round_} has no shard board (not sharded, or not yet)")
        return {"round": round_, "start_hash": stored["start_hash"], "shards": [],
                "certificate": stored}  # fmt: skip

    def live() -> int:
        p = sharded.pending
        if p is None or not board.has(p.rnd.round):
            raise ShardError(404, "no sharded round is waiting on its aggregators")
        return p.rnd.round

    @app.get("/v1/shards", tags=["shards"], responses=errors(404))
    async def shard_pending() -> dict[str, Any]:
        """The board of the sharded round now waiting on its aggregators (404: none)."""
        return await run_in_threadpool(answer, lambda: read(live()))

    @app.post("/v1/shards/ready", tags=["shards"], responses=errors(400, 401, 403, 422))
    async def shard_ready(request: Request) -> dict[str, Any]:
        """A staked validator's signed statement that it aggregates: it is in the draw
        of rounds closing within the next minute (aggregators repeat it while they run)."""
        body = await body_of(request)
        return await run_in_threadpool(answer, lambda: sharded.ready(body, time.time()))

    @app.get("/v1/shards/{round}", tags=["shards"], responses=errors(404))
    async def shard_view(round: int = PathParam(ge=0, le=schemas.MAX_INT)) -> dict[str, Any]:
        """A sharded round's board: the plan, each shard's aggregator (a beacon draw) and
        checker, the published hashes, the inputs, and the signed shard certificate once
        every shard is published and every drawn check agreed (with `new_hash` once the
        round is committed)."""
        return await run_in_threadpool(answer, lambda: read(round))

    refusals = errors(400, 401, 403, 404, 409, 422)

    @app.post("/v1/shards/{round}/publish", tags=["shards"], responses=refusals)
    async def shard_publish(
        request: Request, round: int = PathParam(ge=0, le=schemas.MAX_INT)
    ) -> dict[str, Any]:
        """An aggregator's signed hash of its new shard, and the URL serving it."""
        body = await body_of(request)
        return await run_in_threadpool(answer, lambda: board.publish(round, body))

    @app.post("/v1/shards/{round}/check", tags=["shards"], responses=refusals)
    async def shard_check(
        request: Request, round: int = PathParam(ge=0, le=schemas.MAX_INT)
    ) -> dict[str, Any]:
        """A drawn checker's hash of a published shard: a disagreement goes to the
        referee, and a proven wrong shard slashes its aggregator."""
        body = await body_of(request)
        return await run_in_threadpool(answer, lambda: board.check(round, body, time.time()))

    return board
