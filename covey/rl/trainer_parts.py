"""The parts of the RL trainer that its intake (covey.rl.intake), canaries
(covey.rl.canaries) and judge (covey.rl.verdicts) use: a Protocol, so that they depend on
what they read and not on the trainer module, which imports them."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from covey.blobs import BlobStore
    from covey.coordinator.accounts import Accounts
    from covey.coordinator.db import Database
    from covey.coordinator.membership import Membership
    from covey.rl.batch import RolloutSpec
    from covey.rl.runspec import RLSpec
    from covey.rl.tasks import Task
    from covey.trust.identity import Identity


class TrainerParts(Protocol):
    """What the RL trainer's intake, canaries and judge read of the trainer
    (covey.rl.trainer.Trainer), which builds them: its run, rules, ledger, blobs and
    members, and its current policy version."""

    run_id: str
    spec: RLSpec
    version: int
    cids: dict[int, str]  # policy version -> content id
    lock: threading.RLock
    db: Database
    blobs: BlobStore
    identity: Identity
    accounts: Accounts
    membership: Membership
    model_cfg: dict[str, Any]  # the policy's model config
    rollout: RolloutSpec  # the batch checks' view of the run
    task: Task

    def policy_at(self, version: int) -> torch.nn.Module:
        """The frozen policy of `version`, on the device batches are judged on."""
