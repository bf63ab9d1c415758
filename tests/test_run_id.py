"""The run id covers the data (covey.config.run_id_of): the same spec on other data is
another run, and a worker handed one run's id refuses a coordinator serving the other."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from covey.config import RunConfig, run_id_of
from covey.local.cluster import LocalCluster

SPEC = """
name = "data-in-the-id"
[model]
size = "nano"
[data]
paths = ["train.jsonl"]
batch_size = 2
seq_len = 16
val_fraction = 0.2
[algorithm]
method = "diloco"
inner_steps = 2
[rounds]
eval_batches = 1
"""


def test_run_id_of_covers_spec_and_data() -> None:
    spec = RunConfig.model_validate({"coordinator_key": "ab" * 32})
    a, b = run_id_of(spec, "0" * 16), run_id_of(spec, "1" * 16)
    assert a != b and len(a) == 16
    assert a == run_id_of(RunConfig.model_validate(spec.model_dump()), "0" * 16)
    other = RunConfig.model_validate({**spec.model_dump(), "seed": 1})
    assert run_id_of(other, "0" * 16) != a
    with pytest.raises(ValueError, match="'not-hex'"):
        run_id_of(spec, "not-hex")


def write_run(root: Path, words: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"{words} number {i}: " + words * (1 + i % 3)} for i in range(40)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "run.toml").write_text(SPEC)
    return root / "run.toml"


@pytest.mark.network
@pytest.mark.long  # two clusters; run_id_of over the data is checked by the pure tests
def test_same_spec_other_data_is_another_run(tmp_path: Path) -> None:
    """Two coordinators, one spec and one coordinator key, different train.jsonl: their
    run ids differ (each one the id peers recompute from /v1/run), and a worker given the
    first run's id refuses the second coordinator before it joins."""
    first = LocalCluster(write_run(tmp_path / "a", "alpha beta "), tmp_path / "a")
    key = first.data_dir / "coordinator.key"
    (tmp_path / "b" / "coordinator").mkdir(parents=True)
    shutil.copy(key, tmp_path / "b" / "coordinator" / "coordinator.key")  # same key
    with first, LocalCluster(write_run(tmp_path / "b", "gamma delta "), tmp_path / "b") as other:
        assert first.config == other.config  # the spec alone cannot tell them apart
        first.start_coordinator()
        other.start_coordinator()
        runs = [c.get("/v1/run") for c in (first, other)]
        assert runs[0]["corpus_fingerprint"] != runs[1]["corpus_fingerprint"]
        assert [r["run_id"] for r in runs] == [first.run_id, other.run_id]
        assert first.run_id != other.run_id
        for cluster, run in zip((first, other), runs, strict=True):
            spec = RunConfig.model_validate(run["spec"])
            assert run_id_of(spec, run["corpus_fingerprint"]) == cluster.run_id

        other.start_worker("stray", "--run-id", first.run_id, "--connect-timeout", "30")
        assert other.wait_exit("stray", 60) == 1
        log = other.tail("stray", lines=50)
        assert f"refusing coordinator {other.url}" in log, log
        assert f"not --run-id {first.run_id}" in log and "data fingerprint" in log, log
        assert other.ids["stray"] not in {p["peer_id"] for p in other.status()["peers"]}
