"""Dishonest RL peers, for tests and the demo (`covey rl worker --behavior KIND`,
`covey rl validator --behavior KIND`, `covey rl demo --adversaries N`).

`CheatingRolloutWorker` is the honest covey.rl.worker.RolloutWorker submitting, in the
place of its honest batch, the batch of one cheat of covey.rl.cheats.CHEATS, or "replay":
another worker's accepted batch as it is. `CheatingRolloutValidator` is the honest
covey.rl.validator.RolloutValidator reporting without checking: "lazy" accepts everything,
"accuse" rejects everything (the trainer's audits and re-checks penalize both). The honest
peers import nothing of this; `rollout_worker` and `rollout_validator` build one or the
other.
"""

from __future__ import annotations

from typing import Any

import torch

from covey.rl.batch import RolloutBatch
from covey.rl.cheats import CHEATS, Setting
from covey.rl.validator import RolloutValidator
from covey.rl.worker import RolloutWorker

HONEST = "honest"
REPLAY = "replay"
VALIDATOR_BEHAVIORS = (HONEST, "lazy", "accuse")


def worker_behaviors() -> list[str]:
    """Behaviors a rollout worker can take: honest, replay, and the cheats of CHEATS."""
    return [HONEST, REPLAY, *sorted(k for k in CHEATS if k != REPLAY)]


def rollout_worker(*args: Any, behavior: str = HONEST, **kwargs: Any) -> RolloutWorker:
    """The honest RolloutWorker(*args, **kwargs), or the CheatingRolloutWorker playing
    `behavior`. ValueError for an unknown behavior."""
    if behavior == HONEST:
        return RolloutWorker(*args, **kwargs)
    return CheatingRolloutWorker(*args, behavior=behavior, **kwargs)


def rollout_validator(*args: Any, behavior: str = HONEST, **kwargs: Any) -> RolloutValidator:
    """The honest RolloutValidator(*args, **kwargs), or the CheatingRolloutValidator
    playing `behavior`. ValueError for an unknown behavior."""
    if behavior == HONEST:
        return RolloutValidator(*args, **kwargs)
    return CheatingRolloutValidator(*args, behavior=behavior, **kwargs)


class CheatingRolloutWorker(RolloutWorker):
    """A rollout worker that submits the batch of cheat `behavior` (see the module)."""

    def __init__(self, *args: Any, behavior: str, **kwargs: Any) -> None:
        if behavior not in worker_behaviors():
            raise ValueError(f"unknown behavior {behavior!r}; choose from {worker_behaviors()}")
        self.behavior = behavior
        super().__init__(*args, **kwargs)

    def make_batch(self, model: torch.nn.Module, v: int, cid: str) -> RolloutBatch | None:
        if self.behavior == HONEST:
            return super().make_batch(model, v, cid)
        if self.behavior == REPLAY:
            return self._replay(v)
        setting = Setting(
            policy=model,
            task=self.run.task,
            spec=self.run.rollout,
            step=v,
            worker_id=self.identity.peer_id,
            policy_version=v,
            policy_cid=cid,
        )
        return CHEATS[self.behavior](setting, v)

    def _replay(self, v: int) -> RolloutBatch | None:
        """Another worker's batch for this step (or the latest one), sent as it is."""
        rows = [
            r
            for r in self.client.get("/v1/rl/batches", quiet=True)
            if r["worker_id"] != self.identity.peer_id and r["cid"]
        ]
        if not rows:
            return None
        same = [r for r in rows if r["step"] == v] or rows
        data = self.fetcher.fetch(same[-1]["cid"], [self.trainer_url])
        return RolloutBatch.model_validate_json(data)


class CheatingRolloutValidator(RolloutValidator):
    """A validator that reports "lazy" (all accepted) or "accuse" (all rejected) verdicts
    without checking anything."""

    def __init__(self, *args: Any, behavior: str, **kwargs: Any) -> None:
        if behavior not in VALIDATOR_BEHAVIORS:
            raise ValueError(
                f"unknown validator behavior {behavior!r}; choose from {VALIDATOR_BEHAVIORS}"
            )
        self.behavior = behavior
        super().__init__(*args, **kwargs)

    def verdict(
        self, task: dict[str, Any], batch: RolloutBatch, model: torch.nn.Module
    ) -> dict[str, Any]:
        if self.behavior == "lazy":
            return {"ok": True}
        if self.behavior == "accuse":
            return {"ok": False, "problem": "sampling", "detail": "accused without a check"}
        return super().verdict(task, batch, model)
