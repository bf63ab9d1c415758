"""`covey bench network`: a real coordinator and real workers, each in its own network
namespace behind a 10 Mbit/s tbf, for three short rounds.

Needs root and iproute2. Skipped (with the reason) where unusable, except under CI as root
with `ip` and `tc` present, where a testbed that cannot be built is a failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from covey.bench import netns
from covey.bench.network import run_network_bench
from covey.bench.network_plan import (
    apply_target,
    default_target,
    format_table,
    network_methods,
    run_spec,
    summarize_run,
)
from covey.config import RunConfig, load_run_config, to_toml

pytestmark = [pytest.mark.network, pytest.mark.slow]


def test_every_spec_loads_back_from_its_toml(tmp_path: Path) -> None:
    for method in network_methods(inner_steps=20):
        spec = run_spec(method, model="micro", workers=2, max_rounds=4)
        path = tmp_path / f"{method.key}.toml"
        path.write_text(to_toml(spec))
        assert load_run_config(path) == RunConfig.model_validate(spec)


def test_breakdown_sums_to_the_cycle_and_target_is_reached_by_all() -> None:
    method = network_methods(inner_steps=10)[1]
    opened = {0: 100.0, 1: 112.0, 2: 121.5}
    closed = {0: 111.0, 1: 120.0, 2: 130.0}
    contributions = {
        n: [
            {"compute_s": 5.0, "wall_s": 5.5, "submitted_at": opened[n] + 6.0},
            {"compute_s": 5.2, "wall_s": 5.6, "submitted_at": opened[n] + 7.0},
        ]
        for n in opened
    }
    rounds = [
        {"round": n, "val_loss": loss, "utilization": 0.6, "bytes": 10, "tokens": 100}
        for n, loss in ((0, 3.0), (1, 2.5), (2, 2.4))
    ]
    costs = {"multiplier": 1.5, "adds": {"network": 0.4, "verification": 0.1}}
    status = {"model": "nano", "parameters": 1, "peers": [], "rounds": rounds, "costs": costs}
    rec = summarize_run(
        method=method,
        mbit=10,
        status=status,
        opened=opened,
        closed=closed,
        contributions=contributions,
        budget_s=60,
    )
    b = rec["breakdown_s"]
    parts = ("compute", "worker_other", "start_and_publish", "straggler", "close", "coordinator")
    assert sum(b[k] for k in parts) == pytest.approx(b["cycle"])
    assert b["cycle"] == pytest.approx(9.5)
    assert rec["window_s"] == pytest.approx(30.0)
    assert rec["tokens_per_s"] == pytest.approx(10.0)
    other = {**rec, "best_val_loss": 2.7, "curve": [{"t_s": 5.0, "val_loss": 2.7}]}
    records = [rec, other]
    apply_target(records, default_target(records))
    assert [r["time_to_target_s"] for r in records] == [pytest.approx(20.0), 5.0]
    assert rec["multiplier"] == 1.5 and rec["multiplier_adds"]["network"] == 0.4
    assert "| 1.50x |" in format_table(records)


@pytest.mark.long  # over a minute: `scripts/dev.py test --all`
@pytest.mark.usefixtures("testbed_support")
def test_short_run_over_a_10_mbit_testbed(tmp_path: Path) -> None:
    records = run_network_bench(
        mbits=(10,),
        model="nano",
        workers=2,
        minutes_per_run=1.0,
        out_dir=tmp_path,
        methods=("diloco",),
        inner_steps=10,
        max_rounds=3,
    )
    assert len(records) == 1
    rec = records[0]
    assert rec["mbit"] == 10 and rec["method"] == "diloco-h10"
    assert rec["rounds"] >= 2
    assert 0 < rec["utilization"] <= 1
    assert rec["multiplier"] >= 1.0  # the coordinator's, from its database
    assert rec["bytes_per_round"] > 0 and rec["tokens_per_s"] > 0
    assert rec["time_to_target_s"] is not None  # the default target is reached by every run
    assert json.loads((tmp_path / "records.json").read_text())[0]["rounds"] == rec["rounds"]
    assert not [ns for ns in netns.list_netns() if ns.startswith(f"cvy{os.getpid()}-")]
