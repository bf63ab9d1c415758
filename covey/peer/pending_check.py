"""A plain round's result checked off the critical path: the certified weights' SHA-256
compared with the certificate, and the state serialized into the worker's blob store for
joiners, on a background thread while the next round trains.

The worker (covey.peer.worker_state) adopts the weights it computed as soon as they are
computed and starts the next round; one `PendingCheck` holds the hash check of that state.
At most one is pending: the next round's contribution is never published, and the next
round result never uses its start state, before `result` has said the check matched; on
a mismatch the worker discards the round's work and re-syncs from the canonical state
(`StateKeeping._settle_check`). Streaming DiLoCo with overlap hides the same work on its
transfer thread instead (covey.peer.overlap), sharded rounds check shard by shard, and a
re-sync hashes what it downloads at once: none of them leaves a check pending.

The state is not copied: a TrainState's tensors are never changed in place once it is
made (the outer step makes new ones; `Strategy.load_state` and `adopt` copy them into the
model, and DiLoCo's pseudo-gradient reads its start weights without writing them), so the
thread reads the same bytes the worker trains from while training moves only the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from covey.algorithms import TrainState


class CheckTimeout(TimeoutError):
    """A pending hash check did not finish within its deadline."""


@dataclass(frozen=True)
class CheckOutcome:
    """What a pending check found: the state's digest and whether it is the certificate's."""

    round: int  # the certificate's round
    digest: str
    matched: bool


class PendingCheck:
    """`state.digest()` compared with `want` on a daemon thread; when they match,
    `on_match(state)` (the worker serves the state and logs) runs on the same thread.
    `result` hands the outcome, or the exception that ended the job, to the caller."""

    def __init__(
        self,
        round_: int,
        state: TrainState,
        want: str,
        on_match: Callable[[TrainState, str], None],
        on_digest: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.round = round_
        self.want = want
        self._state: TrainState | None = state
        self._on_match = on_match
        self._on_digest = on_digest
        self._done = threading.Event()
        self._outcome: CheckOutcome | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0  # how long the job took on its thread
        self._thread = threading.Thread(target=self._run, name=f"check-{round_}", daemon=True)

    def start(self) -> PendingCheck:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            state = self._state
            assert state is not None
            digest = state.digest()
            matched = digest == self.want
            if self._on_digest is not None:
                self._on_digest(digest, matched)
            if matched:
                self._on_match(state, digest)
            self._outcome = CheckOutcome(self.round, digest, matched)
        except BaseException as e:  # handed to the training thread by result(), never lost
            self._error = e
        finally:
            self._state = None  # the worker holds the state; the thread no longer does
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout_s: float) -> CheckOutcome:
        """The outcome once the check has run, waiting at most `timeout_s` (CheckTimeout
        past it). Re-raises the job's exception."""
        if not self._done.wait(timeout_s):
            raise CheckTimeout(
                f"the hash check of round {self.round}'s state took over {timeout_s:.0f} s"
            )
        if self._error is not None:
            raise self._error
        assert self._outcome is not None
        return self._outcome
