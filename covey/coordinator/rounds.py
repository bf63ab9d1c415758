"""The rounds mode: data-parallel rounds over the coordinator's components.

One driver thread ticks the round state machine (covey.protocol.rounds decides; this
module records) and computes each round's canonical state with the same pure
`apply_round` every peer runs; contributions come in through intake
(covey.coordinator.intake), the read side is covey.coordinator.views, held-out
evaluation is covey.coordinator.evaluator, and the aggregation the spec asks for, gather
or sharded (covey.coordinator.aggregation), takes each closed round: those are this
mode's parts. The owner's HALT is the host's part (covey.coordinator.halt): the driver
writes it first in each tick, and this mode's effect of it is `abort_if_open`. It uses the
components it is given (membership, verification, accounts, the blob store), never their
attributes. Everything durable goes through SQLite (covey.coordinator.db) and the
content-addressed blob store; a restarted coordinator resumes from them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from covey.algorithms import Contribution, RoundError, TrainState
from covey.blobs import BlobClient, BlobStore
from covey.config import RunConfig, steps_per_round
from covey.data.corpus import Corpus
from covey.protocol.checkpoint import FileTensors, state_from_file, state_to_file
from covey.protocol.rounds import PeerView, close_reason, is_alive, is_eligible, plan_round
from covey.trust.identity import Identity
from covey.trust.incentives import Policy

from .accounts import Accounts
from .aggregation import Aggregation, choose_aggregation
from .certificates import make_certificate
from .db import Database
from .evaluator import Evaluator
from .halt import Halt
from .intake import Intake
from .liveness import Liveness
from .membership import Membership
from .model import RunModel, payload_estimate
from .retention import prune_blobs, write_checkpoint
from .uploads import Blobs
from .verification import Verification
from .views import OpenRound, Views

log = logging.getLogger("covey.coordinator")


class Rounds(Intake, Views):
    """Open, close and commit rounds; take contributions; sign certificates; evaluate."""

    def __init__(
        self,
        cfg: RunConfig,
        data_dir: Path,
        *,
        identity: Identity,
        db: Database,
        accounts: Accounts,
        membership: Membership,
        verification: Verification,
        blobs: BlobStore,
        fetcher: BlobClient,
        uploads: Blobs,
        corpus: Corpus,
        run_id: str,
        model: RunModel,
        wake: threading.Event,
        stop: threading.Event,
        halt: Halt,
    ) -> None:
        """Resume the run from `db` and `blobs`, or record its creation (ValueError never:
        the facade checked the run id). `wake` is set to look at the round now; `stop`
        ends the driver and the evaluator."""
        self.cfg = cfg
        self.data_dir = data_dir
        self.identity = identity
        self.db = db
        self.accounts = accounts
        self.membership = membership
        self.peers = membership.peers
        self.verification = verification
        self.blobs = blobs
        self.fetcher = fetcher
        self.uploads = uploads  # the blob plane component: uploads, peers' own servers
        self.corpus = corpus
        self.corpus_fingerprint = corpus.fingerprint
        self.run_id = run_id
        self.strategy = model.strategy
        self.template = model.template
        self.loss_fn = model.loss_fn
        self.seq_len = model.seq_len
        self.parameters = model.parameters
        self.model_name, self.model_source = model.name, model.source
        self.model_files_cid = model.model_files_cid
        self.verifying = verification.verifying
        self._wake = wake
        self._stop = stop
        self.steps_per_round = steps_per_round(cfg.algorithm)
        self._payload_bytes = payload_estimate(self.strategy, self.template)
        self._nonces_pruned = 0.0
        self._driver: threading.Thread | None = None
        self.evaluator = Evaluator(cfg, db, model, corpus)  # beside the rounds
        self.halt = halt
        self.aggregation: Aggregation = choose_aggregation(  # gather, or sharded: the spec's
            cfg, run_id=run_id, identity=identity, db=db, accounts=accounts, blobs=blobs,
            model=model, rounds=self, commit=self._close,
        )  # fmt: skip
        self.state, self.state_cid = self._load_or_create()
        self.state_hash = self.state.digest()  # hashed once per state, not per request

    # -- the host's parts, as this mode's parts (intake, views) read them --------------------

    @property
    def halted(self) -> dict[str, Any] | None:
        """The ledger's HALT ({index, round, reason}), or None while the run goes on."""
        return self.halt.halted

    @property
    def samples(self) -> dict[str, Any] | None:
        return self.evaluator.samples

    def abort_if_open(self) -> None:
        """This mode's effect of the owner's HALT (covey.coordinator.halt): whatever round
        is open is aborted (also one left open by a crash), and none opens again."""
        if (current := self.open_round()) is not None:
            self._abort(current, "the run was halted by its owner")

    @property
    def liveness(self) -> Liveness:
        return self.membership.liveness

    def authenticate(
        self,
        raw: dict[str, Any],
        round: int,
        peer_id: str,
        public_key: str | None = None,
        nonces: Any = None,
    ) -> None:
        self.membership.authenticate(raw, round, peer_id, public_key, nonces)

    def _check_run(self, run_id: str) -> None:
        self.membership.check_run(run_id)

    def _check_not_banned(self, peer_id: str) -> None:
        self.membership.check_not_banned(peer_id)

    def _peer_views(self) -> list[PeerView]:
        return self.membership.peer_views()

    # -- start-up and resume ----------------------------------------------------------------

    def _load_or_create(self) -> tuple[TrainState, str]:
        now = time.time()
        last = self.db.one(
            "SELECT new_cid FROM rounds WHERE status = 'committed' ORDER BY round DESC LIMIT 1"
        )
        if last is None and self.db.get_meta("run_id") is None:
            initial = self.strategy.init_state()  # the seeded (or warm-started) weights
            cid, _ = self._store_state(initial)
            with self.accounts.transaction() as c:
                for key, value in (
                    ("run_id", self.run_id),
                    ("spec", self.cfg.model_dump_json()),
                    ("created_at", repr(now)),
                    ("corpus_fingerprint", self.corpus.fingerprint),
                    ("initial_cid", cid),
                ):
                    c.execute("INSERT INTO meta VALUES (?, ?)", (key, value))
                self.db.event(c, now, "run created", "", {"run_id": self.run_id})
                self.accounts.append(
                    c,
                    "run created",
                    {
                        "run_id": self.run_id,
                        "name": self.cfg.name,
                        "spec": self.cfg.model_dump(mode="json"),
                        "coordinator_key": self.identity.public_key,
                        "policy": Policy.from_config(
                            self.cfg.trust,
                            self.cfg.rounds.deadline_max_s,
                            held_stake=True,
                            evidence_bytes=self.evidence_size,
                            min_stake=self.cfg.min_stake(self.seq_len),
                        ).to_dict(),
                        # spec + data fingerprint hash to run_id: an auditor checks the
                        # spec here is the one peers were served (covey.io.audit)
                        "corpus_fingerprint": self.corpus.fingerprint,
                    },
                    now,
                )
            log.info("run %s created in %s", self.run_id, self.data_dir)
            return initial, cid
        cid = last["new_cid"] if last else self.db.get_meta("initial_cid")
        assert cid is not None
        state = self._read_state(cid)
        with self.accounts.transaction() as c:
            # a close interrupted by a crash never committed: the round is open again, and
            # every peer gets a fresh deadline to reconnect and finish it
            c.execute(
                "UPDATE rounds SET status = 'open', deadline = MAX(deadline, ?) "
                "WHERE status IN ('open', 'closing')",
                (now + self.cfg.rounds.deadline_min_s + self.cfg.rounds.dead_after_s,),
            )
            self.peers.touch_live(c, now)
            self.db.event(c, now, "coordinator restarted", "", {"round": state.round})
        log.info("resumed run %s at round %d (state %s)", self.run_id, state.round, cid[:12])
        return state, cid

    def start(self) -> None:
        """Start the round driver and the evaluator threads."""
        self._driver = threading.Thread(target=self._drive, name="round-driver", daemon=True)
        self._driver.start()
        self.evaluator.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the driver and the evaluator, waiting up to `timeout_s` for each."""
        self._stop.set()
        self.evaluator.stop(timeout_s)
        if self._driver is not None:
            self._driver.join(timeout_s)
        self.aggregation.close()

    def _drive(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            try:
                self.tick(time.time())
            except Exception:  # one bad tick must not kill the run: log loudly and go on
                log.exception("round driver tick failed")

    # -- rounds -------------------------------------------------------------------------------

    def committed_rounds(self) -> int:
        return self.state.round

    def tick(self, now: float) -> None:
        """One step of the round state machine: expire silent peers, open a round when
        enough peers are live, close the open one when it is complete or overdue."""
        self.halt.enforce(now)  # a HALT takes effect here, between rounds' steps
        cfg = self.cfg.rounds
        peers = self._peer_views()
        with self.db.transaction() as c:
            for p in peers:
                if p.state == "live" and not is_alive(now, p, cfg):
                    self.peers.set_dead(c, p.peer_id)
                    self.db.event(c, now, "dead", p.peer_id, {"silent_s": now - p.last_seen})
                    log.warning("[%s] silent for %.1f s: dead", p.peer_id, now - p.last_seen)
        if now - self._nonces_pruned > 60:
            self.membership.prune_nonces(now)
            self._nonces_pruned = now
        if self.aggregation.waiting:
            self.aggregation.advance(now)  # a closed round waits on its aggregators
            return
        views = self._peer_views()
        alive = {p.peer_id for p in views if is_alive(now, p, cfg)}
        current = self.open_round()
        if current is None:
            eligible = [p for p in views if is_eligible(now, p, cfg)]  # no-shows sit out
            if not self.finished() and len(eligible) >= cfg.min_peers:
                self._open(now)
            return
        waiting_on = [m for m in current.members if m in alive]
        submitted = [
            r["peer_id"]
            for r in self.db.query(
                "SELECT peer_id FROM contributions WHERE round = ? AND attempt = ?",
                (current.round, current.attempt),
            )
        ]
        # a drawn contribution's evidence is never waited for: it is checked after the close
        reason = close_reason(now, current.deadline, waiting_on, submitted)
        if reason is not None:
            self.membership.record_no_shows(current.round, waiting_on, submitted, now)
            self._close(current, reason, now=now)

    def _open(self, now: float) -> None:
        r = self.state.round
        prev = self.db.one("SELECT attempt FROM rounds WHERE round = ?", (r,))
        attempt = 0 if prev is None else prev["attempt"] + 1
        assignments, deadline = plan_round(
            now,
            self.run_id,
            r,
            self._peer_views(),
            steps_per_round=self.steps_per_round,
            flexible=self.strategy.flexible_steps,
            payload_bytes=self._payload_bytes,
            cfg=self.cfg.rounds,
        )
        members = [a.peer_id for a in assignments]
        table = {
            a.peer_id: {"inner_steps": a.inner_steps, "data_key": a.data_key} for a in assignments
        }
        with self.db.transaction() as c:
            c.execute("DELETE FROM rounds WHERE round = ?", (r,))
            c.execute(
                "INSERT INTO rounds (round, attempt, status, opened_at, deadline, members, "
                "assignments, start_cid, start_hash) "
                "VALUES (?, ?, 'open', ?, ?, ?, ?, ?, ?)",
                (
                    r,
                    attempt,
                    now,
                    deadline,
                    json.dumps(members),
                    json.dumps(table),
                    self.state_cid,
                    self.state_hash,
                ),
            )
        self.commits.notify()  # wakes the round long-polls: members start at once
        log.info(
            "[round %d.%d] open: %d members, deadline in %.1f s",
            r,
            attempt,
            len(members),
            deadline - now,
        )

    def _close(
        self,
        rnd: OpenRound,
        reason: str,
        assembled: tuple[list[Any], TrainState] | None = None,
        now: float | None = None,
    ) -> None:
        """Commit `rnd` (or abort it); `now`: the driver's clock; `assembled`: its rows and
        the new state that sharded aggregation computed (covey.coordinator.shard_rounds),
        instead of apply_round (how the aggregation component commits a round it took)."""
        with self.accounts.transaction() as c:
            c.execute("UPDATE rounds SET status = 'closing' WHERE round = ?", (rnd.round,))
            rows = c.execute(
                "SELECT * FROM contributions WHERE round = ? AND attempt = ? ORDER BY peer_id",
                (rnd.round, rnd.attempt),
            ).fetchall()
        banned = {p for p, a in self.accounts.book.accounts.items() if a.banned}
        rows = [r for r in rows if r["peer_id"] not in banned]  # excluded since it submitted
        if assembled is not None:
            rows = assembled[0]
        elif rows and self.aggregation.begin(rnd, rows, reason):
            return  # sharded above the crossover: aggregators compute it, tick() commits it
        contributions = [
            # mapped from disk (BlobStore.view): N contributions are not N copies in memory
            Contribution(self.blobs.view(r["cid"]), r["tokens"], r["inner_steps"], r["fragment"])
            for r in rows
        ]
        if not contributions:
            self._abort(rnd, f"no contributions ({reason})")
            return
        try:
            new_state, new_cid, new_size, new_hash = self._next_state(contributions, assembled)
        except (RoundError, ValueError) as e:  # validated at submit: a bug; never commit it
            log.error("[round %d] apply_round failed: %s", rnd.round, e)
            self._abort(rnd, f"apply_round failed: {e}")
            return
        now = time.time()
        certificate = make_certificate(
            self.db,
            self.identity,
            self.run_id,
            self.state_hash,
            rnd,
            rows,
            new_hash,
            new_cid,
            new_size,
            now,
            reason,
            ledger_head=self.accounts.head(),
        )
        prev = self.db.one("SELECT closed_at FROM rounds WHERE round = ?", (rnd.round - 1,))
        cycle = now - (prev["closed_at"] if prev else rnd.opened_at)
        util = sum(r["compute_s"] for r in rows) / len(rows) / cycle if cycle > 0 else None
        losses = [r["train_loss"] for r in rows if r["train_loss"] is not None]
        checkpoint = (new_state.round % self.cfg.rounds.checkpoint_every) == 0
        with self.accounts.transaction() as c:
            c.execute(
                "UPDATE rounds SET status = 'committed', certificate = ?, new_cid = ?, "
                "new_hash = ?, closed_at = ?, train_loss = ?, bytes = ?, tokens = ?, "
                "utilization = ? WHERE round = ?",
                (
                    certificate.model_dump_json(),
                    new_cid,
                    new_hash,
                    now,
                    sum(losses) / len(losses) if losses else None,
                    sum(r["size"] for r in rows),
                    sum(r["tokens"] for r in rows),
                    min(util, 1.0) if util is not None else None,
                    rnd.round,
                ),
            )
            self.peers.count_contributions(c, [r["peer_id"] for r in rows])
            if checkpoint:
                c.execute(
                    "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                    (new_state.round, new_cid, new_size, new_hash, now),
                )
            self.verification.record_round(c, rnd.round, rows, certificate, now)
            if checkpoint:
                self.accounts.append(
                    c,
                    "checkpoint",
                    {"round": new_state.round, "cid": new_cid, "weights_hash": new_hash},
                    now,
                )
        self.state, self.state_cid, self.state_hash = new_state, new_cid, new_hash
        self._outer_on_disk(new_state, new_cid)
        self.commits.notify()  # wakes the certificate long-polls now
        log.info(
            "[round %d] committed: %d accepted, %d rejected, %s; weights %s",
            rnd.round,
            len(certificate.accepted),
            len(certificate.rejected),
            reason,
            new_hash[:12],
        )
        if checkpoint:
            write_checkpoint(self.data_dir, self.blobs, new_state.round, new_cid, self.cfg)
        if new_state.round % self.cfg.rounds.eval_every == 0 or self.finished():
            # its own dict of the weights: the next close empties the state's (consuming)
            self.evaluator.submit(TrainState(dict(new_state.params), {}, new_state.round))
        keep = {self.state_cid, self.model_files_cid} | self.verification.verification_blobs()
        prune_blobs(self.db, self.blobs, new_state.round, keep)

    def _next_state(
        self, contributions: list[Contribution], assembled: tuple[list[Any], TrainState] | None
    ) -> tuple[TrainState, str, int, str]:
        """The round's new state (`assembled`'s, or the update of the current one by
        `contributions`), stored and hashed: (state, cid, size, weights hash). RoundError
        or ValueError from the update, OSError from the store; nothing is committed then.

        The update consumes the current state's tensors (`Strategy.apply_round_consuming`:
        each old tensor is let go as its replacement is made, so the old and the new state
        are not both in memory). Meanwhile, and if anything fails, the current
        state is its blob: the same bytes, read from disk when asked for."""
        if assembled is not None:
            new_state = assembled[1]
        else:
            start, path = self.state, self.blobs.path(self.state_cid)
            self.state = TrainState(
                FileTensors(path, "params/"),  # type: ignore[arg-type]
                FileTensors(path, "outer/"),  # type: ignore[arg-type]
                start.round,
            )
            new_state = self.strategy.apply_round_consuming(start, contributions)
            del start
        new_cid, new_size = self._store_state(new_state)
        return new_state, new_cid, new_size, new_state.digest()

    def _read_state(self, cid: str) -> TrainState:
        """Canonical state `cid` from the blob store (CheckpointError for bytes that are not
        one), its outer tensors left on disk (`_outer_on_disk`)."""
        state = state_from_file(self.blobs.path(cid), self.template)
        self._outer_on_disk(state, cid)
        return state

    def _outer_on_disk(self, state: TrainState, cid: str) -> None:
        """While `state` is current its outer tensors (the outer momentum: a model size)
        are read from its blob when the next update needs them, not held in memory
        (as a worker does, covey.peer.worker_state). The same bytes: the
        blob's content id is the state's. The blob is kept while it is the current state
        (covey.coordinator.retention), and the open file stays readable if it is deleted."""
        if state.outer:
            state.outer = FileTensors(self.blobs.path(cid), "outer/")  # type: ignore[assignment]

    def _abort(self, rnd: OpenRound, why: str) -> None:
        """Nothing to commit: the round reopens (next attempt) with fresh membership."""
        now = time.time()
        with self.db.transaction() as c:
            c.execute("UPDATE rounds SET status = 'aborted' WHERE round = ?", (rnd.round,))
            # members and span: the time lost to it (covey.coordinator.costs, churn)
            span, members = round(now - rnd.opened_at, 3), len(rnd.members)
            detail = {"round": rnd.round, "why": why, "members": members, "span_s": span}
            self.db.event(c, now, "round aborted", "", detail)
        self.commits.notify()  # the round view changed: wake the round long-polls
        log.warning("[round %d.%d] aborted: %s", rnd.round, rnd.attempt, why)

    def _store_state(self, state: TrainState) -> tuple[str, int]:
        """Put a canonical state in the blob store, streamed to disk tensor by tensor and
        hashed on the way (covey.protocol.checkpoint.write_state): (cid, size). The
        coordinator's own states are not bounded by limits.max_blob_bytes."""
        tmp = self.blobs.scratch()
        try:
            written, _ = state_to_file(state, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self.blobs.adopt(tmp, written)
