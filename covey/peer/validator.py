"""`covey validator`: re-executes sampled contributions and disputes the ones that lie.

The loop: claim a task from the coordinator (a contribution its sampling draw picked), fetch
the round's start state and the contribution, re-execute the assignment from the start
state with the same data and the same commitment schedule (covey.trust.verify), and
compare within the run's tolerance. An agreement is reported as such. A disagreement names
the first diverging segment of the worker's commitments and backs it with this validator's
own state at the segment's start and its claim at the segment's end (uploaded as blobs),
so the referee can recompute that one segment alone. Validators are paid for proven
catches; a false accusation is recorded against them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from covey.algorithms import TrainState
from covey.blobs import BlobError, BlobStore
from covey.data.batches import assignment_batches
from covey.devices import peer_compute_line, verification_mismatch
from covey.memory import bound_heap, shapes_only
from covey.peer.client import CoordinatorClient, CoordinatorLost, PeerRejected
from covey.peer.heads import HeadKeeper
from covey.peer.runsetup import fetch_state, set_up_run
from covey.protocol import schemas
from covey.protocol.checkpoint import CheckpointError
from covey.protocol.content import content_id
from covey.trust import verify
from covey.trust.evidence import evidence_commitment
from covey.trust.halt import EXIT_HALTED
from covey.trust.identity import Identity
from covey.trust.policy import evidence_deadline_s

log = logging.getLogger("covey.validator")


@dataclass
class ValidatorOptions:
    coordinator: str
    identity: Path | None = None  # default ~/.covey/identity (use another key than a worker's)
    name: str | None = None
    device: str | None = None  # None: the run's [peer] verify_device
    threads: int | None = 1
    poll_s: float = 1.0  # wait between claims when there is nothing to check
    max_tasks: int | None = None  # stop after this many re-executions
    connect_timeout_s: float = 120.0
    run_id: str | None = None  # refuse a coordinator serving another run (key included)
    stake: float = 0.0  # credits staked at the first join (the run's min_validator_stake)
    aggregate: bool = False  # also aggregate drawn shards (covey.peer.aggregating)
    blob_host: str = "127.0.0.1"  # where --aggregate serves its shards
    blob_port: int = 0
    advertise_host: str | None = None  # the address others reach them at (default: bound)
    store_dir: Path | None = None  # where it keeps the ledger heads it is given


class Validator:
    def __init__(self, opts: ValidatorOptions) -> None:
        self.opts = opts
        self.identity = Identity.load_or_create(opts.identity)
        self.validator_id = self.identity.peer_id
        self.name = opts.name or f"validator-{self.validator_id[:8]}"
        self.stop = threading.Event()
        self._reexecuting: int | None = None  # the task id while re-executing it
        self.client = CoordinatorClient(
            opts.coordinator, lost_s=opts.connect_timeout_s, stop=self.stop, identity=self.identity
        )
        self.done = 0
        self.compute_s = 0.0
        self._state: tuple[str, TrainState] | None = None
        self.aggregating: Any = None  # covey.peer.aggregating.AggregatorLoop

    def _setup(self) -> None:
        run = set_up_run(
            self.client, self.opts.threads, self.opts.run_id, self.opts.device, validating=True
        )
        # re-execution on another device class or precision than the run's would
        # differ by more than rounding; refuse the checks (no verdict), never convict for it
        assert run.compute is not None
        log.info("[%s] %s", self.name, peer_compute_line(
            "validator", run.strategy.device, run.precision, run.compute))  # fmt: skip
        refusal = verification_mismatch(
            run.compute.verify_class, run.precision, run.strategy.device, run.precision
        )
        if refusal is not None:
            raise RuntimeError(f"refusing to validate: {refusal}")
        self.cfg, self.corpus, self.seq_len = run.cfg, run.corpus, run.seq_len
        self.run_id, self.strategy = run.run_id, run.strategy
        self.template = shapes_only(run.template)  # checked for shapes only: no weights
        bound_heap()  # freed tensors go back to the kernel (covey.memory)
        self.blobs = run.blobs
        store_dir = self.opts.store_dir or Path(f".covey-peer/{self.name}")
        self.heads = HeadKeeper(store_dir, self.run_id, run.coordinator_key)
        reply = self.client.post(
            "/v1/validators/join",
            {
                "run_id": self.run_id,
                "validator_id": self.validator_id,
                "public_key": self.identity.public_key,
                "name": self.name,
                "stake": self.opts.stake,
            },
        )
        if not reply.get("verifying"):
            log.warning("[%s] this run's contributions cannot be re-executed", self.name)
        log.info("[%s %s] validating run %s", self.name, self.validator_id[:8], self.run_id)

    def run(self) -> int:
        """Claim and check tasks until a signal or max_tasks. 0 on a clean stop, 1 when the
        coordinator is lost or refuses this validator, EXIT_HALTED (3) once the run is halted."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._setup()
            if self.opts.aggregate:
                self._start_aggregating()
            while not self.stop.is_set():
                if self.opts.max_tasks and self.done >= self.opts.max_tasks:
                    break
                reply = self.client.post(
                    "/v1/verify/claim", {"run_id": self.run_id, "validator_id": self.validator_id}
                )
                if reply.get("task") is None:
                    self.stop.wait(self.opts.poll_s)
                    continue
                self.check(schemas.VerifyTask.model_validate(reply["task"]))
            return 0
        except Stopping as e:
            log.info("[%s] %s", self.name, e)
            return 0
        except (CoordinatorLost, PeerRejected, RuntimeError) as e:
            if isinstance(e, PeerRejected) and e.status == 410:
                log.warning(
                    "[%s] the run was halted by its owner (%s): exiting with status %d",
                    self.name,
                    e.message,
                    EXIT_HALTED,
                )
                return EXIT_HALTED
            if self.stop.is_set() and isinstance(e, CoordinatorLost):
                return 0
            log.error("[%s] %s", self.name, e)
            return 1
        finally:
            self.stop.set()
            if self.aggregating is not None:
                self.aggregating.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _start_aggregating(self) -> None:
        """--aggregate: serve as an aggregator of this run's sharded rounds, beside the
        checks (a run that does not shard is logged and left alone)."""
        from covey.peer.aggregating import AggregatorLoop, unsupported

        why = unsupported(self.cfg)
        if why is not None:
            log.warning("[%s] --aggregate: nothing to aggregate: %s", self.name, why)
            return
        self.aggregating = AggregatorLoop(
            self.opts.coordinator, self.identity, self.run_id, self.cfg, self.strategy,
            self.template, self.stop, host=self.opts.blob_host, port=self.opts.blob_port,
            advertise_host=self.opts.advertise_host,
        )  # fmt: skip

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("[%s] %s: stopping", self.name, signal.Signals(signum).name)
        self.stop.set()
        if self._reexecuting is not None:  # minutes of CPU at 124M: not finished first
            task, self._reexecuting = self._reexecuting, None
            raise Stopping(
                f"stopped in the re-execution of task {task}: the coordinator gives it to "
                f"another validator once its deadline passes"
            )

    def check(self, task: schemas.VerifyTask) -> None:
        """Re-execute one task and report the outcome (uploading the evidence of a
        disagreement first). The round's start and the payload come from the coordinator
        (the start once per round, kept by its content id for every check of that round);
        the worker's private state from the worker's own providers (`task.providers`):
        the end state of its previous round, where this one starts. Its end state of this
        round is recomputed, and travels only when the recomputation's content id is not
        the one the worker named (`_claimed_end`). Evidence is asked for until
        `evidence_deadline_s`: not delivered by then, this validator reports it withheld
        (a signed attestation, covey.trust.withholding)."""
        sources = [self.opts.coordinator]
        # the payload waits on disk until the comparison: the re-execution does not hold
        # it (a model size for an fp32 payload)
        with tempfile.TemporaryDirectory(prefix="covey-validator-") as scratch:
            store = BlobStore(Path(scratch))
            try:
                start = self._start_state(task, sources)
                payload = self.blobs.fetch_into(store, task.cid, sources, size=task.size)
                local = self._local_states(task, task.providers or sources, store)
            except Undelivered as e:
                self._report_withheld(task, str(e))
                return
            except (BlobError, CheckpointError, RuntimeError) as e:
                log.warning(
                    "[%s] task %d: inputs unavailable (%s); leaving it", self.name, task.task_id, e
                )
                return
            # the states a referee can load (the worker's commitment hashed them) are kept,
            # on disk (1.5 GB each at 124M); the previous end state is freed once loaded
            with tempfile.TemporaryDirectory(prefix="covey-validator-states-") as spill:
                try:
                    self._check(task, start, payload, local, Path(spill), sources)
                except Undelivered as e:
                    self._report_withheld(task, str(e))

    def _report_withheld(self, task: schemas.VerifyTask, why: str) -> None:
        """Attest, signed, that the worker's providers did not deliver its evidence."""
        body: dict[str, Any] = {
            "run_id": self.run_id,
            "round": task.round,
            "validator_id": self.validator_id,
            "task_id": task.task_id,
            "outcome": "withheld",
            "worker_id": task.peer_id,
            "detail": why[:500],
        }
        reply = self.client.post("/v1/verify/report", body, round=task.round)
        self._keep_head(f"the head after its report on round {task.round}")
        self.done += 1
        log.warning(
            "[%s - round %d] %s's evidence was not delivered: %s (%s)",
            self.name,
            task.round,
            task.peer_id[:8],
            why,
            reply.get("status") if isinstance(reply, dict) else reply,
        )

    def _check(
        self,
        task: schemas.VerifyTask,
        start: TrainState,
        payload_file: Path,
        local: dict[str, Any],
        spill: Path,
        sources: list[str],
    ) -> None:
        mine, compute_s = self._reexecute(task, start, local, spill)
        claimed_end = self._claimed_end(task, mine, start)
        local_path = local.get("previous_end_path")
        t0 = time.perf_counter()
        payload = payload_file.read_bytes()
        numel = sum(start.params[n].numel() for n in self.strategy.fragment_names(task.fragment))
        verdict = verify.compare(
            _claimed(task.commitments),
            payload,
            mine,
            self.strategy.codec,
            numel,
            self.cfg.trust.tolerance,
            claimed_end,
        )
        compute_s += time.perf_counter() - t0
        self.compute_s += compute_s
        body: dict[str, Any] = {
            "run_id": self.run_id,
            "round": task.round,
            "validator_id": self.validator_id,
            "task_id": task.task_id,
            "outcome": "agree" if verdict.agree else "disagree",
            "exact": verdict.exact,
            # a malformed claim is infinitely far: JSON has no inf (the local-state chain:
            # commitment 0 faults)
            "distance": verdict.distance if math.isfinite(verdict.distance) else None,
            "detail": verdict.detail[:500],
            "compute_s": compute_s,
        }
        if not verdict.agree:
            body.update(self._evidence(mine, verdict.segment, sources))
            self._upload_start_evidence(task, local_path, sources)
        self.client.post("/v1/verify/report", body, round=task.round)
        self._keep_head(f"the head after its report on round {task.round}")
        self.done += 1
        log.info(
            "[%s - round %d] %s's contribution: %s (distance %s) in %.1f s",
            self.name,
            task.round,
            task.peer_id[:8],
            "agrees" if verdict.agree else f"DISAGREES from segment {verdict.segment}",
            "exact" if verdict.exact else f"{verdict.distance:.3g}",
            compute_s,
        )

    def _reexecute(
        self, task: schemas.VerifyTask, start: TrainState, local: dict[str, Any], spill: Path
    ) -> tuple[verify.Reexecution, float]:
        """The round re-executed from its committed inputs -> (it, its compute seconds)."""
        k = self.cfg.trust.commit_every
        t0 = time.perf_counter()
        points = len(verify.commitment_steps(task.inner_steps, k))
        self._reexecuting = task.task_id  # a stop signal cuts it short (`_on_signal`)
        try:
            if self.stop.is_set():
                raise Stopping(f"stopped before the re-execution of task {task.task_id}")
            mine = verify.reexecute(
                self.strategy,
                start,
                self._batch_fn(task),
                task.inner_steps,
                k,
                [i for i, c in enumerate(task.commitments) if 0 < i < points and c.get("hash")],
                previous_end=local.pop("previous_end"),
                previous_accepted=task.previous_accepted,
                start_names=(task.start_hash, task.local_state_cid),
                spill_dir=spill,
                consume_previous_end=True,
            )
        finally:
            self._reexecuting = None
        # the gradients, the inner moments (3 model sizes) and the strategy's hold on the
        # start weights are not needed to compare; the next begin_round resets them anyway
        self.strategy.free_round_memory(optimizer=True, start=True)
        return mine, time.perf_counter() - t0

    def _claimed_end(
        self, task: schemas.VerifyTask, mine: verify.Reexecution, start: TrainState
    ) -> verify.Commitment | None:
        """The commitment to the end state the worker named (the next round starts from
        it). When the re-execution's end state has the content id the worker named
        (`Reexecution.end_cid`: bit-identical), the named bytes are this recomputation and
        nothing travels. Otherwise (an honest re-execution on another thread count, or a
        forged end state) the named state is fetched from the worker's providers, to be
        compared within the tolerance; an unusable one is an impossible commitment. None
        for a strategy that carries no local state; Undelivered as `_fetch_evidence`."""
        if task.end_state_cid is None:
            return None
        if mine.end_cid == task.end_state_cid:
            return mine.end
        log.info(
            "[%s - round %d] %s's end state is not this re-execution's bit for bit: fetching it",
            self.name, task.round, task.peer_id[:8],
        )  # fmt: skip
        providers = task.providers or [self.opts.coordinator]
        deadline = time.monotonic() + self._evidence_deadline(task.end_state_size or 0)
        template = self.strategy.evidence_layout()  # shapes only: no zeros made
        with self._fetched(task.end_state_cid, providers, task.end_state_size, deadline) as path:
            try:
                end = verify.local_state_from_file(path, template)
                return evidence_commitment(self.strategy, end, start, task.inner_steps)
            except ValueError as e:
                log.warning("[%s] task %d: end state unusable: %s", self.name, task.task_id, e)
                return verify.Commitment(-1, "0" * 64, {"params": (), "optim": ()})

    def _evidence_deadline(self, evidence_bytes: int) -> float:
        """Seconds a fetch of `evidence_bytes` of a worker's evidence is asked for."""
        limits, trust = self.cfg.limits, self.cfg.trust
        return evidence_deadline_s(limits.request_timeout_s, evidence_bytes, trust.evidence_mbps)

    def _keep_head(self, where: str) -> None:
        """Keep the ledger's signed head as it is now (GET /v1/ledger/head), which holds
        the record of this report (covey.peer.heads). A coordinator that does not answer
        costs the evidence, never the check."""
        try:
            self.heads.keep(self.client.get("/v1/ledger/head", quiet=True), where)
        except (PeerRejected, CoordinatorLost) as e:
            log.warning("[%s] no ledger head to keep: %s", self.name, e)

    def _evidence(
        self, mine: verify.Reexecution, segment: int, sources: list[str]
    ) -> dict[str, Any]:
        """Upload this validator's state at the segment's start and its claim at its end."""
        out: dict[str, Any] = {"segment": segment}
        if segment > 0 and segment in mine.states:  # else the referee recomputes to there
            data = verify.local_state_to_bytes(mine.states[segment])
            out["state_cid"] = self.blobs.upload(
                sources[0], data, content_id(data), signer=(self.identity, self.run_id)
            )
        if segment + 1 < len(mine.commitments):
            out["claim"] = mine.commitments[segment + 1].to_dict()
        else:
            out["payload_cid"] = self.blobs.upload(
                sources[0],
                mine.payload,
                content_id(mine.payload),
                signer=(self.identity, self.run_id),
            )
        return out

    def _upload_start_evidence(
        self, task: schemas.VerifyTask, path: Path | None, sources: list[str]
    ) -> None:
        """A dispute of a contribution that started from a committed local state brings it
        to the coordinator: the referee re-executes from it (it came from the worker,
        checked by its content id, and travels this far only for a dispute)."""
        if path is None or task.local_state_cid is None or not task.providers:
            return
        self.blobs.upload(
            sources[0],
            path.read_bytes(),
            task.local_state_cid,
            signer=(self.identity, self.run_id),
        )

    def _local_states(
        self, task: schemas.VerifyTask, providers: list[str], store: BlobStore
    ) -> dict[str, Any]:
        """The local-state chain's start: the worker's committed end state of its previous
        round, which this round starts from, fetched from `providers` by content id (the
        fetch checks the hash): "previous_end" (None: a fresh start; its file stays in
        `store` as "previous_end_path" for a dispute). A start that is not a local state
        of this run re-executes from a fresh start (commitment 0 then disagrees: the
        worker could not have trained from it). Undelivered when the providers do not
        deliver it within the deadline."""
        previous_end, previous_path = None, None
        if task.local_state_cid is not None:
            deadline = time.monotonic() + self._evidence_deadline(task.local_state_size or 0)
            previous_path = self._fetch_evidence(
                store, task.local_state_cid, providers, task.local_state_size, deadline
            )
            try:
                template = self.strategy.evidence_layout()  # shapes only: no zeros made
                previous_end = verify.local_state_from_file(previous_path, template)
            except ValueError as e:
                log.warning("[%s] task %d: start state unusable: %s", self.name, task.task_id, e)
        return {"previous_end": previous_end, "previous_end_path": previous_path}

    def _fetch_evidence(
        self, store: BlobStore, cid: str, providers: list[str], size: int | None, deadline: float
    ) -> Path:
        """One evidence blob from `providers` into `store`, asked again until `deadline`
        (time.monotonic()); Undelivered when it has not come by then, Stopping when this
        validator stops first (it attests nothing), PeerRejected(410) when the run is halted.
        A transfer under way at the deadline finishes (the blob client's timeouts bound it)."""
        while True:
            try:
                return self.blobs.fetch_into(store, cid, providers, size=size)
            except BlobError as e:
                if self.stop.is_set():  # this validator stops: it attests nothing
                    raise Stopping(f"stopped while fetching evidence {cid[:12]}") from None
                if (halted := self.client.halted(timeout_s=2.0)) is not None:
                    raise PeerRejected(410, halted) from None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Undelivered(
                        f"local state {cid[:12]} not delivered by {len(providers)} provider(s) "
                        f"within the evidence deadline: {e}"
                    ) from None
                self.stop.wait(min(1.0, left))

    @contextlib.contextmanager
    def _fetched(
        self, cid: str, providers: list[str], size: int | None, deadline: float
    ) -> Iterator[Path]:
        """A local state (weights + moments: 1.5 GB at 124M) streamed to a scratch file,
        parsed from there tensor by tensor, and removed: an in-memory fetch holds its
        chunks, their joined copy and the tensors. Undelivered as `_fetch_evidence`."""
        with tempfile.TemporaryDirectory(prefix="covey-validator-") as scratch:
            yield self._fetch_evidence(BlobStore(Path(scratch)), cid, providers, size, deadline)

    def _start_state(self, task: schemas.VerifyTask, sources: list[str]) -> TrainState:
        if self._state is not None and self._state[0] == task.start_cid:
            return self._state[1]
        self._state = None  # the previous start is not held next to the new one
        # its weights only: the outer momentum stays in the file, read for the hash below
        state = fetch_state(
            self.blobs, task.start_cid, sources, task.start_size, self.template, outer_on_disk=True
        )
        if state.digest() != task.start_hash:
            raise RuntimeError(f"start state {task.start_cid[:12]} does not hash to the task's")
        self._state = (task.start_cid, state)
        return state

    def _batch_fn(self, task: schemas.VerifyTask) -> Any:
        return assignment_batches(self.cfg, self.corpus, self.seq_len, task.round, task.data_key)


class Undelivered(Exception):
    """The worker's providers did not deliver a committed local state within the evidence
    deadline (covey.trust.policy.evidence_deadline_s)."""


class Stopping(BaseException):
    """A stop signal in the middle of a re-execution: the validator leaves the task (it
    reports nothing for it) and exits cleanly. A BaseException, so that no `except
    Exception` on the way out of the re-execution takes it for a failed check."""


def _claimed(raw: list[dict[str, Any]]) -> list[verify.Commitment]:
    """The worker's commitments as sent; a malformed one becomes an impossible commitment
    (so `compare` reports the claim as malformed at segment 0)."""
    out = []
    for item in raw:
        try:
            out.append(verify.Commitment.from_dict(item))
        except ValueError:
            out.append(verify.Commitment(-1, "0" * 64, {"params": (), "optim": ()}))
    return out
