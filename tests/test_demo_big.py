"""`covey demo` sized for a big model: the spec its flags make, and the peak RSS it records.
(The 124M run itself is a benchmark: docs/benchmarks/2026-11-23.md, "124M end to end".)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from covey.config import load_run_config, to_toml
from covey.local.cluster import _vm_hwm
from covey.local.demo import METHODS, demo_spec


@pytest.mark.parametrize("method", METHODS)
def test_big_model_flags_make_a_valid_spec(tmp_path: Path, method: str) -> None:
    spec = demo_spec(method, workers=2, rounds=3, inner_steps=4, batch_size=2, seq_len=64)
    path = tmp_path / "run.toml"
    path.write_text(to_toml(spec))
    cfg = load_run_config(path)
    assert cfg.rounds.max_rounds == 3
    assert cfg.rounds.min_peers == 2  # both workers in every round
    assert (cfg.data.batch_size, cfg.data.seq_len) == (2, 64)
    if method in ("diloco", "streaming"):
        assert cfg.algorithm.inner_steps == 4  # type: ignore[union-attr]
        assert cfg.rounds.target_compute_s >= 600  # H is not cut to a nano round's seconds
    assert cfg.rounds.deadline_min_s >= 900  # a model-sized payload takes minutes to move
    assert cfg.limits.request_timeout_s >= 300  # the coordinator pulls it during a submit
    # a process moving GBs may miss heartbeats for a while without being gone
    assert cfg.rounds.dead_after_s >= 60 and cfg.rounds.lease_s > cfg.rounds.dead_after_s
    plain = demo_spec(method)
    assert "max_rounds" not in plain["rounds"] and "seq_len" not in plain["data"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc only")
def test_peak_rss_is_read_from_the_kernel() -> None:
    ballast = bytearray(64 << 20)  # touched: 64 MiB resident at least once
    peak = _vm_hwm(os.getpid())
    assert peak is not None and peak >= len(ballast)
    assert _vm_hwm(2**22 + 12345) is None  # no such process
