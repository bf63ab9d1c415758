"""`covey bench comms|network|coordinator|model|trust|compare` (the other benchmarks register
themselves from their own modules)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from covey.bench.say import LOG_JSON, bench_say
from covey.cli.common import fail
from covey.cli.root import bench_app


@bench_app.command("comms")
def bench_comms(
    quick: Annotated[bool, typer.Option(help="CPU size: finishes in ~10 min on 2 cores")] = False,
    long: Annotated[
        bool,
        typer.Option(
            help="after a shared DDP warm-up, every method for the same tokens, 2 seeds, "
            "warmup + cosine variants (the DiLoCo paper's regime; ~23 min on 2 cores, "
            "two at a time)"
        ),
    ] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="write records here")] = None,
    out: Annotated[Path, typer.Option(help="directory for per-method runs and plot")] = Path(
        "runs/bench-comms"
    ),
    model: Annotated[str | None, typer.Option(help="override the model size")] = None,
    steps: Annotated[int | None, typer.Option(help="override inner steps per worker")] = None,
    workers: Annotated[int | None, typer.Option(help="override simulated workers")] = None,
    batch_size: Annotated[int | None, typer.Option(help="override sequences/worker/step")] = None,
    inner_steps: Annotated[
        int | None, typer.Option("--inner-steps", "-H", help="override H of every DiLoCo method")
    ] = None,
    outer_lr: Annotated[float | None, typer.Option(help="override the outer lr")] = None,
    outer_momentum: Annotated[float | None, typer.Option(help="override outer momentum")] = None,
    pretrain_steps: Annotated[
        int | None, typer.Option(help="override the --long warm-up's DDP steps")
    ] = None,
    only: Annotated[list[str] | None, typer.Option(help="run only these methods; repeat")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="keep finished methods in --out, continue cut ones")
    ] = False,
    progress: Annotated[bool, typer.Option(help="show progress bars")] = True,
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            help="methods run at once, one process and one thread each (default: this "
            "machine's cores); the numbers are the same bytes as one at a time",
        ),
    ] = None,
    recount: Annotated[
        Path | None,
        typer.Option(
            "--recount",
            help="print an earlier run's records.json (of this preset) with the verification "
            "evidence counted; trains nothing",
        ),
    ] = None,
    sample_rate: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="count the evidence at this sampling rate instead of the run's default "
            "(a run may lower it with a higher min_stake: docs/trust.md)",
        ),
    ] = None,
    log_json: Annotated[bool, LOG_JSON] = False,
) -> None:
    """DDP vs DiLoCo vs Streaming DiLoCo vs DeMo vs DiLoCo+DCT, same tokens, 8 workers;
    every row counts the verification evidence at the run's default sampling rate."""
    say = bench_say(log_json, "comms")
    from covey.bench.comms import comms_methods, preset, run_comms_bench

    try:
        size = preset(quick, long, model=model, steps=steps, workers=workers,
                      batch_size=batch_size, inner_steps=inner_steps, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, pretrain_steps=pretrain_steps)  # fmt: skip
    except ValueError as e:
        raise fail(str(e)) from None
    if recount is not None:
        from covey.bench.comms import recount_rows

        if not recount.is_file():
            raise fail(f"--recount {recount}: no such file")
        rows = recount_rows(recount, size, sample_rate)
        if json_path:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(rows, indent=2) + "\n")
            say(f"wrote {json_path}")
        return
    names = [m.name for m in comms_methods(size)]
    if only and (unknown := sorted(set(only) - set(names))):
        raise fail(f"unknown method(s) {unknown}; choose from {names}")
    if jobs is None:  # the cores this process may use
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if jobs < 1:
        raise fail(f"--jobs must be >= 1, got {jobs}")
    records = run_comms_bench(size=size, out_dir=out, only=only, resume=resume,
                              progress=progress and not log_json, jobs=jobs,
                              sample_rate=sample_rate)  # fmt: skip
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(records, indent=2) + "\n")
        say(f"wrote {json_path}")


