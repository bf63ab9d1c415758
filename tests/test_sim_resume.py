"""`covey sim --resume`: a run interrupted after round k and resumed from its checkpoint
ends exactly where the uninterrupted run ends (compute is modelled, so bit for bit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from covey.config import SimConfig
from covey.sim.resume import SnapshotError, load_snapshot, save_snapshot, write_config
from covey.sim.simulator import simulate


class Interrupted(Exception):
    pass


@pytest.fixture(autouse=True, scope="module")
def _restore_threads() -> Any:
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    words = ["round", "worker", "token", "gradient", "outer", "inner", "state", "peer"]
    for i in range(40):
        text = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(300))
        (root / f"doc{i:02d}.txt").write_text(f"document {i}: {text}\n")
    return root


def spec(data: Path, algorithm: dict[str, Any]) -> dict[str, Any]:
    return {
        "seed": 3,
        "workers": 3,
        "steps": 8,
        "eval_batches": 2,
        "algorithm": algorithm,
        "data": {"paths": [str(data)], "batch_size": 2, "seq_len": 32, "val_fraction": 0.25},
        "compute": {"step_time_s": 0.01},  # modelled time: records are reproducible
        # one thread in this process and in `covey sim --resume` alike: an earlier test may
        # have left torch on another count, and inner steps differ in the last bits across
        # thread counts
        "threads": 1,
        "churn": {"leave_prob": 0.3, "join_prob": 0.6},  # membership is part of the state
    }


DILOCO_EF = {"method": "diloco", "inner_steps": 2, "codec": "int8", "error_feedback": True}
STREAMING = {"method": "streaming", "inner_steps": 4, "fragments": 2, "overlap_steps": 1}


@pytest.mark.slow
def test_resumed_streaming_run_equals_the_uninterrupted_one(data_dir: Path, tmp_path: Path) -> None:
    """Streaming DiLoCo: a merge still pending at the checkpoint (overlap) is resumed too.
    (DiLoCo with error feedback: the command-line test below.)"""
    cfg = SimConfig.model_validate(spec(data_dir, STREAMING))
    assert cfg.rounds >= 3
    whole = simulate(cfg, progress=False)

    stop_after = 2

    def checkpoint_then_die(snap: Any) -> None:
        save_snapshot(tmp_path / "checkpoint", snap)
        if snap.round == stop_after:
            raise Interrupted

    with pytest.raises(Interrupted):
        simulate(cfg, progress=False, on_snapshot=checkpoint_then_die)
    snap = load_snapshot(tmp_path / "checkpoint", cfg.config_hash())
    assert snap.round == stop_after
    resumed = simulate(cfg, progress=False, resume=snap)
    assert resumed.records == whole.records
    assert resumed.summary["state_digest"] == whole.summary["state_digest"]


def test_a_checkpoint_of_another_config_or_none_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match=r"no checkpoint in .* without --resume"):
        load_snapshot(tmp_path / "checkpoint")


@pytest.mark.slow
def test_covey_sim_resume_finishes_an_interrupted_run(data_dir: Path, tmp_path: Path) -> None:
    cfg = SimConfig.model_validate(spec(data_dir, DILOCO_EF))
    whole = simulate(cfg, progress=False)
    out = tmp_path / "run"
    write_config(out, cfg.model_dump(mode="json"))  # what `covey sim` writes first

    def die_after_2(snap: Any) -> None:
        save_snapshot(out / "checkpoint", snap)
        if snap.round == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        simulate(cfg, progress=False, on_snapshot=die_after_2)

    def covey(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "covey.cli", "sim", *args],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    # flags that change the config do not resume this run
    r = covey("--resume", "--out", str(out), "--workers", "2", "--no-progress")
    assert r.returncode == 2 and "is of config" in r.stderr and "Traceback" not in r.stderr
    # no config, no flags: the run's own config
    r = covey("--resume", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "resuming after round 2" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state_digest"] == whole.summary["state_digest"]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records == whole.records
