"""`covey bench agreement`: the run spec mirrors the simulator's config, the rows and the
verdict, and a toy run end to end with a real coordinator and workers on 127.0.0.1, whose
network states are evaluated on exactly the simulator's validation batches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from covey.bench.agreement import agreement_size, network_spec, pick_method
from covey.bench.agreement_report import GOAL, agreement_rows, format_table
from covey.bench.comms import LONG, bench_config
from covey.cli import app
from covey.config import RunConfig, steps_per_round


def test_the_run_spec_trains_what_the_simulator_simulates(tmp_path: Path) -> None:
    size = agreement_size(workers=4)
    method = pick_method(size, None)
    assert method.name == "diloco-h100-int4-ef" and size.steps == LONG.steps
    cfg = bench_config(method, size, init=str(tmp_path / "pretrain"), round_offset=1000)
    init_file = tmp_path / "pretrain" / "checkpoints" / "round-001000.safetensors"
    run = RunConfig.model_validate(network_spec(cfg, init_file=init_file, name="x"))
    assert run.algorithm == cfg.algorithm and run.algorithm.error_feedback
    assert run.data == cfg.data and run.data.round_offset == 1000
    assert (run.seed, run.model.size, run.model.init) == (cfg.seed, "nano", str(init_file))
    assert run.peer == cfg.peer  # the CPU, fp32: as the simulator computed
    t = run.trust
    assert (t.aggregation, t.trim_fraction, t.clip_factor) == (
        cfg.trust.aggregation, cfg.trust.trim_fraction, cfg.trust.clip_factor,
    )  # fmt: skip
    r = run.rounds
    assert (r.max_rounds, r.min_peers) == (cfg.rounds, 4) == (20, 4)
    # every peer does the full H: the straggler policy's budget and the deadline are far
    # beyond a round, and every round's state is kept for evaluation
    assert r.target_compute_s / 100 > 60 and r.deadline_min_s >= 600
    assert steps_per_round(run.algorithm) == 100
    assert r.checkpoint_every == 1 and r.keep_checkpoints >= cfg.rounds


def test_flags_and_methods_are_checked() -> None:
    quick = agreement_size(quick=True, workers=3)
    assert (quick.workers, quick.steps, quick.h_long, quick.tail) == (3, 4, 2, 1)
    assert pick_method(quick, None).name == "diloco-h2-int4-ef"
    with pytest.raises(ValueError, match=r"unknown method 'diloco-h7'; choose from \['ddp'"):
        pick_method(quick, "diloco-h7")
    result = CliRunner().invoke(app, ["bench", "agreement", "--workers", "0"])
    assert result.exit_code == 2 and "--workers must be >= 1, got 0" in result.output


def test_rows_judge_the_tail_mean_and_say_whether_round_0_matched() -> None:
    points = [{"round": 0, "step": 0, "val_loss": 2.0}]
    points += [
        {"round": n, "step": 10 * n, "val_loss": v} for n, v in ((1, 1.8), (2, 1.6), (3, 1.5))
    ]
    net = {0: 2.0, 1: 1.9, 2: 1.6, 3: 1.53}
    rows = agreement_rows("m", points, net, tail=2)
    assert [(r["source"], r["round"]) for r in rows[:2]] == [("sim", 0), ("network", 0)]
    s = rows[-1]
    assert s["source"] == "summary" and s["tail_steps"] == [20, 30]
    assert s["sim_val_loss_tail"] == pytest.approx(1.55)
    assert s["network_val_loss_tail"] == pytest.approx(1.565)
    assert s["gap"] == pytest.approx(0.015 / 1.55) and s["goal"] == GOAL
    assert s["agree"] and s["same_batches"]
    assert "AGREE: |gap| 0.97%" in format_table(rows)
    worse = agreement_rows("m", points, {**net, 0: 2.0000001, 3: 1.6}, tail=2)
    assert not worse[-1]["agree"] and not worse[-1]["same_batches"]
    assert "DISAGREE" in format_table(worse) and "NOT A VALID COMPARISON" in format_table(worse)


@pytest.mark.network
@pytest.mark.long  # the spec and batches it rests on are checked by default above
def test_a_toy_run_end_to_end_on_the_simulators_batches(tmp_path: Path) -> None:
    """Warm start, simulation and a network run of 2 workers; then again --from the first
    directory, which reuses its simulation."""
    first, json_path = tmp_path / "first", tmp_path / "rows.json"
    args = ["bench", "agreement", "--quick", "--no-progress", "--timeout-min", "3"]
    result = CliRunner().invoke(app, [*args, "--out", str(first), "--json", str(json_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads(json_path.read_text())
    size = agreement_size(quick=True)
    evals = size.steps // size.h_long + 1  # round 0 and every round (2 rounds, 2 evals)
    assert [r["source"] for r in rows] == ["sim", "network"] * evals + ["summary"]
    assert all(r["method"] == "diloco-h2-int4-ef" for r in rows)
    assert [r["step"] for r in rows if r["source"] == "network"] == [0, 2, 4]
    net = [r["val_loss"] for r in rows if r["source"] == "network"]
    assert all(math.isfinite(v) for v in net) and net[-1] < net[0]  # it trained
    # the network's round-0 state (the warm start, as the coordinator served it) evaluated
    # here equals the simulator's own evaluation of the warm start: the same weights on the
    # same batches with the same function, bit for bit
    sim_summary = json.loads((first / "diloco-h2-int4-ef" / "summary.json").read_text())
    assert net[0] == sim_summary["initial_val_loss"]
    s = rows[-1]
    assert s["same_batches"] and s["sim_final_reevaluated"] and s["every_round_full"]
    assert s["valid"]
    assert s["contributions_per_round"] == [2, 2] and s["inner_steps_per_contribution"] == [2]
    assert math.isfinite(s["gap"]) and s["agree"] == (abs(s["gap"]) <= GOAL)
    assert (first / "agreement.png").is_file() and (first / "records.json").is_file()
    assert "round 0 evaluates identically (same batches): True" in result.output

    second = tmp_path / "second"
    result = CliRunner().invoke(app, [*args, "--from", str(first), "--out", str(second)])
    assert result.exit_code == 0, result.output
    assert "pretrain: kept" in result.output and "(simulator): kept" in result.output
    assert not (second / "pretrain").exists() and not (second / "diloco-h2-int4-ef").exists()
    again = json.loads((second / "records.json").read_text())
    assert [r["val_loss"] for r in again if r["source"] == "sim"] == [
        r["val_loss"] for r in rows if r["source"] == "sim"
    ]
    assert again[1]["val_loss"] == net[0]  # the same warm start, served again


def test_from_a_directory_without_a_warm_start_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    args = ["bench", "agreement", "--quick", "--from", str(tmp_path / "empty")]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "holds no finished warm start of this size" in result.output
