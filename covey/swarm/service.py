"""The swarm coordinator mode: stage assignment, liveness, averaging rounds, rebalancing,
payouts and disputes, over the coordinator's components.

Transport-free (covey/swarm/app.py turns HTTP into calls here and `Rejected` into 4xx).
It is built on the coordinator's host (covey.coordinator.host), not a copy of it:
Membership (signed joins and requests, nonces, bans, the peers table), Accounts (the
hash-chained ledger and its Book: stakes, rewards, slashes), Halt (the owner's HALT), the
Database and the blob store; stage states travel on the blob plane (covey.blobs)
between servers by content id. What it adds is SWARM's: which server serves which
stage, per-stage averaging rounds (covey.swarm.averaging), the rebalancer
(covey.swarm.rebalance), pay per verified microbatch and the referee for duplicated
microbatches (covey.swarm.referee). Its read side (status, the server list, metrics) is
covey.swarm.views.
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
import time
from pathlib import Path
from typing import Any

from covey.blobs import BlobError
from covey.coordinator.db import Database
from covey.coordinator.host import Host, RunTerms
from covey.coordinator.rejected import Rejected
from covey.coordinator.storage import Storage
from covey.protocol.swarm import SwarmHeartbeat, SwarmJoin, SwarmRoundReport, SwarmStateUpload
from covey.swarm import books, evidence
from covey.swarm.averaging import Averaging
from covey.swarm.config import SwarmConfig
from covey.swarm.costs import RunCosts
from covey.swarm.observed import Observations
from covey.swarm.paydesk import PayDesk
from covey.swarm.rebalance import plan_move, speeds_from_measurements
from covey.swarm.servers import ServerInfo
from covey.trust.halt import owner_of
from covey.trust.identity import Identity

log = logging.getLogger("covey.swarm")


class SwarmCoordinator(PayDesk):
    def __init__(
        self,
        cfg: SwarmConfig,
        data_dir: Path,
        device: str | None = None,
        storage: Storage = Storage(),  # noqa: B008 -- frozen
    ) -> None:
        """`device`: where the referee recomputes (covey.swarm.referee.Referee); `storage`:
        where the host keeps the run beside `data_dir` (covey.coordinator.host)."""
        self.cfg = cfg
        self.run_id = cfg.run_id

        def terms(identity: Identity, _db: Database) -> RunTerms:
            owner = owner_of(cfg.model_dump(mode="json"), identity.public_key)
            return RunTerms(cfg.run_id, owner, cfg.membership_config())

        # the host's parts; gradient sums of averaging rounds and agreed stage states are
        # relayed by content id (a round whose member died after reporting is still applied
        # by the others); the driver writes the owner's HALT and pays nothing after it
        self.host = host = Host(
            data_dir, terms, position=lambda: self.epoch, db_file="swarm.db", storage=storage
        )
        known = host.db.get_meta("run_id")
        self.identity, self.db, self.accounts = host.identity, host.db, host.accounts
        self.blobs, self.membership, self.halt = host.blobs, host.membership, host.halt
        self._stop, self._wake = host.stop, host.wake  # _wake: the driver looks now
        if known is None:
            self._create()
        self.lock = threading.RLock()
        self.servers: dict[str, ServerInfo] = {}
        # trainers' measurements of servers: rebalancing never rests on a server's own word
        self.observed = Observations(fresh_s=max(30.0, 3 * cfg.rebalance_s))
        self.trainers: dict[str, dict[str, Any]] = {}
        self.run_costs = RunCosts()  # trainers' booked costs, summed (covey.swarm.costs)
        self.averaging = Averaging(cfg.stages, cfg.target_samples, cfg.round_timeout_s)
        self.rebalances: list[dict[str, Any]] = []
        self.unpaid: dict[str, int] = {}
        self.disputes: list[dict[str, Any]] = []
        self._last_rebalance = self._last_payout = time.time()
        # agreed states of each stage: a paid reply was computed on one of them
        self.known_states: list[list[str]] = [[] for _ in range(cfg.stages)]
        # checks on a state not agreed yet (a round was applied moments ago): until when
        self._parked: list[tuple[float, str, evidence.Check]] = []
        self._stage_shapes: dict[int, list[tuple[int, ...]] | None] = {}
        self._seeded: dict[int, str] = {}  # stage -> its state id at the run's seed
        self._shapes_lock = threading.Lock()
        self._verdicts: dict[str, dict[str, Any]] = {}  # settled disputes, by request
        # the books' tables (covey.swarm.books), the ids of paid checks among them: each
        # request is paid once; books a data directory kept as one JSON row move in now
        books.prepare(self.db)
        # a restart resumes: rounds, trainers and unpaid work from SQLite; the epoch from
        # the ledger (each (epoch, peer) is paid once); servers re-learned from heartbeats
        self.epoch = self._last_epoch()
        self._saved: dict[str, str] = {}  # the books' sections as stored (books.sections)
        self._grace_until = 0.0
        if (saved := books.read(self.db, cfg.stages)) is not None:
            self._restore(saved)
        self._thread: threading.Thread | None = None
        from covey.swarm.referee import Referee  # torch: imported once the app is built

        self.referee = Referee(cfg, device)

    # -- persistence ---------------------------------------------------------------------------

    def _last_epoch(self) -> int:
        row = self.db.one(
            "SELECT MAX(CAST(json_extract(payload, '$.round') AS INTEGER)) AS e FROM ledger "
            "WHERE type IN ('contribution accepted', 'reward', 'dispute', 'slash')"
        )
        return int(row["e"]) if row is not None and row["e"] is not None else 0

    def _snapshot(self) -> dict[str, Any]:
        return {"averaging": self.averaging.to_dict(), "trainers": self.trainers,
                "unpaid": self.unpaid, "known_states": self.known_states,
                "vouched": self.observed.vouched}  # fmt: skip

    def _save(self, conn: Any = None) -> None:
        """Write the books' sections that changed (under self.lock; covey.swarm.books).
        `conn`: inside an open transaction (a payout's: the ledger entries and the emptied
        queue commit together)."""
        snap = self._snapshot()
        now = books.sections(snap)
        if now == self._saved:
            return
        if conn is not None:
            self._saved = books.write(conn, snap, self._saved, now)
        else:
            with self.db.transaction() as c:
                self._saved = books.write(c, snap, self._saved, now)

    def _restore(self, saved: dict[str, Any]) -> None:
        self.averaging.load(saved["averaging"])
        self.trainers = saved["trainers"]
        self.unpaid = {p: int(n) for p, n in saved["unpaid"].items()}
        self.known_states = saved.get("known_states", self.known_states)
        self.observed.vouched = {p: int(n) for p, n in saved.get("vouched", {}).items()}
        self._saved = books.sections(self._snapshot())
        # servers rejoin on their next heartbeat (404 -> join with their stage): until they
        # had the time to, no member of an open round counts as gone
        self._grace_until = time.time() + self.cfg.dead_after_s
        log.info("resumed: stage steps %s", [b.step for b in self.averaging.stages])

    def _create(self) -> None:
        now = time.time()
        with self.accounts.transaction() as c:
            c.execute("INSERT INTO meta VALUES (?, ?)", ("run_id", self.run_id))
            c.execute("INSERT INTO meta VALUES (?, ?)", ("spec", self.cfg.model_dump_json()))
            self.accounts.append(
                c,
                "run created",
                {
                    "run_id": self.run_id,
                    "name": self.cfg.name,
                    "spec": self.cfg.model_dump(mode="json"),
                    "coordinator_key": self.identity.public_key,
                    "policy": self.cfg.policy().to_dict(),
                },
                now,
            )

    # -- the clock ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="swarm-driver", daemon=True)
        self._thread.start()
        threading.Thread(target=self._seed_states, name="swarm-seeded", daemon=True).start()

    def _seed_states(self) -> None:
        """Each stage's seeded state id, built here from the spec: a stage's state before
        its first round is agreed from the run's seed, not by a vote (sybil keys could
        carry one). Until it is known (or where the stage cannot be built here), nothing
        is agreed before the first round."""
        for k in range(self.cfg.stages):
            if self._stop.is_set():
                return
            self._shapes(k)
            with self._shapes_lock:
                cid = self._seeded.get(k)
            if cid is not None:
                with self.lock:
                    self.averaging.seed(k, cid)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.host.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(min(0.2, self.cfg.heartbeat_s / 2))
            self._wake.clear()
            try:
                self.halt.enforce(time.time())
                if self.halt.halted is not None:
                    return  # halted: no round, rebalance nor payout after the HALT
                self.tick(time.time())
            except Exception:  # the driver must outlive one bad tick; the error is logged
                log.exception("swarm tick failed")

    def tick(self, now: float) -> None:
        """Expire dead servers, drive averaging rounds, rebalance every rebalance_s, pay
        every payout_s."""
        with self.lock:
            for p, s in list(self.servers.items()):
                if now - s.last_seen > self.cfg.dead_after_s:
                    log.warning(
                        "[server %s stage %d] dead: silent %.1f s",
                        s.name,
                        s.stage,
                        now - s.last_seen,
                    )
                    del self.servers[p]
                    self.observed.forget(p)
            busy = {p for p, s in self.servers.items() if s.moving}
            # a server's pending samples count only as far as trainers vouch for them
            live = {
                p: (s.stage, s.step, self.observed.pending(p, s.pending))
                for p, s in self.servers.items()
            }
            if now >= self._grace_until:
                self.averaging.tick(live, busy, now)
                self._save()
            parked, self._parked = self._parked, []
            if now - self._last_rebalance >= self.cfg.rebalance_s:
                self._last_rebalance = now
                self._rebalance(now)
        for until, reporter, check in parked:  # outside the lock: a spot check computes
            outcome = self._settle(reporter, check, now, park_until=until)
            if outcome != "parked":
                log.info("[pay] parked check %s: %s", check.id[:8], outcome)
        if now - self._last_payout >= self.cfg.payout_s:
            self._last_payout = now
            self.pay(now)

    def _measured(self, peer: str, now: float) -> float:
        """Trainers' median measurement of `peer` in samples/s (0.0: not measured yet)."""
        return self.observed.throughput(peer, now) or 0.0

    def _rebalance(self, now: float) -> None:
        free = {
            p: (s.stage, self._measured(p, now))
            for p, s in self.servers.items()
            if not s.moving and not self.averaging.in_round(p)
        }
        stages = range(self.cfg.stages)
        counts = {k: sum(s.stage == k for s in self.servers.values()) for k in stages}
        empty = [k for k in stages if counts[k] == 0]
        if empty:  # a stage without any server stops the pipeline: fill it first
            donors = [p for p, (k, _) in free.items() if counts[k] >= 2]
            if donors:
                name = max(donors, key=lambda p: (free[p][1], p))
                self._move(name, free[name][0], empty[0], 0.0, 0.0, now)
            return
        if len(free) != len(self.servers) or any(tp <= 0 for _, tp in free.values()):
            return  # a server unmeasured or busy: look again next time
        # per microbatch, stages before the last take two requests (forward, backward),
        # the last one (its backward computes the loss); speeds are measured per request
        costs = [2.0] * (self.cfg.stages - 1) + [1.0]
        move = plan_move(costs, speeds_from_measurements(costs, free),
                         hysteresis=self.cfg.hysteresis)  # fmt: skip
        if move is not None:
            self._move(move.server, move.from_stage, move.to_stage, move.min_before,
                       move.min_after, now)  # fmt: skip

    def _move(self, peer: str, src: int, dst: int, before: float, after: float, now: float) -> None:
        s = self.servers[peer]
        s.stage, s.moving, s.step, s.state, s.pending = dst, True, -1, None, 0
        self.observed.forget(peer)  # its speed on the new stage is measured afresh
        entry = {
            "at": now,
            "server": s.name,
            "from": src,
            "to": dst,
            "min_before": round(before, 3),
            "min_after": round(after, 3),
        }
        self.rebalances.append(entry)
        log.info(
            "[rebalance] %s: stage %d -> %d (min stage %.2f -> %.2f samples/s)",
            s.name,
            src,
            dst,
            before,
            after,
        )

    # -- servers -----------------------------------------------------------------------------

    def join(self, req: SwarmJoin, raw: dict[str, Any]) -> dict[str, Any]:
        """A server or trainer joins with its key (Membership: signature over `raw`, the
        body as sent; stake, bans). A server is assigned the stage it asks for, else the
        one with the fewest servers, then the least throughput."""
        self.membership.check_run(req.run_id)
        peer, name, role = req.peer_id, req.name, req.role
        if role == "server" and (req.url is None or req.blob_url is None):
            raise Rejected(400, "a server joins with its url and blob_url")
        wanted = req.stage
        if wanted is not None and not 0 <= wanted < self.cfg.stages:
            raise Rejected(400, f"stage {wanted!r}: stages are 0..{self.cfg.stages - 1}")
        self.membership.register(peer, req.public_key, name, "worker", req.stake, raw)
        if role == "trainer":
            with self.lock:
                # a restarted trainer (same name) resumes after the last microbatch a
                # trainer of that name reported, so it does not train on the same data again
                resume = max((int(t.get("next", 0)) for t in self.trainers.values()
                              if t["name"] == name), default=0)  # fmt: skip
                old = self.trainers.get(peer, {})
                self.trainers[peer] = {
                    "name": name,
                    "samples": old.get("samples", 0),
                    "loss": old.get("loss"),
                    "reroutes": old.get("reroutes", 0),
                    "banned": old.get("banned", {}),
                    "next": resume,
                }
                self._save()
            return {"run_id": self.run_id, "spec": self.cfg.model_dump(mode="json"),
                    "resume": resume}  # fmt: skip
        with self.lock:
            now = time.time()
            load = [
                (
                    sum(s.stage == k for s in self.servers.values()),
                    sum(self._measured(p, now) for p, s in self.servers.items() if s.stage == k),
                    k,
                )
                for k in range(self.cfg.stages)
            ]
            stage = min(load)[2] if wanted is None else wanted
            self.servers[peer] = ServerInfo(
                peer, name, stage, str(req.url), str(req.blob_url), time.time(),
                public_key=req.public_key,
            )  # fmt: skip
        log.info("[server %s] joined: stage %d on %s", name, stage, req.device)
        return {"run_id": self.run_id, "stage": stage, "spec": self.cfg.model_dump(mode="json")}

    def heartbeat(self, req: SwarmHeartbeat, raw: dict[str, Any]) -> dict[str, Any]:
        """A server's measurements in; its stage, round, apply or resync directive out.
        Rejected(404) for a server this coordinator does not know (dead: join again)."""
        peer = req.peer_id
        self.membership.check_run(req.run_id)
        self.membership.authenticate(raw, -1, peer, nonces=self.membership.liveness)
        self.membership.check_not_banned(peer)
        with self.lock:
            s = self.servers.get(peer)
            if s is None:
                raise Rejected(404, f"server {peer[:8]} is not live here: join again")
            s.last_seen = time.time()
            if s.moving and req.stage == s.stage:
                s.moving = False
            if req.stage == s.stage:
                s.step, s.state = req.step, req.state
                s.pending, s.queue = req.pending, req.queue
                s.throughput = req.throughput
                self.run_costs.server(peer, req.uptime_s, req.busy_s)
                if s.state is not None:
                    self.averaging.state(peer, s.stage, s.step, s.state)
                    self.known_state(s.stage, self.averaging.stages[s.stage].agreed)
                    self._save()
            out = self.averaging.directive(peer, s.stage, s.step, s.state)
            out["stage"] = s.stage
            agreed = out["agreed"]
            if agreed is not None and s.state == agreed and not self.blobs.has(agreed):
                out["want_state"] = agreed  # keep a copy: the stage may lose every server
            out["providers"] = [
                x.blob_url
                for x in self.servers.values()
                if x.stage == s.stage and x.peer_id != peer
            ]
            return out

    def round_report(self, req: SwarmRoundReport, raw: dict[str, Any]) -> dict[str, Any]:
        """A round member's gradient sum. Rejected(422) for a sum no member could apply or
        should (covey.swarm.sums: form, shapes, finite, samples), 409 when the round is
        not open to it."""
        from covey.swarm.sums import SumError, check_sum

        peer = req.peer_id
        self.membership.check_run(req.run_id)
        self.membership.authenticate(raw, -1, peer)
        self.membership.check_not_banned(peer)
        stage, samples, cid = req.stage, req.samples, req.cid
        if not 0 <= stage < self.cfg.stages:
            raise Rejected(422, f"stage {stage!r}: stages are 0..{self.cfg.stages - 1}")
        data = self._decode(cid, req.data)
        try:
            norm = check_sum(data, self._shapes(stage), samples)
        except SumError as e:
            with self.lock:  # it missed this round: the others do not wait for it
                self.averaging.drop(peer)
                self._save()
            raise Rejected(422, f"gradient sum {cid[:12]} of {peer[:12]}: {e}") from None
        self._store(cid, data)
        with self.lock:
            url = ""  # the coordinator holds it
            vouched = self.observed.pending(peer, samples)  # claimed samples vote no more
            why = self.averaging.report(
                peer, stage, req.round, cid, samples, url, norm=norm, vouched=vouched
            )
            if why == "ok":
                self.observed.reported_sum(peer, samples)
            self._save()  # before the ok: an accepted report survives a restart
        if why != "ok":
            raise Rejected(409, why)
        return {"ok": True}

    @staticmethod
    def _decode(cid: str, data: Any) -> bytes:
        try:
            return base64.b64decode(str(data), validate=True)
        except (binascii.Error, ValueError) as e:
            raise Rejected(400, f"blob {cid[:12]}: {e}") from None

    def _store(self, cid: str, data: Any) -> None:
        raw = data if isinstance(data, bytes) else self._decode(cid, data)
        try:
            self.blobs.put_verified(cid, raw)
        except (BlobError, ValueError) as e:
            raise Rejected(400, f"blob {cid[:12]}: {e}") from None

    def _shapes(self, stage: int) -> list[tuple[int, ...]] | None:
        """Parameter shapes of `stage`, built once from the run's spec; None when this
        coordinator cannot build it (a Hugging Face model whose files it lacks): sums are
        then checked for form, dtype and finiteness only."""
        with self._shapes_lock:  # one build at a time (HF stages read files)
            if stage not in self._stage_shapes:
                from covey.swarm.wire import build_stage, state_bytes

                try:
                    built = build_stage(self.cfg, stage)
                    self._stage_shapes[stage] = [tuple(p.shape) for p in built.params]
                    # kept here: a server moved to a stage nobody served yet fetches it
                    self._seeded[stage] = self.blobs.put(state_bytes(built))
                except Exception as e:  # the check degrades (logged); the round goes on
                    log.warning("stage %d cannot be built here (%s): sums unchecked in shape",
                                stage, e)  # fmt: skip
                    self._stage_shapes[stage] = None
            return self._stage_shapes[stage]

    def state_upload(self, req: SwarmStateUpload, raw: dict[str, Any]) -> dict[str, Any]:
        """A copy of a stage's agreed state, so a stage that loses every server resumes."""
        peer = req.peer_id
        self.membership.check_run(req.run_id)
        self.membership.authenticate(raw, -1, peer)
        self.membership.check_not_banned(peer)
        cid = req.cid
        with self.lock:
            agreed = {b.agreed for b in self.averaging.stages}
        if cid not in agreed:
            raise Rejected(409, f"state {cid[:12]} is no stage's agreed state")
        self._store(cid, req.data)
        return {"ok": True}
