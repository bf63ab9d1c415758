"""Experiment trackers a run's metrics can also go to: TensorBoard and Weights & Biases.

`metrics.jsonl` in the run directory stays the record; a tracker is an optional copy for
people who watch runs in those tools (``--log tensorboard`` or ``--log wandb``). Each needs
its extra (``pip install 'covey[tensorboard]'`` / ``'covey[wandb]'``); `open_tracker` checks
for it first, so a missing one is a one-line `UserError` before any work starts.

Only finite numbers are logged (a record's strings, lists and None are skipped), each
under its record key, against the round as the step.

- `covey sim` and `covey demo` log their per-round records when the run ends;
- `covey coordinator` logs each committed round as it commits (`follow_rounds`).
"""

from __future__ import annotations

import importlib.util
import math
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from covey.errors import UserError

KINDS = ("tensorboard", "wandb")
_NEEDS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # kind -> module it imports


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under `log_dir` (TensorBoard: ``tensorboard --logdir <log_dir>``)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def wandb_project(flag: str | None = None) -> str:
    """The W&B project: --wandb-project, else $WANDB_PROJECT, else "covey" (where a run's
    metrics are shown: a presentation setting, it changes no run)."""
    return flag or os.environ.get("WANDB_PROJECT") or "covey"


class WandbTracker:
    """A W&B run in `project` (`wandb_project`); honours WANDB_MODE=offline and the other
    W&B settings."""

    def __init__(
        self, out_dir: Path, name: str, config: dict[str, Any], project: str | None = None
    ) -> None:
        import wandb

        out_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=wandb_project(project), name=name, config=config, dir=str(out_dir)
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def check_kind(kind: str | None) -> None:
    """`UserError` for an unknown kind or one whose extra is not installed."""
    if kind is None:
        return
    if kind not in KINDS:
        raise UserError(f"--log must be one of {', '.join(KINDS)}; got {kind!r}")
    if importlib.util.find_spec(_NEEDS[kind]) is None:
        raise UserError(
            f"--log {kind} needs the {kind} extra, which is not installed: "
            f"pip install 'covey[{kind}]'"
        )


def open_tracker(
    kind: str | None,
    out_dir: Path,
    name: str,
    config: dict[str, Any] | None = None,
    project: str | None = None,
) -> Tracker | None:
    """The tracker `kind` asks for (None: none), writing under `out_dir`; `project`: the
    W&B project (`wandb_project`)."""
    check_kind(kind)
    if kind == "tensorboard":
        return TensorBoardTracker(out_dir / "tensorboard")
    if kind == "wandb":
        return WandbTracker(out_dir, name, config or {}, project)
    return None


def scalars(record: dict[str, Any], skip: Iterable[str] = ("round",)) -> dict[str, float]:
    """The finite numbers of a metrics record (bools and the step key left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in skip
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


def log_records(
    tracker: Tracker, records: Iterable[dict[str, Any]], step_key: str = "round"
) -> int:
    """Log each record against its `step_key`; returns how many were logged."""
    n = 0
    for rec in records:
        if isinstance(rec.get(step_key), int):
            tracker.log(rec[step_key], scalars(rec, skip=(step_key,)))
            n += 1
    return n


ROUND_COLUMNS = "round, val_loss, train_loss, bytes, tokens, utilization, closed_at"


def follow_rounds(
    tracker: Tracker, db: Any, stop: threading.Event, poll_s: float = 2.0
) -> threading.Thread:
    """Log the coordinator's committed rounds as they commit, from its database (`db`: a
    covey.coordinator.db.Database), in a daemon thread that ends when `stop` is set (after
    one last poll, so a round committed just before shutdown is not lost)."""

    def run() -> None:
        last = -1
        while True:
            stopping = stop.wait(poll_s)
            rows = db.query(
                f"SELECT {ROUND_COLUMNS} FROM rounds WHERE status = 'committed' AND round > ? "
                "ORDER BY round",
                (last,),
            )
            for row in rows:
                tracker.log(row["round"], scalars(dict(row)))
                last = row["round"]
            if stopping:
                tracker.close()
                return

    thread = threading.Thread(target=run, name="covey-tracker", daemon=True)
    thread.start()
    return thread
