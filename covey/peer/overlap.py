"""Overlapping a round's communication with the next round's compute (Streaming DiLoCo).

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) hides a fragment's sync behind tau
inner steps: the worker publishes round r's contribution and fetches round r's result while
it trains the first tau steps of round r+1, and merges the result before step tau
(`StreamingDiLoCo.merge_late`; the simulator does the same, covey/sim/simulator.py). The
worker (covey/peer/worker.py) uses three pieces from here:

- `Transfer`: one job on a background thread (the queue is bounded at one: a worker never
  starts round r+1's transfer before round r's result is in). Its result, or the exception
  that ended it, is handed to the training loop by `result`, which has a deadline and ends
  early when the worker is stopped; `join` bounds how long a leaving worker waits for it.
- `SideCommitter`: a round's commitments, sketched on a side thread from copies of the
  local state (the training thread only copies), and for a round whose start state W_r
  arrives after its first steps, kept until W_r is known: the same commitments a worker
  that had W_r from the start and sketched inline would make.
- `speculation_fails`: whether the steps trained ahead stand. They were trained on the
  data of `data_key(run, r+1, peer)` from the end state of this peer's round-r
  contribution; they stand only if round r+1 is open with this peer as a member on that
  key, starting from the weights this peer computed, and round r recorded the contribution
  (so the local-state chain continues from it). Otherwise they are discarded and the round
  is trained again from its committed start, as without overlap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

from covey.algorithms.base import Strategy
from covey.algorithms.state import TrainState
from covey.protocol import schemas
from covey.trust.sketch import BUCKETS, Commitment, commitment_of

T = TypeVar("T")
_POLL_S = 0.25  # how often a wait for a transfer looks at the stop flag


class TransferTimeout(TimeoutError):
    """A background transfer did not finish within its deadline."""


class Transfer(Generic[T]):
    """`fn()` on a daemon thread named `name`; `result` returns its value or raises what it
    raised. Start it with `start`; one Transfer runs one job once."""

    def __init__(self, name: str, fn: Callable[[], T]) -> None:
        self.name = name
        self._fn = fn
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Transfer[T]:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as e:  # handed to the training loop by result(), never lost
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout_s: float, stop: threading.Event | None = None) -> T:
        """The job's value once it has finished, waiting at most `timeout_s`. Re-raises the
        job's exception. TransferTimeout past the deadline; when `stop` is set first, the
        wait ends and the job's outcome is returned if it has one by then, else
        TransferTimeout."""
        end = time.monotonic() + timeout_s
        while not self._done.wait(min(_POLL_S, max(0.0, end - time.monotonic()))):
            if time.monotonic() >= end or (stop is not None and stop.is_set()):
                if stop is not None and stop.is_set() and self._done.wait(_POLL_S):
                    break
                raise TransferTimeout(
                    f"transfer {self.name!r} unfinished after {timeout_s:.0f} s"
                    + (" (stopping)" if stop is not None and stop.is_set() else "")
                )
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def join(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for the thread to end; whether it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class SideCommitter:
    """A worker's commitments (the `Committer` contract: `after_step`, `commitments`,
    `recorded`), sketched off the training thread.

    At each commitment step the local state is copied (a memory copy, on the training
    device) and its sketch computed on a side thread, so the training thread does not wait
    for it; past step 0 a commitment carries no hash, so what reaches the host is its
    sketches' sums (tests/test_commitment_hashes.py counts them); at most
    MAX_PENDING copies wait for the sketcher (then the next one waits: bounded memory).
    With `start_state` None the round's start W_r is not known yet (overlap): copies are
    kept until `start(W_r)`. The commitments equal `Committer`'s for the same steps
    (`commitment_of` of the same state at the same step). `commitments` and `recorded`
    wait for the sketches (RuntimeError before `start`; what a sketch raised, re-raised)."""

    MAX_PENDING = 2

    def __init__(
        self,
        strategy: Strategy,
        start_state: TrainState | None,
        commit_every: int,
        buckets: int = BUCKETS,
        start_digest: str | None = None,
    ) -> None:
        if commit_every < 1:
            raise ValueError(f"commit_every must be >= 1, got {commit_every}")
        self.strategy = strategy
        self.commit_every = commit_every
        self.buckets = buckets
        self.start_digest = start_digest  # commitment 0's hash (None: its state_hash)
        self.steps_done = 0
        # known before step 0 is taken: the state's parameters are W_r's, not copies
        self.start_params = None if start_state is None else start_state.params
        self._held: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._sketches: list[Future[Commitment]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="commitments")
        self._take(0)

    def _take(self, step: int) -> None:
        # a copy, training goes on at once: of what training changes (at step 0 of a
        # round started from W_r nothing is copied: the parameters are W_r's own tensors)
        state = self.strategy.local_state(start=self.start_params)
        if self.start_params is None:
            self._held.append((step, state))
            return
        pending = [f for f in self._sketches if not f.done()]
        if len(pending) >= self.MAX_PENDING:
            pending[0].result()
        self._sketches.append(self._submit(state, self.start_params, step))

    def _submit(
        self, state: dict[str, torch.Tensor], start: dict[str, torch.Tensor], step: int
    ) -> Future[Commitment]:
        digest = self.start_digest if step == 0 else None
        return self._pool.submit(commitment_of, state, start, step, self.buckets, digest=digest)

    def after_step(self, steps_done: int) -> None:
        """Note that `steps_done` inner steps are done; at a multiple of k, take the state.
        ValueError unless steps_done is the previous call's + 1."""
        if steps_done != self.steps_done + 1:
            raise ValueError(f"after_step({steps_done}) after {self.steps_done} steps")
        self.steps_done = steps_done
        if steps_done % self.commit_every == 0:
            self._take(steps_done)

    def start(self, start_state: TrainState, start_digest: str | None = None) -> None:
        """The round's start W_r is known: sketch the states kept so far relative to it
        (`start_digest`: commitment 0's hash, as in the constructor)."""
        self.start_params = start_state.params
        self.start_digest = start_digest
        held, self._held = self._held, []
        for step, state in held:
            self._sketches.append(self._submit(state, start_state.params, step))

    @property
    def recorded(self) -> list[Commitment]:
        """Every commitment taken so far, including one at the current step."""
        if self.start_params is None:
            raise RuntimeError("commitments of a round whose start state is not known yet")
        done = [f.result() for f in self._sketches]
        self._pool.shutdown(wait=False)  # nothing is pending: the thread ends
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="commitments")
        return done

    @property
    def commitments(self) -> list[Commitment]:
        """The claim for a round that ends after `steps_done` steps."""
        return [c for c in self.recorded if c.step < self.steps_done]


def speculation_fails(
    info: schemas.RoundInfo,
    *,
    round_: int,
    data_key: str,
    state_hash: str,
    steps_ahead: int,
    chained: bool,
) -> str | None:
    """Why the `steps_ahead` inner steps trained ahead for `round_` on `data_key` cannot
    stand (None: they stand). `state_hash`: the weights this peer computed for the round's
    start; `chained`: whether the previous round recorded this peer's contribution."""
    if not chained:
        return "the previous round did not record this peer's contribution"
    if info.phase != "open" or info.round != round_:
        return f"round {round_} is not open (round {info.round}, {info.phase})"
    if not info.member or info.assignment is None:
        return f"this peer is not a member of round {round_}"
    if info.assignment.data_key != data_key:
        return f"round {round_}'s data key is {info.assignment.data_key}, not {data_key}"
    if info.assignment.inner_steps <= steps_ahead:
        return f"round {round_} assigns {info.assignment.inner_steps} steps, {steps_ahead} done"
    if info.start_hash != state_hash:
        return f"round {round_} starts from {str(info.start_hash)[:12]}, not {state_hash[:12]}"
    return None