@bench_app.command("network")
def bench_network(
    mbit: Annotated[
        list[float] | None,
        typer.Option("--mbit", help="link rate in Mbit/s, up and down; repeat (default: 10, 100)"),
    ] = None,
    model: Annotated[str, typer.Option(help="GPT size: nano micro mini small gpt2")] = "micro",
    workers: Annotated[int, typer.Option(help="worker processes, one namespace each")] = 2,
    minutes: Annotated[
        float, typer.Option(help="wall-clock budget per run, from round 0's opening")
    ] = 3.0,
    inner_steps: Annotated[int, typer.Option("--inner-steps", "-H", help="DiLoCo's H")] = 50,
    only: Annotated[
        list[str] | None,
        typer.Option(
            help="methods: ddp, diloco, diloco-int4-ef, streaming-int4, "
            "streaming-int4-no-overlap; repeat"
        ),
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write records here")] = None,
    out: Annotated[Path, typer.Option(help="directory for each run's spec, logs and data")] = Path(
        "runs/bench-network"
    ),
    verify_rate: Annotated[
        float | None,
        typer.Option(
            help="share of contributions drawn for verification, new peers' too (no round "
            "waits for their evidence); default the run's (1.0 new, 0.25)"
        ),
    ] = None,
    validators: Annotated[
        int,
        typer.Option(
            help="validator processes, one namespace each: they fetch drawn contributions' "
            "evidence from the workers over the capped links (paced at trust.evidence_mbps)"
        ),
    ] = 0,
    log_json: Annotated[bool, LOG_JSON] = False,
) -> None:
    """DDP vs DiLoCo vs DiLoCo + int4 + error feedback: real processes over rate-limited
    network namespaces (needs root and iproute2). Results go in BENCHMARKS.md."""
    say = bench_say(log_json, "network")
    if verify_rate is not None and not 0 <= verify_rate <= 1:
        raise fail(f"--verify-rate must be in [0, 1], got {verify_rate}")
    if validators < 0:
        raise fail(f"--validators must be >= 0, got {validators}")
    if workers < 1:
        raise fail(f"--workers must be >= 1, got {workers}")
    if minutes <= 0:
        raise fail(f"--minutes must be positive, got {minutes}")
    if mbit and (bad := [m for m in mbit if m <= 0]):
        raise fail(f"--mbit must be positive, got {bad}")
    from covey.bench.netns import TestbedUnavailable, check_support
    from covey.bench.network import METHOD_KEYS

    if only and (unknown := sorted(set(only) - set(METHOD_KEYS))):
        raise fail(f"unknown method(s) {unknown}; choose from {list(METHOD_KEYS)}")
    if (reason := check_support()) is not None:
        raise fail(f"covey bench network needs root and iproute2: {reason}")
    from covey.bench.network import run_network_bench

    try:
        records = run_network_bench(
            mbits=tuple(mbit or (10.0, 100.0)),
            model=model,
            workers=workers,
            minutes_per_run=minutes,
            out_dir=out,
            methods=tuple(only or METHOD_KEYS),
            inner_steps=inner_steps,
            verify_rate=verify_rate,
            validators=validators,
        )
    except (TestbedUnavailable, RuntimeError) as e:
        raise fail(f"{e}\n(records of the runs before it: {out / 'records.json'})") from None
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(records, indent=2) + "\n")
        say(f"wrote {json_path}")


