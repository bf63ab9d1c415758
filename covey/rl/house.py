"""A house rollout worker: the run owner's own RL worker, whose batches are the RL mode's
canaries (covey.rl.canaries; `covey rl worker --house-of TRAINER_KEY --house-index N`).

It is the honest rollout worker at every step but its canary steps, which it finds as the
trainer does (covey.trust.house.house_canary_draw: the trainer's signature over (run, step,
house key) below the run's `canary_rate`). At those it submits its honest batch with every
sample made bad in a way only a prefill tells (covey.rl.canaries.canary_batch), under the
same key, at the same time and size: its validator cannot tell it from its real batches.
Its key is house key N of the run (covey.trust.house.house_identity, derived from the
trainer's key, so it needs that key file: only the run owner runs house workers). Once a
canary is revealed the key is banned, and the worker goes on under the next house key (a
new join); after the last one (covey.trust.house.HOUSE_KEYS) it stops.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from covey.devices import device_name
from covey.rl.batch import RolloutBatch
from covey.rl.canaries import canary_batch
from covey.rl.peer import Membership
from covey.rl.worker import RolloutWorker
from covey.trust.house import HOUSE_KEYS, house_canary_draw, house_identity
from covey.trust.identity import Identity

log = logging.getLogger("covey.rl.worker")


class HouseRolloutWorker(RolloutWorker):
    """The honest rollout worker under house key `index`, submitting canaries at its
    canary steps (see the module)."""

    def __init__(self, trainer_url: str, trainer_key: Path, index: int = 0, **kwargs: Any) -> None:
        """`kwargs`: RolloutWorker's. ValueError for a missing key file, a key that is not
        this run's trainer's, or an index out of 0..HOUSE_KEYS-1."""
        if not trainer_key.is_file():
            raise ValueError(f"no trainer key file at {trainer_key}")
        owner = Identity.load_or_create(trainer_key)
        super().__init__(trainer_url, Identity.generate(), **kwargs)
        if owner.public_key != self.run.trainer_key:
            raise ValueError(f"{trainer_key} is not the key of this run's trainer")
        self.owner, self.index, self.trainer_url = owner, index, trainer_url
        self._use(house_identity(owner, self.run.run_id, index))  # ValueError out of range
        self.canaries: list[int] = []  # the steps it submitted a canary at

    def _use(self, identity: Identity) -> None:
        self.identity = self.client.identity = identity
        self.membership = Membership(self.client, identity, self.run, self.halt_seen)
        self._fund()

    def _fund(self) -> None:
        """The run's owner funds the house key's stake before it joins (a key bonds only
        credits it holds, covey.trust.treasury): a deposit signed with the trainer's key,
        which only the owner holds; nothing when the key holds or bonds it already.
        covey.io.deposit.DepositRefused when the trainer refuses it."""
        from covey.io.deposit import top_up

        top_up(self.trainer_url, self.owner, self.identity, self.stake, self.run.run_id,
               lambda: self.client.get("/v1/ledger/balances"))  # fmt: skip

    def make_batch(self, model: torch.nn.Module, v: int, cid: str) -> RolloutBatch | None:
        batch = super().make_batch(model, v, cid)
        me = self.identity.peer_id
        draw = house_canary_draw(self.owner, self.run.run_id, v, me, self.run.spec.canary_rate)
        if batch is None or draw is None:
            return batch
        log.info("[%s - step %d] a canary step: its batch is made bad", self.name, v)
        self.canaries.append(v)
        return canary_batch(batch, bytes.fromhex(draw)[:32])

    def excluded(self, reason: str) -> None:
        """Its key was burned by a reveal: go on under the next house key."""
        if self.index + 1 >= HOUSE_KEYS:
            log.warning("[%s] the last house key was burned: stopping", self.name)
            self.stop.set()
            return
        self.membership.leave("house key burned")
        self.index += 1
        self._use(house_identity(self.owner, self.run.run_id, self.index))
        log.info("[%s] its house key was burned (%s): now house key %d", self.name, reason,
                 self.index)  # fmt: skip
        self.membership.join("worker", self.name, self.stake, None, device_name(self.device))
