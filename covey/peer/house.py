"""A house worker: the run owner's own worker, whose contributions are the rounds mode's
canaries (covey.trust.house; `covey worker --house-of COORDINATOR_KEY --house-index N`).

It is the honest worker in every round but its canary rounds, which it finds as the
coordinator does: the coordinator's signature over (run, round, house key) below the run's
`canary_rate` (covey.trust.house.house_canary_draw). In those it trains on other data than
it was assigned (covey.peer.adversary's "wrong-data": honest training on other text, so
the model loses nothing), which every validator that re-executes it finds at its first
segment and the referee convicts. Its key is house key N of the run, derived from the
coordinator's key, so it needs that key file: only the run owner runs house workers. Once
its canary is revealed the key is banned and the worker exits; start the next index.

It overlaps rounds as an honest worker does (covey.peer.worker_overlap: Streaming DiLoCo
with tau > 0 publishes round r on a background transfer while round r+1's first tau steps
train), not one round at a time as a cheating worker: a validator watching when
contributions arrive cannot tell it apart. Its canary is made on the training thread
alone: a canary round's data key is the other one from its first step, the steps trained
ahead included (`_data_key_ahead`), and the contribution and end state that the transfer
thread then seals and publishes are the ones that training made, as for any round.
"""

from __future__ import annotations

import logging
from pathlib import Path

from covey.peer import adversary
from covey.peer.cheater import CheatingWorker
from covey.peer.worker import Worker, WorkerOptions
from covey.trust.house import house_canary_draw, house_identity
from covey.trust.identity import Identity

log = logging.getLogger("covey.worker")


class HouseWorker(CheatingWorker):
    """The honest worker under house key `index`, on other data in its canary rounds."""

    def __init__(self, opts: WorkerOptions, coordinator_key: Path, index: int) -> None:
        """ValueError without `opts.run_id` (the house key is derived from it) or for an
        index out of range; IdentityError for an unreadable coordinator key file."""
        if opts.run_id is None:
            raise ValueError("a house worker needs --run-id (its key is derived from it)")
        if not coordinator_key.is_file():
            raise ValueError(f"no coordinator key file at {coordinator_key}")
        super().__init__(opts)
        self.coordinator_identity = Identity.load_or_create(coordinator_key)
        self.identity = house_identity(self.coordinator_identity, opts.run_id, index)
        self.peer_id = self.identity.peer_id
        self.name = opts.name or self.peer_id[:8]
        self.client.identity = self.identity
        self._canary_rounds: set[int] = set()  # logged once each (asked from both threads)

    def _behavior(self, round: int) -> str:
        rate = self.cfg.trust.canary_rate
        owner, run_id = self.coordinator_identity, self.run_id
        planted = house_canary_draw(owner, run_id, round, self.peer_id, rate) is not None
        if planted and round not in self._canary_rounds:
            self._canary_rounds.add(round)
            log.info("[%s] round %d is a canary round: training on other data", self.name, round)
        return "wrong-data" if planted else "honest"

    def _overlaps(self) -> bool:
        """The honest worker's rule (covey.peer.worker_overlap), not a cheat's."""
        return Worker._overlaps(self)

    def _data_key_ahead(self, round_: int, assigned: str) -> str:
        """A canary round's steps trained ahead train on its other data too, as `_work`
        makes the rest of the round's (covey.peer.adversary.data_key)."""
        return adversary.data_key(self._behavior(round_), assigned)
