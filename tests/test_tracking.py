"""--log tensorboard|wandb: metrics.jsonl stays the record, a tracker gets a copy.

The TensorBoard tests write real event files and read them back with TensorBoard's own
reader; they are skipped when the `tensorboard` extra is absent (the test extra has it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from covey.errors import UserError
from covey.tracking import TensorBoardTracker, check_kind, follow_rounds, log_records, scalars

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="the tensorboard extra is not installed (pip install 'covey[tensorboard]')",
)


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_keep_finite_numbers_only() -> None:
    rec = {"round": 3, "val_loss": 2.5, "bytes": 10, "ok": True, "name": "x", "nan": float("nan")}
    assert scalars(rec) == {"val_loss": 2.5, "bytes": 10.0}


def test_unknown_kind_and_missing_extra_are_one_line_errors() -> None:
    with pytest.raises(UserError, match="--log must be one of tensorboard, wandb"):
        check_kind("mlflow")
    check_kind(None)
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(UserError, match=r"pip install 'covey\[wandb\]'"):
            check_kind("wandb")
        r = subprocess.run(
            [sys.executable, "-m", "covey.cli", "sim", "--log", "wandb", "--no-progress"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines() == [
            "error: --log wandb needs the wandb extra, which is not installed: "
            "pip install 'covey[wandb]'"
        ]


@needs_tensorboard
def test_coordinator_rounds_are_followed_as_they_commit(tmp_path: Path) -> None:
    """The coordinator's path: committed rounds read from a real database while it runs."""
    from covey.coordinator.db import Database

    db = Database(tmp_path / "coordinator.db")

    def commit(r: int, status: str = "committed") -> None:
        with db.transaction() as c:
            c.execute(
                "INSERT INTO rounds (round, attempt, status, val_loss, bytes) "
                "VALUES (?, 0, ?, ?, ?)",
                (r, status, 4.0 - r, 1000 * r),
            )

    tracker = TensorBoardTracker(tmp_path / "tb")
    stop = threading.Event()
    commit(0)
    thread = follow_rounds(tracker, db, stop, poll_s=0.05)
    deadline = time.monotonic() + 10
    while not read_scalars(tmp_path / "tb").get("val_loss") and time.monotonic() < deadline:
        time.sleep(0.05)
    commit(1)
    commit(2, status="open")  # not committed: not logged
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()
    got = read_scalars(tmp_path / "tb")
    assert got["val_loss"] == [(0, 4.0), (1, 3.0)]
    assert got["bytes"] == [(0, 0.0), (1, 1000.0)]
    db.close()


@needs_tensorboard
def test_log_records_skips_records_without_a_step(tmp_path: Path) -> None:
    tracker = TensorBoardTracker(tmp_path / "tb")
    n = log_records(tracker, [{"round": 1, "loss": 1.0}, {"loss": 2.0}])
    tracker.close()
    assert n == 1 and read_scalars(tmp_path / "tb") == {"loss": [(1, 1.0)]}
