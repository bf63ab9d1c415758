"""Training a worker's round: its start (the local-state chain of covey.algorithms.base),
the assignment's inner steps with commitments every k steps, and the end state sealed
as the blob its contribution names; plus the step timing reported at join and the emulated
slowdown. Mixed into covey.peer.worker.Worker, whose attributes it uses.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from covey.algorithms import Contribution, TrainState
from covey.algorithms.tensors import host_sum
from covey.data.batches import assignment_batches
from covey.devices import synchronize
from covey.models.randomness import step_rng
from covey.peer.overlap import SideCommitter
from covey.peer.worker_types import LocalStates
from covey.protocol import schemas
from covey.protocol.checkpoint import write_safetensors
from covey.trust.committer import Committer
from covey.trust.evidence import evidence_of, local_state_metadata
from covey.trust.sketch import start_digest

log = logging.getLogger("covey.worker")
PUBLISH_ALLOWANCE_S = 1.0  # a flexible round stops this long before the deadline to publish
STEP_PROBE_WARMUP = 2  # untimed passes before the step-time probe at join


def verify_local_metadata() -> dict[str, str]:
    """The safetensors metadata `verify.local_state_to_bytes` writes (its format tag)."""
    return local_state_metadata()


class Training:
    """The training half of a worker (see the module docstring)."""

    # set by Worker
    state: TrainState | None
    _chain: LocalStates | None
    _local: LocalStates | None
    _trained_since_adopt: bool
    name: str
    opts: Any
    cfg: Any
    corpus: Any
    seq_len: int
    store: Any
    strategy: Any
    leader: Any

    _check_standing: Callable[[], None]  # Worker's methods, and its other halves'
    _overlaps: Callable[[], bool]
    _numel: Callable[[], int]

    def _measure_step_time(self) -> float:
        """Median of 3 forward+backward passes on a scratch copy of the model, after 2
        untimed ones (allocator, kernel selection, lazy init); the device is synchronized
        before each clock reading, so a pass's time is its compute, not its launches."""
        model = copy.deepcopy(self.strategy.model)
        device = self.strategy.device
        batch = self._batch(0, "speed-test", 0).to(device)
        times = []
        for i in range(STEP_PROBE_WARMUP + 3):
            synchronize(device)
            t0 = time.perf_counter()
            self.strategy.loss_fn(model, batch).backward()
            synchronize(device)
            if i >= STEP_PROBE_WARMUP:
                times.append(time.perf_counter() - t0)
        return sorted(times)[1] * self.opts.slowdown

    def _emulate_slowdown(self, seconds: float) -> None:
        """Emulated slower hardware: wait `seconds`, checking twice a second that this peer
        may still train (a signal or a HALT ends the wait, a lapsed lease raises
        LeaseLapsed), as a real slow step would be checked before the next one."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.stop.wait(min(0.5, left))
            self._check_standing()

    def _begin_round(self, round_: int) -> None:
        """Put the strategy at the round's start: chained from the end state of our
        contribution to the previous round, else fresh (see the module docstring)."""
        assert self.state is not None
        chain = self._chain if self._chain is not None and self._chain.round == round_ - 1 else None
        if not self.strategy.carries_local_state:
            self.strategy.begin_round(self.state)
            self._local = None
            return
        if chain is None:
            self.strategy.begin_round(self.state)
            self._local = LocalStates(None, round=round_)
            return
        start, start_cid = self._chained_start(chain)
        self.strategy.begin_round(self.state, start, chain.accepted)
        self._local = LocalStates(start_cid, round=round_)

    def _start_digest(self, start_hash: str) -> str:
        """Commitment 0's hash for the round `_begin_round` started from W_r (`start_hash`):
        `covey.trust.sketch.start_digest` of the names its validators are given, the local
        state it started from (`_local.start_cid`, what the contribution names) and whether
        the previous round's certificate accepted that state's contribution."""
        cid = None if self._local is None else self._local.start_cid
        chain = self._chain
        accepted = chain.accepted if chain is not None and cid is not None else True
        return start_digest(start_hash, cid, accepted)

    def _chained_start(self, chain: LocalStates) -> tuple[dict[str, torch.Tensor], str | None]:
        """The local state a chained round starts from, and the content id it names: the
        end state of our previous round's contribution."""
        return chain.end, chain.end_cid

    def _end_round(self) -> None:
        """The local state after this round's work, as the blob the contribution names."""
        if self._local is None:
            return
        if self._overlaps() or self.leader is not None:  # training goes on from it
            self._local.end = self.strategy.local_state()
        else:  # the next round begins with begin_round: the optimizer's moments handed over
            self._local.end = self.strategy.end_local_state()
        # its bytes: `_seal`, off the training thread

    def _seal(self, local: LocalStates | None) -> None:
        """The end state's blob and content id, once, before it is published: the bytes
        of `verify.local_state_to_bytes(evidence_of(strategy, local.end))`, streamed
        into a scratch file of the store and hashed on the way, never held in memory next
        to the tensors (a local state is 1.5 GB at 124M)."""
        if local is None or local.end_cid is not None or not local.end:
            return
        assert self.store is not None
        path = self.store.scratch()
        try:
            with open(path, "wb") as f:
                # only what a validator cannot recompute (covey.trust.evidence.evidence_of)
                evidence = evidence_of(self.strategy, local.end)
                cid, size = write_safetensors(evidence, verify_local_metadata(), f)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        local.end_path, local.end_size, local.end_cid = path, size, cid

    def _train(
        self,
        info: schemas.RoundInfo,
        deadline: float,
        committer: Committer | SideCommitter,
        ahead: tuple[int, float, float] = (0, 0.0, 0.0),
    ) -> tuple[Contribution, float, float, list[dict[str, Any]]]:
        """The assignment's inner steps, committing to the state every k steps; a flexible
        method stops early rather than miss the deadline (its contribution then weighs
        fewer tokens and carries the commitments of the steps it took). `ahead`: (steps,
        compute seconds, loss sum) already trained for this round (overlap)."""
        assert info.assignment is not None and self.state is not None
        steps = info.assignment.inner_steps
        key, take = self._work(info)
        if self.leader is not None:
            self.leader.begin()  # every rank of the group starts where this one does
        inner_step = self.leader.inner_step if self.leader else self.strategy.inner_step
        self._trained_since_adopt = True
        log.debug("[%s - round %d] training %d inner steps", self.name, info.round, steps)
        done, compute_s, loss_sum = ahead
        losses: list[torch.Tensor] = []  # on the device: read once, after the steps
        for step in range(done, take):
            self._check_standing()
            if done and self.strategy.flexible_steps:
                per_step = compute_s / done
                if time.monotonic() + per_step * 1.5 > deadline - PUBLISH_ALLOWANCE_S:
                    log.warning(
                        "[%s] stopping at %d/%d steps to meet the deadline",
                        self.name,
                        done,
                        steps,
                    )
                    break
            loss, seconds = self._timed_step(
                inner_step,
                partial(self._batch, info.round, key, step),
                self._step_seed(info.round, key, step),
            )
            losses.append(loss)
            compute_s += seconds
            done += 1
            committer.after_step(done)
        loss_sum = host_sum(losses, loss_sum)
        commitments = [c.to_dict() for c in committer.commitments]
        if done == 0:  # no step taken: a zero update, and no loss
            if self.leader is not None:
                self.leader.sync_state()  # fsdp: the parked parameters back on the device
            payload = self.strategy.codec.encode(torch.zeros(self._numel()))
            per_step, loss_sum = self.cfg.data.batch_size * self.seq_len, float("nan")
        else:
            if self.leader is not None:
                self.leader.end()  # the contribution counts the whole group's tokens
            elif not self.strategy.carries_local_state:  # nothing of it outlives the round
                self.strategy.free_round_memory(optimizer=True)
            else:
                self.strategy.free_round_memory()  # the gradients
            c = self.strategy.make_contribution()
            payload, per_step = c.payload, c.tokens // done
        claimed, commitments = self._claims(info, done, committer, commitments)
        fragment = self.strategy.round_fragment(info.round)
        contribution = Contribution(payload, per_step * claimed, claimed, fragment)
        return contribution, loss_sum / max(done, 1), compute_s, commitments

    def _work(self, info: schemas.RoundInfo) -> tuple[str, int]:
        """The data key this round trains on and how many inner steps it takes: the
        assignment's."""
        assert info.assignment is not None
        return info.assignment.data_key, info.assignment.inner_steps

    def _claims(
        self,
        info: schemas.RoundInfo,
        done: int,
        committer: Committer | SideCommitter,
        commitments: list[dict[str, Any]],
    ) -> tuple[int, list[dict[str, Any]]]:
        """The inner steps the contribution claims and their commitments: those it took."""
        return done, commitments

    def _timed_step(
        self,
        inner_step: Callable[[torch.Tensor], torch.Tensor],
        batch: Callable[[], torch.Tensor],
        seed: int,
    ) -> tuple[torch.Tensor, float]:
        """One inner step, its batch sampled first -> (loss on the device, seconds: both),
        --slowdown emulated. Its randomness (dropout) is drawn from `seed` (`_step_seed`),
        as a validator's re-execution draws it. Nothing waits for the device: on an
        accelerator the seconds are the host's, which runs ahead of the device by at most
        its launch queue."""
        t0 = time.perf_counter()
        data = batch()
        with step_rng(self.strategy.device, seed):
            loss = inner_step(data)
        if self.opts.slowdown > 1:
            self._emulate_slowdown((time.perf_counter() - t0) * (self.opts.slowdown - 1))
        return loss, time.perf_counter() - t0

    def _batch(self, round: int, key: str, step: int) -> torch.Tensor:
        return assignment_batches(self.cfg, self.corpus, self.seq_len, round, key)(step)

    def _step_seed(self, round: int, key: str, step: int) -> int:
        """The seed of the step's randomness: covey.trust.verify.take_step's for it."""
        return assignment_batches(self.cfg, self.corpus, self.seq_len, round, key).step_seed(step)
