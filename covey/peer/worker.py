"""`covey worker`: a peer that lends its compute to a run.

The loop is a data-parallel round, as a peer sees it: ask the coordinator for the open round,
make sure the local canonical state is the round's start state (downloading and
hash-checking it if not: this is how a joiner enters mid-run), train the assigned inner
steps on the assigned data, publish the contribution, wait for the round's certificate,
apply the accepted set with the same pure `apply_round` as everyone else, and check the
resulting weights hash against the certificate (re-syncing from the canonical state on a
mismatch). A heartbeat thread keeps the peer alive and renews its participation lease
(covey.peer.lease): when no heartbeat is accepted for the lease's length the worker stops
training until one is. SIGINT/SIGTERM send a deathrattle. When the run owner halts the
run (covey.trust.halt), the next heartbeat or /v1/round says so and the worker exits with
status 3 (EXIT_HALTED), logging the owner's reason.

The peer is its Ed25519 key (covey.trust.identity): its id is the key's hash and every
request it sends is signed. Its contributions carry commitments to its state every k inner
steps (covey.trust.verify), so that validators can re-execute them and a dispute can be
narrowed to one segment. Certificates must carry the coordinator's signature, and each
accepted contribution's signed ledger entry is kept as a receipt (receipts.jsonl).

The local-state chain (covey.algorithms.base): a strategy that carries local state from
round to round (DiLoCo "keep" or with error feedback, Streaming DiLoCo, DeMo) starts every
round with `begin_round(W_r, the end state of this worker's contribution to round r-1,
whether that round's certificate accepted it)`, and fresh when it did not contribute to
round r-1 (a joiner, a restart, a missed or refused round). Each contribution names the
start it chained from and publishes its end state as a blob, so the coordinator checks the
chain by content id at intake and a validator re-executes from the committed state.

Streaming DiLoCo with tau > 0 overlaps communication with compute (covey.peer.overlap,
covey.peer.worker_overlap): round r is published and applied on a background transfer
while round r+1's first tau steps train. The worker is split by concern: this module is
the loop; covey.peer.worker_train trains a round, covey.peer.worker_state keeps the
canonical state, covey.peer.worker_publish publishes contributions.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from covey.algorithms import Contribution, TrainState
from covey.blobs import BlobServer, BlobStore
from covey.blobs.pacing import Pacer, mbps_to_bytes_s
from covey.devices import peer_compute_line
from covey.memory import bound_heap, shapes_only
from covey.peer import group
from covey.peer.client import CoordinatorClient, CoordinatorLost, PeerRejected
from covey.peer.heads import HeadKeeper
from covey.peer.lease import Lease, LeaseLapsed
from covey.peer.overlap import SideCommitter, Transfer
from covey.peer.pending_check import PendingCheck
from covey.peer.runsetup import set_up_run
from covey.peer.worker_overlap import Overlapping
from covey.peer.worker_publish import Publishing
from covey.peer.worker_state import ROUND_WAIT_S, StateKeeping
from covey.peer.worker_train import Training
from covey.peer.worker_types import Finished, LocalStates, Stopped
from covey.protocol import schemas
from covey.trust.committer import Committer
from covey.trust.halt import EXIT_HALTED
from covey.trust.identity import Identity

log = logging.getLogger("covey.worker")
TRANSFER_JOIN_S = 10.0  # a leaving worker waits this long for its background transfer


@dataclass
class WorkerOptions:
    coordinator: str
    identity: Path | None = None  # default ~/.covey/identity
    name: str | None = None  # shown on the status page; default: the id's first 8 digits
    stake: float | None = None  # None: the run's minimum stake (its policy)
    behavior: str = "honest"  # a cheat is played by covey.peer.cheater (tests and demos)
    device: str | None = None  # auto|cpu|cuda|cuda:N|mps; None: the run's [peer] device
    group: str = "ddp"  # under torchrun: ddp or fsdp inside the group (covey/peer/group.py)
    threads: int | None = 1
    serve_blobs: bool = True
    blob_host: str = "127.0.0.1"
    advertise_host: str | None = None  # the address others reach the blob server at
    blob_port: int = 0
    bandwidth_mbps: float | None = None
    slowdown: float = 1.0  # emulate slower hardware: each step takes this many times longer
    store_dir: Path | None = None
    max_rounds: int | None = None  # leave after contributing to this many rounds
    connect_timeout_s: float = 120.0  # patience for the first contact, before the spec is known
    run_id: str | None = None  # refuse a coordinator serving another run (key included)


class Worker(StateKeeping, Training, Publishing, Overlapping):
    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        self._check_behavior(opts.behavior)
        self.identity = Identity.load_or_create(opts.identity)
        self.peer_id = self.identity.peer_id
        self.name = opts.name or self.peer_id[:8]
        self.stop = threading.Event()
        self.client = CoordinatorClient(
            opts.coordinator, lost_s=opts.connect_timeout_s, stop=self.stop, identity=self.identity
        )
        self.excluded: str | None = None
        self.halted: str | None = None  # the owner's reason, once the run is halted
        self.lease = Lease()
        self._trained_since_adopt = False  # the model moved in a round not yet applied
        self._chain: LocalStates | None = None  # the last recorded contribution's states
        self._local: LocalStates | None = None  # this round's
        self.state: TrainState | None = None
        self.state_hash: str | None = None  # self.state.digest(), computed once
        self.rounds_done = 0
        self.store: BlobStore | None = None
        self.server: BlobServer | None = None
        self._served_state: str | None = None
        self._published: list[str] = []
        self._pinned: dict[str, int] = {}  # drawn contributions' evidence (worker_publish)
        self._evidence: set[str] = set()  # its served end states: sent paced (worker_publish)
        self._transfer: Transfer[Finished] | None = None  # the last round's, in flight
        self._pending: tuple[PendingCheck, schemas.Certificate] | None = None  # its hash check
        self._waited: str | None = None  # the round tag a "waiting" saw (covey.peer.worker_state)
        self._train_ended: float | None = None  # when the last round's training ended
        self._waited_s = 0.0  # how long this round's training waited for the last transfer

    def _check_behavior(self, spec: str) -> None:
        """ValueError unless this worker plays `spec`: an honest one only "honest" (the
        cheats of tests and demos are covey.peer.cheater.CheatingWorker's)."""
        if spec != "honest":
            raise ValueError(f"an honest Worker cannot play {spec!r}: see covey.peer.cheater")

    # -- set-up ---------------------------------------------------------------------------

    def _setup(self) -> None:
        # under torchrun this process is rank 0 of a group that is one peer (peer/group.py)
        self.group = group.group_from_env(self.opts.device or "auto")
        device = str(self.group.device) if self.group else self.opts.device
        run = set_up_run(self.client, self.opts.threads, self.opts.run_id, device)
        self.leader: group.Leader | None = None
        if self.group is not None:
            group.share_info(self.group, run.info)  # the followers build the run from it
            replica = group.attach(run.strategy, self.group, self.opts.group)
            self.leader = group.Leader(run.strategy, self.group, replica)
        self.device = run.device  # its name, reported at join (covey.devices.device_name)
        assert run.compute is not None
        log.info("[%s] %s", self.name, peer_compute_line(
            "worker", run.strategy.device, run.precision, run.compute))  # fmt: skip
        if run.device.split(":")[0] != run.compute.verify_class:
            log.warning(
                "[%s] training on %s; this run re-executes contributions on %s in %s",
                self.name, run.device, run.compute.verify_class, run.precision,
            )  # fmt: skip
        self.cfg, self.corpus, self.seq_len = run.cfg, run.corpus, run.seq_len
        self.run_id, self.coordinator_key = run.run_id, run.coordinator_key
        # the template is only checked for names, shapes and dtypes: no model-sized copy
        self.strategy, self.blobs = run.strategy, run.blobs
        self.template = shapes_only(run.template)
        del run  # its template's weights go now, before the step timing trains
        bound_heap()  # freed tensors go back to the kernel (covey.memory)
        limits = self.cfg.limits
        self.step_time_s = self._measure_step_time()
        store_dir = self.opts.store_dir or Path(f".covey-peer/{self.name}")
        self.store_dir = store_dir
        self.store = BlobStore(store_dir / "blobs", limits.max_blob_bytes)
        # the ledger heads the coordinator signs in its receipts and certificates
        self.heads = HeadKeeper(store_dir, self.run_id, self.coordinator_key)
        blob_url = None
        if self.opts.serve_blobs:
            # evidence goes at the run's paced rate, its payloads at once (covey.blobs.pacing)
            pacer = Pacer(mbps_to_bytes_s(self.cfg.trust.evidence_mbps))
            self.server = BlobServer(
                self.store, self.opts.blob_host, self.opts.blob_port,
                pacer=pacer, paced=self._evidence.__contains__,
            )  # fmt: skip
            url = self.server.start()
            host = self.opts.advertise_host
            blob_url = url if host is None else url.replace(self.opts.blob_host, host, 1)
        self.blob_url = blob_url
        self._join()

    def _join(self) -> None:
        stake = self.opts.stake if self.opts.stake is not None else self._run_min_stake()
        body = dict(
            run_id=self.run_id,
            peer_id=self.peer_id,
            public_key=self.identity.public_key,
            name=self.name,
            stake=stake,
            device=self.device[:64],
            step_time_s=self.step_time_s,
            bandwidth_mbps=self.opts.bandwidth_mbps,
            accepts_connections=self.blob_url is not None,
            blob_url=self.blob_url,
        )
        sent = time.monotonic()
        reply = self.client.post("/v1/join", body)
        self.heartbeat_s = reply["heartbeat_s"]
        self.lease.renew(sent, reply["lease_s"])
        log.info(
            "[%s %s] joined run %s: %s, %.3f s/step, blobs %s",
            self.name,
            self.peer_id[:8],
            self.run_id,
            self.device,
            self.step_time_s,
            self.blob_url or "uploaded to the coordinator",
        )

    def _run_min_stake(self) -> float:
        """What the run asks of a worker's key (its signed policy, as GET
        /v1/ledger/balances names it): what a worker started without --stake bonds.
        RuntimeError (a clean exit) when the coordinator does not say."""
        balances = self.client.get("/v1/ledger/balances")
        least = balances.get("min_stake") if isinstance(balances, dict) else None
        least = least.get("worker") if isinstance(least, dict) else None
        if isinstance(least, bool) or not isinstance(least, (int, float)) or not least >= 0:
            raise RuntimeError(
                f"the coordinator names no minimum stake for a worker ({least!r}): "
                f"start the worker with --stake"
            )
        return float(least)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """Train until the run finishes, max_rounds, or a signal. Exit status 0 on a clean
        leave; 1 when the coordinator is lost or refuses this peer; EXIT_HALTED (3) when
        the run owner halted the run."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        beat = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        try:
            self._setup()
            beat.start()
            while not self.stop.is_set():
                try:
                    outcome = self._one_round()
                except LeaseLapsed as e:
                    self._await_lease(str(e))
                    continue
                if outcome == "finished":
                    log.info("[%s] the run is finished", self.name)
                    break
                if outcome == "halted":
                    return self._exit_halted()
                if self.opts.max_rounds and self.rounds_done >= self.opts.max_rounds:
                    break
            # stopped between rounds (a signal, or a heartbeat that learned of a HALT or an
            # exclusion): the same status as when stopped inside one
            return self._exit_halted() if self.halted else (1 if self.excluded else 0)
        except Stopped:
            return self._exit_halted() if self.halted else (1 if self.excluded else 0)
        except (CoordinatorLost, PeerRejected, RuntimeError) as e:
            if isinstance(e, PeerRejected) and e.status == 410:  # refused: the run is halted
                self.halted = self.halted or e.message
            if self.halted:  # whatever was interrupted, the HALT is why
                return self._exit_halted()
            log.error("[%s] %s", self.name, e)
            return 1
        finally:
            self.stop.set()
            if self._transfer is not None and not self._transfer.join(TRANSFER_JOIN_S):
                log.warning("[%s] background transfer still running at exit", self.name)
            if self._pending is not None:  # recorded in applied.jsonl and served, or refuted
                try:
                    self._pending[0].result(TRANSFER_JOIN_S)
                except Exception as e:
                    log.warning("[%s] the last round's hash check at exit: %s", self.name, e)
            if getattr(self, "leader", None) is not None:
                self.leader.stop()  # type: ignore[union-attr]  # the followers return
            self._leave()
            if self.server:
                self.server.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _exit_halted(self) -> int:
        log.warning(
            "[%s] the run was halted by its owner (%s): exiting with status %d",
            self.name,
            self.halted,
            EXIT_HALTED,
        )
        return EXIT_HALTED

    def _await_lease(self, why: str) -> None:
        """Training stopped because the lease lapsed: wait for a heartbeat to renew it, at
        most the run's coordinator_lost_s (then CoordinatorLost)."""
        log.warning("[%s] %s: training stopped until a heartbeat is accepted", self.name, why)
        patience = self.cfg.limits.coordinator_lost_s
        if not self.lease.wait_renewed(patience, self.stop):
            if self.stop.is_set():
                raise Stopped()
            raise CoordinatorLost(f"participation lease not renewed for {patience:.0f} s")
        log.info("[%s] participation lease renewed: training again", self.name)

    def _check_standing(self) -> None:
        """Stopped on a signal, an exclusion or a HALT; LeaseLapsed when the lease ran out."""
        if self.stop.is_set():
            raise Stopped()
        self.lease.check()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("[%s] %s: leaving", self.name, signal.Signals(signum).name)
        self.stop.set()

    def _leave(self) -> None:
        if not hasattr(self, "run_id"):
            return
        try:  # the deathrattle gets one short try: we are exiting either way
            self.client.post_once(
                "/v1/leave",
                {"run_id": self.run_id, "peer_id": self.peer_id, "reason": "shutdown"},
                timeout_s=3.0,
            )
        except Exception as e:
            log.warning("[%s] deathrattle not delivered: %s", self.name, e)

    def _heartbeats(self) -> None:
        body = {"run_id": self.run_id, "peer_id": self.peer_id}
        while not self.stop.wait(self.heartbeat_s):
            try:
                sent = time.monotonic()
                reply = self.client.post_once("/v1/heartbeat", body, timeout_s=self.heartbeat_s)
                self.lease.renew(sent, reply["lease_s"])
            except PeerRejected as e:
                if e.status == 410:  # the run owner halted the run
                    log.warning("[%s] heartbeat: %s", self.name, e.message)
                    self.halted = e.message
                    self.stop.set()
                elif e.status == 404:  # the coordinator forgot us: join again
                    log.warning("[%s] unknown to the coordinator: joining again", self.name)
                    try:
                        self._join()
                    except Exception as e2:
                        log.warning("[%s] re-join failed: %s", self.name, e2)
                elif e.status == 403:  # excluded from the run (proven fraud): nothing to do
                    log.error("[%s] excluded from the run: %s", self.name, e.message)
                    self.excluded = e.message
                    self.stop.set()
                else:
                    log.warning("[%s] heartbeat refused: %s", self.name, e)
            except Exception as e:  # the coordinator may be restarting: keep beating
                log.debug("[%s] heartbeat failed: %s", self.name, e)

    def _one_round(self) -> str:
        if self._transfer is not None:  # the last round's transfer runs: train ahead
            return self._overlapped_round()
        # after a "waiting", a long-poll: held until the round view changes
        info = self._round_view(self._waited, ROUND_WAIT_S)
        self._waited = None
        if info.phase == "finished":
            return "finished"
        if info.phase == "halted":
            self.halted = info.halted or "halted"
            return "halted"
        if info.phase != "open" or not info.member or info.assignment is None:
            if info.tag:
                self._waited = info.tag  # the next look waits for a change
            else:  # a coordinator without the round long-poll: poll
                self._pause(min(1.0, self.heartbeat_s / 2))
            return "waiting"
        assert info.start_hash and info.start_cid and info.start_size
        deadline = time.monotonic() + (info.deadline_in_s or 0.0)
        opened = time.monotonic()
        self._sync_state(info.start_cid, info.start_hash, info.start_size, info.providers)
        assert self.state is not None
        self._begin_round(info.round)
        committer: Committer | SideCommitter
        digest = self._start_digest(info.start_hash)
        if self.leader is not None and self.leader.replica is not None:
            # fsdp: each commitment is sketched shard by shard, by the whole group at once
            every = self.cfg.trust.commit_every
            committer = group.GroupCommitter(self.leader, self.state, every, start_digest=digest)
        else:  # sketched on a side thread: training does not wait for its own commitments
            committer = SideCommitter(
                self.strategy, self.state, self.cfg.trust.commit_every, start_digest=digest
            )
        return self._train_and_finish(info, deadline, opened, committer)

    def _train_and_finish(
        self,
        info: schemas.RoundInfo,
        deadline: float,
        started: float,
        committer: Committer | SideCommitter,
        ahead: tuple[int, float, float] = (0, 0.0, 0.0),
    ) -> str:
        """Train the rest of the round (`ahead`: steps, compute seconds and loss sum already
        done), then publish and apply it: on a background transfer while the next round's
        first tau steps train (Streaming DiLoCo), else here."""
        contribution, loss, compute_s, commitments = self._train(info, deadline, committer, ahead)
        self._end_round()
        ended = time.monotonic()
        self._note_round(info.round, compute_s, ended - started, ahead[0])
        self._train_ended = ended
        # the contribution in a list `_finish` empties: no frame keeps a model-sized
        # payload alive once it is published (while the round is applied)
        args = (info, [contribution], loss, compute_s, ended - started, commitments)
        del contribution
        if self._overlaps():
            self._transfer = Transfer(f"round-{info.round}", lambda: self._finish(*args, True))
            self._transfer.start()
            return "trained"
        return self._settle(self._finish(*args, False), adopt=True)

    def _finish(
        self,
        info: schemas.RoundInfo,
        held: list[Contribution],
        loss: float,
        compute_s: float,
        wall_s: float,
        commitments: list[dict[str, Any]],
        ahead: bool,
    ) -> Finished:
        """Publish, await the certificate, compute the certified weights (and with `ahead`,
        learn the next round). Touches no live training state: it may run on a transfer
        thread while the strategy trains. `held`: the contribution, taken out of it."""
        c = held.pop()
        local = self._local
        if self._settle_check():  # trained from weights the last certificate refutes
            log.warning("[%s - round %d] its work is discarded", self.name, info.round)
            return Finished(info, local, False)  # not published: the round starts over
        self._seal(local)
        submitted = self._publish(info, c, loss, compute_s, wall_s, commitments)
        del c  # its payload is on disk now: a big model's is a model's size
        cert = self._await_certificate(info)
        if cert is None:
            return Finished(info, local, submitted)  # the chain stays: a retry starts there
        # training ahead reads the start state meanwhile: only a plain round consumes it
        # a plain round's hash check runs while the next round trains (peer/pending_check.py)
        defer = not ahead and self._defers_check()
        state, digest, resynced = self._round_result(cert, consume=not ahead, defer=defer)
        if submitted and any(a.peer_id == self.peer_id for a in cert.accepted):
            self._keep_receipt(cert.round)
        nxt = self._next_round_info(cert.round) if ahead else None
        return Finished(info, local, submitted, cert, state, digest, resynced, nxt)

    def _settle(self, f: Finished, adopt: bool) -> str:
        """Take a finished round's outcome into the worker (the training thread only).
        `adopt`: move the strategy to the new weights now (else the caller merges them
        late, or the next round reloads them)."""
        cert = f.certificate
        if cert is None:
            self._trained_since_adopt = True  # the retried round reloads its start
            return "aborted"
        assert f.state is not None
        self.state, self.state_hash = f.state, f.state_hash
        if adopt:
            if f.resynced:
                self.strategy.load_state(f.state)
            else:
                self.strategy.adopt(f.state)
        self._trained_since_adopt = not adopt
        if f.local is not None:  # only a recorded contribution continues the chain
            f.local.accepted = any(a.peer_id == self.peer_id for a in cert.accepted)
            self._chain = f.local if f.submitted else None
        if f.submitted:
            self.rounds_done += 1
        return "done"

    def _pause(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Stopped()
