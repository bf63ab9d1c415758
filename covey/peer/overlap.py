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
- `LateCommitter`: the commitments of a round whose start state W_r arrives after its
  first steps. States at commitment steps before then are kept (copies) and committed once
  W_r is known: the same commitments a worker that had W_r from the start would make.
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
from typing import Generic, TypeVar

import torch

from covey.algorithms.base import Strategy, TrainState
from covey.protocol import schemas
from covey.trust.sketch import BUCKETS, commitment_of
from covey.trust.verify import Committer

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


class LateCommitter(Committer):
    """A `Committer` for a round whose start state arrives after its first inner steps.

    Until `start(W_r)`, each commitment step's local state is copied and kept; `start`
    commits them relative to W_r. From then on it is a Committer. `commitments` before
    `start` raises RuntimeError."""

    def __init__(self, strategy: Strategy, commit_every: int, buckets: int = BUCKETS) -> None:
        if commit_every < 1:
            raise ValueError(f"commit_every must be >= 1, got {commit_every}")
        self.strategy = strategy
        self.commit_every = commit_every
        self.buckets = buckets
        self.steps_done = 0
        self.start_params: dict[str, torch.Tensor] | None = None  # type: ignore[assignment]
        self._held: list[tuple[int, dict[str, torch.Tensor]]] = [(0, strategy.local_state())]
        self._recorded = []

    def after_step(self, steps_done: int):  # type: ignore[no-untyped-def]
        if self.start_params is not None:
            return super().after_step(steps_done)
        if steps_done != self.steps_done + 1:
            raise ValueError(f"after_step({steps_done}) after {self.steps_done} steps")
        self.steps_done = steps_done
        if steps_done % self.commit_every == 0:
            self._held.append((steps_done, self.strategy.local_state()))
        return None

    def start(self, start_state: TrainState) -> None:
        """The round's start W_r is known: commit the kept states relative to it."""
        self.start_params = start_state.params
        self._recorded = [
            commitment_of(state, start_state.params, step, self.buckets)
            for step, state in self._held
        ]
        self._held = []

    @property
    def commitments(self):  # type: ignore[no-untyped-def]
        if self.start_params is None:
            raise RuntimeError("commitments of a round whose start state is not known yet")
        return super().commitments


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
