"""The worker's side of verification: its commitments to its local state every k inner
steps, recorded inside its own training loop (covey.trust.verify re-executes and compares
them; covey.peer.overlap sketches the same ones on a side thread). Commitment 0 carries the
start state's hash; the later ones carry none (`commitment_of`): each is sketched where the
state lives, and only its sketches' sums reach the host."""

from __future__ import annotations

from covey.algorithms.base import Strategy
from covey.algorithms.state import TrainState
from covey.trust.sketch import BUCKETS, Commitment, commitment_of


class Committer:
    """Records a worker's commitments inside its own training loop.

    Construct it right after the strategy took the round's start state (step 0 is
    recorded then, its hash `start_digest` when given: `covey.trust.sketch.start_digest`,
    else the state's own `state_hash`) and call `after_step(n)` after every inner step,
    n = steps done so far.
    `commitments` is always the claim for a round that ends now: the commitments at steps
    0, k, 2k, ... strictly below the steps done (a commitment at the final step is recorded
    when the loop lands on a multiple of k, then dropped from the claim if the round ends
    there; the payload stands for that point). A flexible worker that stops early therefore
    claims the right list without knowing its step count in advance.
    """

    def __init__(
        self,
        strategy: Strategy,
        start_state: TrainState,
        commit_every: int,
        buckets: int = BUCKETS,
        start_digest: str | None = None,
    ) -> None:
        if commit_every < 1:
            raise ValueError(f"commit_every must be >= 1, got {commit_every}")
        self.strategy = strategy
        self.start_params = start_state.params
        self.commit_every = commit_every
        self.buckets = buckets
        self.steps_done = 0
        self.start_digest = start_digest
        self._recorded = [self._commit(0)]

    def _commit(self, step: int) -> Commitment:
        local = self.strategy.local_state(copy=False)
        digest = self.start_digest if step == 0 else None
        return commitment_of(local, self.start_params, step, self.buckets, digest=digest)

    def after_step(self, steps_done: int) -> Commitment | None:
        """Note that `steps_done` inner steps are done; record and return a commitment when
        it is a multiple of k. ValueError unless steps_done is the previous call's + 1."""
        if steps_done != self.steps_done + 1:
            raise ValueError(
                f"after_step({steps_done}) after {self.steps_done} steps: call it after every "
                f"inner step"
            )
        self.steps_done = steps_done
        if steps_done % self.commit_every:
            return None
        c = self._commit(steps_done)
        self._recorded.append(c)
        return c

    @property
    def commitments(self) -> list[Commitment]:
        """The claim for a round that ends after `steps_done` steps."""
        return [c for c in self._recorded if c.step < self.steps_done]

    @property
    def recorded(self) -> list[Commitment]:
        """Every commitment recorded so far, including one at the current step."""
        return list(self._recorded)
