"""`covey bench comms`: presets and flags, the --long warm start, resume, the tail-judged rows."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from covey.bench.comms import LONG, QUICK, comms_methods, preset, run_comms_bench
from covey.bench.comms_report import MethodRun, summarize, tail_mean
from covey.cli import app
from covey.data.corpus import Corpus

TINY = replace(
    QUICK, steps=4, batch_size=2, workers=2, h_short=2, h_long=4, eval_batches=1, evals=2
)


def test_flags_override_the_preset() -> None:
    size = preset(long=True, workers=4, batch_size=16, inner_steps=50, outer_lr=0.5,
                  outer_momentum=0.8, steps=None)  # fmt: skip
    assert (size.workers, size.batch_size, size.h_long, size.h_short) == (4, 16, 50, 50)
    assert (size.outer_lr, size.outer_momentum, size.steps) == (0.5, 0.8, LONG.steps)
    names = [m.name for m in comms_methods(size)]
    assert "diloco-h50-int4-ef" in names and "diloco-h50-int4-ef-seed1" in names
    streaming = next(m for m in comms_methods(size) if m.name.startswith("streaming"))
    assert streaming.algorithm["fragments"] == 2  # 50 is not a multiple of 4
    assert all(m.algorithm.get("outer_momentum", 0.8) == 0.8 for m in comms_methods(size))
    with pytest.raises(ValueError, match="choose one"):
        preset(quick=True, long=True)
    with pytest.raises(ValueError, match=r"--outer-momentum must be in \[0, 1\), got 1.0"):
        preset(quick=True, outer_momentum=1.0)


def test_the_cli_refuses_bad_flags_in_one_line() -> None:
    result = CliRunner().invoke(app, ["bench", "comms", "--quick", "--workers", "0"])
    assert result.exit_code == 2 and "--workers must be >= 1, got 0" in result.output
    result = CliRunner().invoke(app, ["bench", "comms", "--long", "--only", "diloco-h30"])
    assert result.exit_code == 2 and "unknown method(s) ['diloco-h30']" in result.output
    result = CliRunner().invoke(app, ["bench", "comms", "--quick", "--jobs", "0"])
    assert result.exit_code == 2 and "--jobs must be >= 1, got 0" in result.output


def test_long_has_every_method_a_cosine_variant_and_a_second_seed() -> None:
    methods = {m.name: m for m in comms_methods(LONG)}
    assert {"ddp", "demo-1d", "demo-2d", "streaming-h100-int4", "diloco-h100-dct-ef"} <= set(
        methods
    )
    cosine = methods["diloco-h100-int4-ef-cosine"]
    assert cosine.baseline == "ddp-cosine" and cosine.algorithm["optim"]["schedule"] == "cosine"
    assert methods["ddp-cosine"].algorithm["optim"] == cosine.algorithm["optim"]
    # the configuration with no private state, on the same schedule as its baseline
    bare = methods["diloco-h100-int4-reset-cosine"]
    assert bare.baseline == "ddp-cosine" and bare.algorithm["optim"] == cosine.algorithm["optim"]
    assert bare.algorithm["inner_state"] == "reset" and not bare.algorithm.get("error_feedback")
    second = methods["diloco-h100-int4-ef-seed1"]
    assert (second.seed, second.baseline) == (1, "ddp-seed1")


def test_rows_are_judged_on_the_tail_mean_against_their_baseline() -> None:
    def run(name: str, losses: list[float], sent: float, baseline: str = "ddp") -> MethodRun:
        records = [{"val_loss": v} for v in losses]
        summary = {"bytes_sent_per_worker": sent, "bytes_received_per_worker": sent,
                   "final_val_loss": losses[-1], "sim_time_s": 1.0, "utilization": 1.0,
                   "rounds": 1, "tokens": 1, "parameters": 1, "initial_val_loss": 9.0}  # fmt: skip
        return MethodRun(name, baseline, 0, records, summary)

    assert tail_mean([{"val_loss": 3.0}, {"val_loss": None}, {"val_loss": 1.0}], 2) == 2.0
    runs = {"ddp": run("ddp", [5.0, 2.0, 2.2], 1000.0), "x": run("x", [5.0, 2.2, 2.2], 2.0)}
    rows = {r["method"]: r for r in summarize(runs, tail=2)}
    assert rows["x"]["val_loss_tail"] == pytest.approx(2.2)
    assert rows["x"]["val_loss_gap_vs_ddp"] == pytest.approx(0.1 / 2.1)
    assert rows["x"]["comm_reduction_vs_ddp"] == 500.0 and rows["x"]["val_loss"] == 2.2
    lone = summarize({"y": run("y", [1.0], 1.0, baseline="ddp-cosine")})
    assert lone[0]["val_loss_gap_vs_ddp"] is None


@pytest.mark.slow
def test_long_warm_starts_every_method_and_resume_keeps_finished_ones(
    stdlib_corpus: Corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    size = replace(TINY, pretrain_steps=2)
    out = tmp_path / "bench"
    rows = run_comms_bench(size=size, out_dir=out, only=["ddp"], progress=False,
                           corpus=stdlib_corpus)  # fmt: skip
    summary = json.loads((out / "ddp" / "summary.json").read_text())
    assert summary["round_offset"] == 2  # past the 2-step warm-up's batches
    assert summary["init"] == str(out / "pretrain" / "checkpoints" / "round-000002.safetensors")
    assert not (out / "ddp" / "checkpoint").exists()  # snapshots go once a method is done
    mtime = (out / "ddp" / "summary.json").stat().st_mtime_ns
    capsys.readouterr()
    again = run_comms_bench(size=size, out_dir=out, only=["ddp", "diloco-h4"], resume=True,
                            progress=False, corpus=stdlib_corpus)  # fmt: skip
    printed = capsys.readouterr().out
    assert printed.count("kept: finished earlier") == 2  # the warm-up and ddp
    assert (out / "ddp" / "summary.json").stat().st_mtime_ns == mtime
    assert again[0] == rows[0] and again[1]["method"] == "diloco-h4"
    assert again[1]["val_loss_gap_vs_ddp"] is not None
    # another config is not "finished": a changed flag reruns the method
    other = replace(size, outer_lr=0.5)
    run_comms_bench(size=other, out_dir=out, only=["diloco-h4"], resume=True, progress=False,
                    corpus=stdlib_corpus)  # fmt: skip
    assert capsys.readouterr().out.count("kept: finished earlier") == 1  # the warm-up only


def test_methods_side_by_side_give_the_same_numbers_as_one_at_a_time(
    stdlib_corpus: Corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    picks = ["ddp", "diloco-h2", "demo-1d"]
    alone = run_comms_bench(size=TINY, out_dir=tmp_path / "one", only=picks, progress=False,
                            corpus=stdlib_corpus)  # fmt: skip
    capsys.readouterr()
    side = run_comms_bench(size=TINY, out_dir=tmp_path / "two", only=picks, progress=False,
                           corpus=stdlib_corpus, jobs=2)  # fmt: skip
    printed = capsys.readouterr().out
    assert "3 methods, 2 at a time: demo-1d, ddp, diloco-h2" in printed  # the longest first
    assert [r["method"] for r in side] == [r["method"] for r in alone] == ["ddp", "diloco-h2",
                                                                          "demo-1d"]  # fmt: skip
    for a, b in zip(alone, side, strict=True):
        for key in ("val_loss", "val_loss_tail", "bytes_sent_per_worker", "rounds", "tokens"):
            assert a[key] == b[key], (a["method"], key)
    for name in picks:
        one = (tmp_path / "one" / name / "metrics.jsonl").read_text().splitlines()
        two = (tmp_path / "two" / name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["val_loss"] for x in one] == [json.loads(x)["val_loss"] for x in two]
    with pytest.raises(ValueError, match="--jobs must be >= 1, got 0"):
        run_comms_bench(size=TINY, out_dir=tmp_path / "x", progress=False, jobs=0,
                        corpus=stdlib_corpus)  # fmt: skip


def test_every_row_counts_the_evidence_at_the_default_rate(
    stdlib_corpus: Corpus, tmp_path: Path
) -> None:
    """A method that keeps private state (DiLoCo's moments and residual) sends each
    validator of a drawn contribution what it published of the end state it started from:
    its first new_peer_contributions always, the rest at the default sample_rate; a method
    that keeps none (DDP, DiLoCo with its inner optimizer reset and no error feedback)
    sends nothing; the reduction
    against DDP is given with and without the evidence, and `--recount` prints an earlier
    run's rows with it, training nothing."""
    from covey.bench.comms import bench_config, comms_methods, count_evidence
    from covey.bench.comms_evidence import checked_share, evidence_per_worker, evidence_state_bytes
    from covey.config import TrustConfig

    methods = {m.name: m for m in comms_methods(LONG)}
    keep = bench_config(methods["diloco-h100-int4-ef"], LONG)
    params = 120_576  # the nano GPT
    moments, residuals = 2 * params * 4, 2 * params * 4  # AdamW's two; residual and pending
    vocab = stdlib_corpus.vocab_size
    assert evidence_state_bytes(keep, vocab) == pytest.approx(moments + residuals, rel=0.01)
    none = bench_config(methods["diloco-h100-int4-reset"], LONG)
    assert evidence_state_bytes(none, vocab) == 0
    trust = TrustConfig()
    # 20 rounds: 3 always checked by validators_per_check validators (the first has no
    # start state), 17 at the rate by one; audits at audit_rate; one start state a check
    k, audit = trust.validators_per_check, trust.audit_rate
    want = 10 * (2 * (k + audit) + 17 * trust.sample_rate * (1 + audit))
    assert evidence_per_worker(keep, 20, 10) == pytest.approx(want)
    rows = [
        {"method": "ddp", "baseline": "ddp", "bytes_sent_per_worker": 1e9, "rounds": 2000},
        {"method": "diloco-h100-int4-ef", "baseline": "ddp", "bytes_sent_per_worker": 1e6,
         "rounds": 20},
        {"method": "diloco-h100-int4-reset", "baseline": "ddp", "bytes_sent_per_worker": 1e6,
         "rounds": 20},
    ]  # fmt: skip
    for r in rows:
        r.update(sim_time_s=100.0, utilization=0.5)
    count_evidence(rows, LONG, stdlib_corpus)
    by = {r["method"]: r for r in rows}
    assert by["ddp"]["evidence_bytes_per_worker"] == 0
    # the modeled multiplier: half the time computing, the other half the network's, plus
    # the share re-executed; the reset method sends no evidence
    reset_cfg = bench_config(comms_methods(LONG)[-1], LONG)
    share = checked_share(reset_cfg, 20)
    assert 0 < share < 1
    assert by["diloco-h100-int4-reset"]["multiplier"] == pytest.approx(2 + share, abs=1e-3)
    assert by["diloco-h100-int4-reset"]["multiplier_adds"]["evidence"] == 0
    assert by["diloco-h100-int4-ef"]["multiplier_adds"]["evidence"] > 0
    assert by["diloco-h100-int4-reset"]["comm_reduction_vs_ddp_with_evidence"] == 1000.0
    ef = by["diloco-h100-int4-ef"]
    assert ef["sample_rate"] == trust.sample_rate and ef["evidence_bytes_per_worker"] > 1e6
    assert ef["comm_reduction_vs_ddp_with_evidence"] == pytest.approx(
        1e9 / (1e6 + ef["evidence_bytes_per_worker"])
    )
    earlier = tmp_path / "records.json"
    for r in rows:
        r.update(val_loss_tail=1.0, val_loss_gap_vs_ddp=0.0, comm_reduction_vs_ddp=1.0,
                 bytes_received_per_worker=1.0, sim_time_s=1.0, utilization=1.0)  # fmt: skip
        del r["evidence_bytes_per_worker"]
    earlier.write_text(json.dumps(rows))
    result = CliRunner().invoke(app, ["bench", "comms", "--long", "--recount", str(earlier)])
    assert result.exit_code == 0, result.output
    rate = TrustConfig().sample_rate  # the default: 0.03
    assert (
        f"evidence: bytes a worker sends its validators at sampling rate {rate:g}" in result.output
    )


def test_the_evidence_can_be_counted_at_a_lower_sampling_rate(stdlib_corpus: Corpus) -> None:
    """`--sample-rate` counts a row's evidence at that rate (a run that lowers it with a
    higher stake, docs/trust.md) instead of the run's default; the payload is the same."""
    from covey.bench.comms import bench_config, comms_methods, count_evidence
    from covey.bench.comms_evidence import evidence_per_worker, evidence_state_bytes
    from covey.config import TrustConfig

    methods = {m.name: m for m in comms_methods(LONG)}
    keep = bench_config(methods["diloco-h100-int4-ef"], LONG)
    state = evidence_state_bytes(keep, stdlib_corpus.vocab_size)
    low = keep.model_copy(update={"trust": keep.trust.model_copy(update={"sample_rate": 0.02})})

    def rows() -> list[dict[str, Any]]:
        return [
            {"method": "ddp", "baseline": "ddp", "bytes_sent_per_worker": 1e9, "rounds": 2000},
            {"method": "diloco-h100-int4-ef", "baseline": "ddp", "bytes_sent_per_worker": 1e6,
             "rounds": 20},
        ]  # fmt: skip

    default, lowered = rows(), rows()
    count_evidence(default, LONG, stdlib_corpus)
    count_evidence(lowered, LONG, stdlib_corpus, sample_rate=0.02)
    d, lo = default[1], lowered[1]
    assert d["sample_rate"] == TrustConfig().sample_rate and lo["sample_rate"] == 0.02
    assert lo["evidence_bytes_per_worker"] == pytest.approx(evidence_per_worker(low, 20, state))
    assert lo["evidence_bytes_per_worker"] < d["evidence_bytes_per_worker"]
    assert lo["comm_reduction_vs_ddp_with_evidence"] > d["comm_reduction_vs_ddp_with_evidence"]
    assert lowered[0]["evidence_bytes_per_worker"] == 0  # DDP keeps no private state


def test_the_trust_bench_runs_a_lower_rate_with_its_stake() -> None:
    """`covey bench trust --sample-rate --min-stake`: the run's trust table takes them, the
    rest of the bench's spec stays."""
    from covey.bench.trust import run_spec
    from covey.config import RunConfig

    base = run_spec(10, 4)
    low = run_spec(10, 4, trust={"sample_rate": 0.02, "min_stake": 19992.0})
    assert low["trust"] == {"min_stake": 19992.0, "sample_rate": 0.02}
    assert {k: v for k, v in low.items() if k != "trust"} == {
        k: v for k, v in base.items() if k != "trust"
    }
    assert RunConfig.model_validate(low).trust.sample_rate == 0.02