@bench_app.command("coordinator")
def bench_coordinator(
    peers: Annotated[int, typer.Option(min=1, help="simulated peers (own keys, real HTTP)")] = 1000,
    duration: Annotated[float, typer.Option(min=1, help="seconds measured")] = 60.0,
    warmup: Annotated[
        float, typer.Option(min=0, help="seconds run before measuring (the start-up herd)")
    ] = 5.0,
    heartbeat_s: Annotated[float, typer.Option(help="each peer heartbeats this often")] = 2.0,
    round_wait_s: Annotated[
        float,
        typer.Option(
            min=0,
            max=30,
            help="each peer long-polls /v1/round this long, as workers do; 0: poll every "
            "--poll-s instead",
        ),
    ] = 5.0,
    poll_s: Annotated[
        float, typer.Option(help="with --round-wait-s 0: each peer polls /v1/round this often")
    ] = 2.0,
    submitters: Annotated[int, typer.Option(min=0, help="peers that submit every round")] = 4,
    procs: Annotated[int, typer.Option(min=1, help="client processes")] = 2,
    out: Annotated[Path | None, typer.Option(help="run directory")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write rows here")] = None,
    log_json: Annotated[bool, LOG_JSON] = False,
    db: Annotated[
        str | None,
        typer.Option(help="the coordinator's --db: an empty postgresql://... database"),
    ] = None,
) -> None:
    """Latency (p50/p99) of heartbeat, round poll (or round long-poll wake-up), upload and
    submit against a real coordinator with many simulated peers, and the coordinator's CPU
    share."""
    say = bench_say(log_json, "coordinator")
    from covey.bench.coordinator import rows_json, run_coordinator_bench

    out = out or Path("runs") / time.strftime("bench-coordinator-%Y%m%d-%H%M%S")
    try:
        rows = run_coordinator_bench(
            out,
            peers=peers,
            duration_s=duration,
            warmup_s=warmup,
            heartbeat_s=heartbeat_s,
            poll_s=poll_s,
            round_wait_s=round_wait_s,
            submitters=submitters,
            procs=procs,
            echo=say,
            db=db,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    for r in rows[:-1]:
        say(
            f"{r['op']:>10}: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, {r['requests']} "
            f"requests ({r['per_s']}/s), {r['errors']} errors, {r['peers']} peers"
        )
    c = rows[-1]
    say(
        f"coordinator: CPU {c['cpu_share']:.0%} of a core ({c['cpu_ms_per_request']} ms a "
        f"request), RSS {c['rss_mib']} MiB, "
        f"{c['rounds']} rounds committed; submissions from {c['submitters']} of "
        f"{c['peers']} peers (real signed uploads and submits); load {c['load_avg']:.1f}"
    )
    if c["error_reasons"]:
        say(f"errors: {c['error_reasons']}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(rows_json(rows))
        say(f"wrote {json_path}")


@bench_app.command("model")
def bench_model(
    steps: Annotated[int, typer.Option(min=1, help="timed inner steps per block")] = 10,
    repeats: Annotated[int, typer.Option(min=1, help="timed blocks per side, alternating")] = 5,
    hidden: Annotated[int, typer.Option(min=32, help="the tiny Llama's hidden size")] = 256,
    layers: Annotated[int, typer.Option(min=1, help="the tiny Llama's layers")] = 4,
    batch_size: Annotated[int, typer.Option(min=1, help="sequences per step")] = 8,
    seq_len: Annotated[int, typer.Option(min=2, help="tokens per sequence")] = 128,
    threads: Annotated[int, typer.Option(min=1, help="torch threads")] = 1,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    json_path: Annotated[Path | None, typer.Option("--json", help="write the result here")] = None,
    log_json: Annotated[bool, LOG_JSON] = False,
) -> None:
    """A worker's inner-step throughput (covey's DiLoCo strategy on build_model('hf:DIR'))
    against a bare transformers + AdamW loop on the same batches, on a tiny Llama built in
    a temp dir: tokens/s of each and covey's overhead (goal: at most 3%)."""
    say = bench_say(log_json, "model")
    from covey.bench.model import run_model_bench

    r = run_model_bench(
        steps=steps, repeats=repeats, hidden=hidden, layers=layers, batch_size=batch_size,
        seq_len=seq_len, threads=threads, device=device, echo=say,
    )  # fmt: skip
    verdict = "goal met" if r["met"] else f"MISSED the {r['goal_pct']}% goal"
    say(
        f"tiny Llama ({r['model']['parameters']:,} parameters), {r['device']}, "
        f"{r['threads']} threads: bare {r['bare_tokens_per_s']:,.0f} tokens/s, covey "
        f"{r['covey_tokens_per_s']:,.0f} tokens/s, overhead {r['overhead_pct']:+.1f}% "
        f"({verdict}; paired blocks {r['paired_overhead_pct']:+.1f}%, bare blocks spread "
        f"{r['bare_spread_pct']:.1f}%); load {r['load_avg']:.1f}"
    )
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(r, indent=1) + "\n")
        say(f"wrote {json_path}")


@bench_app.command("trust")
def bench_trust(
    only: Annotated[
        list[str] | None,
        typer.Option(
            help="calibration, detection, cost, loss, sparse, rl-sampling, finality (repeat; "
            "default all)"
        ),
    ] = None,
    rate: Annotated[float, typer.Option(help="sampling rate of --only sparse")] = 0.2,
    sample_rate: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="the run's trust.sample_rate for --only cost, and the one rate --only "
            "detection draws at (default: the trust default, and a range of rates)",
        ),
    ] = None,
    min_stake: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="the run's trust.min_stake for --only cost (a lower sample_rate needs a "
            "higher stake: docs/trust.md); workers stake it",
        ),
    ] = None,
    rounds: Annotated[int, typer.Option(min=5, help="rounds per local run (cost, loss)")] = 30,
    attack: Annotated[str, typer.Option(help="the cheat of the loss comparison")] = "sign-flip",
    tries: Annotated[int, typer.Option(min=1, help="batches per cheat of --only rl-sampling")] = 20,
    model: Annotated[str, typer.Option(help="GPT size for the calibration")] = "nano",
    out: Annotated[Path | None, typer.Option(help="run directory")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    log_json: Annotated[bool, LOG_JSON] = False,
) -> None:
    """The cost of trust: honest vs cheating re-execution distances (the tolerance's
    calibration), detection probability against the sampling rate, validator compute as a
    fraction of worker compute, validation loss with one of four workers cheating, how
    often RL workers that sample their own way are caught, and how often a party's own
    validator keys clear its cheats."""
    say = bench_say(log_json, "trust")
    known = ["calibration", "detection", "cost", "loss", "sparse", "rl-sampling", "finality"]
    parts = only or known
    if unknown := set(parts) - set(known):
        raise fail(f"--only takes {', '.join(known)}; got {sorted(unknown)}")
    from covey.peer.adversary import BEHAVIORS

    if attack not in BEHAVIORS or attack == "honest":
        raise fail(f"--attack must be one of {', '.join(BEHAVIORS[1:])}; got {attack!r}")
    from covey.bench import trust as bench

    out = out or Path("runs") / time.strftime("bench-trust-%Y%m%d-%H%M%S")
    results: dict[str, Any] = {}
    if "calibration" in parts:
        from covey.bench.trust_calibration import calibrate

        results["calibration"] = calibrate(model_size=model)
        say(json.dumps(results["calibration"]["summary"], indent=1))
    if "detection" in parts:
        rates = bench.RATES if sample_rate is None else (sample_rate,)
        results["detection"] = bench.detection(rates)
        for rate, row in results["detection"].items():
            cells = ", ".join(
                f"{h}: {v['measured']:.3f} ({v['expected']:.3f})" for h, v in row.items()
            )
            say(f"sample rate {rate}: detected {cells}")
    if "cost" in parts:
        trust = {"sample_rate": sample_rate, "min_stake": min_stake}
        trust = {k: v for k, v in trust.items() if v is not None}
        run = bench.local_run(out / "cost", rounds, ["honest"] * 4, trust=trust)
        results["cost"] = {
            "rounds": rounds, "trust": trust, "compute": run["compute"], "wall_s": run["wall_s"]
        }  # fmt: skip
        for phase, c in run["compute"].items():
            say(
                f"{phase}: {c['re-executed']}/{c['contributions']} re-executed; validator "
                f"{c['validator_s']} s / workers {c['worker_s']} s = {c['fraction']:.1%}"
            )
    if "loss" in parts:
        results["loss"] = bench.loss_under_attack(out / "loss", rounds, attack)
        r = results["loss"]
        say(
            f"val loss after {rounds} rounds: honest {r['honest_val_loss']:.4f}, with one "
            f"{attack} of 4: {r['attacked_val_loss']:.4f} ({r['relative']:+.2%}); "
            f"caught: {r['caught']}"
        )
    if "sparse" in parts:  # late and intermittent cheaters at a sparse sampling rate
        from covey.bench.trust_sparse import sparse_report

        results["sparse"] = sparse_report(rate, echo=say)
    if "rl-sampling" in parts:  # RL workers that sample their own way
        from covey.bench.rl_sampling import sampling_report

        results["rl_sampling"] = sampling_report(tries=tries, echo=say)
    if "finality" in parts:  # a party's own validator keys clearing its cheats
        from covey.bench.finality import finality_report

        results["finality"] = finality_report(echo=say)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        say(f"wrote {json_path}")


@bench_app.command("compare")
def bench_compare(
    workers: Annotated[int, typer.Option(help="simulated workers")] = 4,
    steps: Annotated[int, typer.Option(help="inner steps per worker")] = 240,
    out: Annotated[Path | None, typer.Option(help="run directory")] = None,
    log_json: Annotated[bool, LOG_JSON] = False,
) -> None:
    """A minute-long look at the algorithms: DDP vs DiLoCo vs DiLoCo+DCT, simulated
    in-process on the stdlib corpus; prints bytes sent against loss reached."""
    bench_say(log_json, "compare")
    from covey.bench.comms import run_demo

    out = out or Path("runs") / time.strftime("compare-%Y%m%d-%H%M%S")
    run_demo(workers=workers, steps=steps, out_dir=out)
