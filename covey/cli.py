"""The `covey` command line. Arguments are parsed before torch is imported, so --help is instant."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from covey import __version__
from covey.bench.agreement_cli import register as register_bench_agreement
from covey.bench.gpu_cli import register as register_bench_gpu
from covey.bench.shards_cli import register as register_bench_shards
from covey.bench.swarm import register as register_bench_swarm
from covey.config import SimConfig, load_sim_config
from covey.errors import UserError, check_coordinator, check_data_paths
from covey.io.cli import register as register_io
from covey.rl.cli import register as register_rl
from covey.rl.learn_cli import register_bench as register_bench_rl
from covey.spec import SET_HELP
from covey.swarm.cli import register as register_swarm
from covey.trust.ledger_cli import register as register_ledger

# -h is --help everywhere (subcommands inherit it); help text prints as written, brackets too
CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    help="covey: train PyTorch models on decentralized compute with little communication.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=CONTEXT,
    rich_markup_mode=None,
)
bench_app = typer.Typer(
    help="Benchmarks (results go in BENCHMARKS.md).", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(bench_app, name="bench")
register_ledger(app)
register_io(app)  # tokenizer train, export, generate
register_bench_gpu(bench_app)  # covey bench gpu (covey/bench/gpu_cli.py)
register_swarm(app)  # swarm coordinator, server, trainer, demo
register_bench_swarm(bench_app)  # covey bench swarm
register_bench_shards(bench_app)  # covey bench shards (gather vs sharded rounds)
register_bench_agreement(bench_app)  # covey bench agreement (simulator vs network)
register_bench_rl(bench_app)  # covey bench rl (covey/rl/learn_cli.py)
register_rl(app)  # rl trainer, worker, validator, demo

METHODS = "ddp, diloco, streaming, demo"
DEVICE_HELP = "where to train: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N, mps"
LOG_TO = typer.Option(
    "--log", help="also send metrics to tensorboard or wandb (needs covey[tensorboard|wandb])"
)
LOG_JSON = typer.Option("--log-json", help="log one JSON object a line (time, level, peer, ...)")
SET = typer.Option("--set", help=SET_HELP)
WANDB_PROJECT = typer.Option(
    "--wandb-project", help="with --log wandb: the W&B project (default: $WANDB_PROJECT, or covey)"
)

RUN_ID_OPTION = typer.Option(
    "--run-id",
    help="the run id the coordinator printed: refuse a coordinator serving any other run "
    "(its key is part of the id); without it, the coordinator's word is taken",
)
DEBUG = False  # set by `covey --debug`: errors a person can act on also show their traceback


def _version(value: bool) -> None:
    if value:
        typer.echo(f"covey {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="show the traceback behind an error message")
    ] = False,
) -> None:
    global DEBUG
    DEBUG = debug


def _fail(message: str) -> typer.Exit:
    """Print one actionable line (and, with --debug, the exception being handled); exit 2."""
    if DEBUG and sys.exc_info()[0] is not None:
        import traceback

        traceback.print_exc()
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def _overrides(**flags: Any) -> dict[str, Any]:
    """Dotted flag names -> nested dict, skipping flags left unset."""
    out: dict[str, Any] = {}
    for dotted, value in flags.items():
        if value is None:
            continue
        node = out
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def _load(
    config: Path | None,
    overrides: dict[str, Any],
    loader: Callable[..., Any] = load_sim_config,
    sets: list[str] | None = None,
) -> Any:
    """The validated config (covey.spec.load_spec: TOML, flags, then --set pairs), or exit 2
    with one line naming every problem by its key."""
    from covey.spec import load_spec

    try:
        cfg = load_spec(loader, config, overrides, sets or ())
        check_data_paths(getattr(getattr(cfg, "data", None), "paths", ()))
    except UserError as e:
        raise _fail(str(e)) from None
    return cfg


def _guard(check: Callable[[], None]) -> None:
    """Run a covey.guards check; its UserError becomes one line and exit 2."""
    try:
        check()
    except UserError as e:
        raise _fail(str(e)) from None


@app.command()
def sim(
    config: Annotated[Path | None, typer.Argument(help="TOML run spec (flags override it)")] = None,
    method: Annotated[str | None, typer.Option(help=f"algorithm: {METHODS}")] = None,
    workers: Annotated[int | None, typer.Option(help="simulated workers")] = None,
    steps: Annotated[int | None, typer.Option(help="inner steps per worker, whole run")] = None,
    inner_steps: Annotated[int | None, typer.Option("--inner-steps", "-H", help="H")] = None,
    codec: Annotated[
        str | None,
        typer.Option(help="payload codec: fp32 fp16 bf16 int8 int4 topk:R dct:C:K sign"),
    ] = None,
    error_feedback: Annotated[bool | None, typer.Option(help="DiLoCo error feedback")] = None,
    model: Annotated[
        str | None, typer.Option(help="covey:nano|micro|mini|small|gpt2, hf:DIR, py:MOD:FN")
    ] = None,
    init: Annotated[
        str | None,
        typer.Option(help="warm start: a covey checkpoint (file, or covey sim --out dir), hf:DIR"),
    ] = None,
    round_offset: Annotated[
        int | None, typer.Option(min=0, help="key batches by round + this: past a warm-up's")
    ] = None,
    tokenizer: Annotated[str | None, typer.Option(help="bytes or hf:DIR (tokenizer.json)")] = None,
    text_column: Annotated[str | None, typer.Option(help="data column with the text")] = None,
    data: Annotated[
        list[str] | None, typer.Option(help="text/JSONL/JSON/CSV/Parquet/Arrow file or dir; repeat")
    ] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    uplink_mbps: Annotated[float | None, typer.Option(help="per-worker uplink")] = None,
    downlink_mbps: Annotated[float | None, typer.Option(help="per-worker downlink")] = None,
    latency_ms: Annotated[float | None, typer.Option(help="one-way latency")] = None,
    slowdown: Annotated[
        list[float] | None, typer.Option(help="per-worker compute slowdown, cycled; repeat")
    ] = None,
    leave_prob: Annotated[float | None, typer.Option(help="churn: leave chance/round")] = None,
    join_prob: Annotated[float | None, typer.Option(help="churn: rejoin chance/round")] = None,
    device: Annotated[str | None, typer.Option(help=DEVICE_HELP)] = None,
    precision: Annotated[
        str | None, typer.Option(help="inner steps: auto (bf16 on CUDA), fp32 or bf16")
    ] = None,
    out: Annotated[Path, typer.Option(help="run directory")] = Path("runs/sim"),
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
    log_json: Annotated[bool, LOG_JSON] = False,
    log: Annotated[str | None, LOG_TO] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="continue the run in --out from its checkpoint (written after each round); "
            "without a config or flags, with the run's own",
        ),
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="replace the run already in --out")
    ] = False,
    set_: Annotated[list[str] | None, SET] = None,
    wandb_project: Annotated[str | None, WANDB_PROJECT] = None,
) -> None:
    """Simulate N workers training with one algorithm; writes metrics, summary and plot.

    A checkpoint is written to OUT/checkpoint after each round: an interrupted run goes on
    from there with --resume, as it would have gone on uninterrupted."""
    overrides = _overrides(
        seed=seed,
        workers=workers,
        steps=steps,
        model__source=model,
        model__init=init,
        data__round_offset=round_offset,
        data__paths=data,
        data__tokenizer=tokenizer,
        data__text_column=text_column,
        algorithm__method=method,
        algorithm__inner_steps=inner_steps,
        algorithm__codec=codec,
        algorithm__error_feedback=error_feedback,
        network__uplink_mbps=uplink_mbps,
        network__downlink_mbps=downlink_mbps,
        network__latency_ms=latency_ms,
        compute__slowdown=slowdown,
        churn__leave_prob=leave_prob,
        churn__join_prob=join_prob,
        peer__device=device,
        peer__precision=precision,
    )
    from covey.sim.resume import read_config

    if resume and config is None and not overrides and not set_:
        try:  # the run's own config, as it was checkpointed
            overrides = read_config(out) or {}
        except ValueError as e:
            raise _fail(f"{out}/checkpoint/config.json is damaged ({e}); start again") from None
    cfg: SimConfig = _load(config, overrides, sets=set_)
    _logging(False, "sim", log_json)
    _check_tracker(log)
    from covey.guards import lock_dir, prepare_out

    _guard(lambda: lock_dir(out, "covey sim"))  # one run per --out
    _guard(lambda: prepare_out(out, resume=resume, overwrite=overwrite, command="covey sim"))
    say = _say(log_json)
    from covey.algorithms.codecs import get_codec
    from covey.sim.report import save_run
    from covey.sim.resume import SnapshotError, load_snapshot, save_snapshot, write_config
    from covey.sim.simulator import simulate

    try:
        get_codec(cfg.algorithm.codec)
    except ValueError as e:
        raise _fail(f"algorithm.codec: {e}") from None

    snapshot = None
    if resume:
        try:
            snapshot = load_snapshot(out / "checkpoint", cfg.config_hash())
        except SnapshotError as e:
            raise _fail(str(e)) from None
    write_config(out, cfg.model_dump(mode="json"))
    say(f"covey sim: {cfg.algorithm.method}, {cfg.workers} workers, {cfg.rounds} rounds")
    if snapshot is not None:
        say(f"resuming after round {snapshot.round} (checkpoint in {out}/checkpoint)")

    def on_snapshot(snap: Any) -> None:
        save_snapshot(out / "checkpoint", snap)
        if log_json and snap.records:  # each round's record as a log line
            say(json.dumps(snap.records[-1], default=repr))

    try:
        result = simulate(
            cfg, progress=progress and not log_json, on_snapshot=on_snapshot, resume=snapshot
        )
    except ValueError as e:  # model, tokenizer and data that do not fit: before training
        raise _fail(str(e)) from None
    plotted = save_run(out, cfg.algorithm.method, result.records, result.summary)
    name = f"sim-{cfg.algorithm.method}"
    _track(log, out, name, cfg.model_dump(mode="json"), result.records, wandb_project)
    from covey.io.export import save_sim_run

    save_sim_run(out, cfg, result.state)  # checkpoint, model and tokenizer for covey export
    s = result.summary
    say(
        f"final val loss {s['final_val_loss']:.4f}"
        f" | sent/worker {s['bytes_sent_per_worker']:,.0f} B"
        f" | simulated {s['sim_time_s']:.1f} s | utilization {s['utilization']:.1%}"
    )
    say(f"wrote {out}/metrics.jsonl, summary.json" + (", plot.png" if plotted else ""))


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
) -> None:
    """DDP vs DiLoCo vs Streaming DiLoCo vs DeMo vs DiLoCo+DCT, same tokens, 8 workers."""
    from covey.bench.comms import comms_methods, preset, run_comms_bench

    try:
        size = preset(quick, long, model=model, steps=steps, workers=workers,
                      batch_size=batch_size, inner_steps=inner_steps, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, pretrain_steps=pretrain_steps)  # fmt: skip
    except ValueError as e:
        raise _fail(str(e)) from None
    names = [m.name for m in comms_methods(size)]
    if only and (unknown := sorted(set(only) - set(names))):
        raise _fail(f"unknown method(s) {unknown}; choose from {names}")
    if jobs is None:  # the cores this process may use
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if jobs < 1:
        raise _fail(f"--jobs must be >= 1, got {jobs}")
    records = run_comms_bench(size=size, out_dir=out, only=only, resume=resume,
                              progress=progress, jobs=jobs)  # fmt: skip
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(records, indent=2) + "\n")
        typer.echo(f"wrote {json_path}")


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
            help="share of contributions drawn for verification, new peers' too (each moves "
            "its local states through the coordinator); default the run's (1.0 new, 0.25)"
        ),
    ] = None,
) -> None:
    """DDP vs DiLoCo vs DiLoCo + int4 + error feedback: real processes over rate-limited
    network namespaces (needs root and iproute2). Results go in BENCHMARKS.md."""
    if verify_rate is not None and not 0 <= verify_rate <= 1:
        raise _fail(f"--verify-rate must be in [0, 1], got {verify_rate}")
    if workers < 1:
        raise _fail(f"--workers must be >= 1, got {workers}")
    if minutes <= 0:
        raise _fail(f"--minutes must be positive, got {minutes}")
    if mbit and (bad := [m for m in mbit if m <= 0]):
        raise _fail(f"--mbit must be positive, got {bad}")
    from covey.bench.netns import TestbedUnavailable, check_support
    from covey.bench.network import METHOD_KEYS

    if only and (unknown := sorted(set(only) - set(METHOD_KEYS))):
        raise _fail(f"unknown method(s) {unknown}; choose from {list(METHOD_KEYS)}")
    if (reason := check_support()) is not None:
        raise _fail(f"covey bench network needs root and iproute2: {reason}")
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
        )
    except (TestbedUnavailable, RuntimeError) as e:
        raise _fail(f"{e}\n(records of the runs before it: {out / 'records.json'})") from None
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(records, indent=2) + "\n")
        typer.echo(f"wrote {json_path}")


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
) -> None:
    """Latency (p50/p99) of heartbeat, round poll (or round long-poll wake-up), upload and
    submit against a real coordinator with many simulated peers, and the coordinator's CPU
    share."""
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
            echo=typer.echo,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    for r in rows[:-1]:
        typer.echo(
            f"{r['op']:>10}: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, {r['requests']} "
            f"requests ({r['per_s']}/s), {r['errors']} errors, {r['peers']} peers"
        )
    c = rows[-1]
    typer.echo(
        f"coordinator: CPU {c['cpu_share']:.0%} of a core ({c['cpu_ms_per_request']} ms a "
        f"request), RSS {c['rss_mib']} MiB, "
        f"{c['rounds']} rounds committed; submissions from {c['submitters']} of "
        f"{c['peers']} peers (real signed uploads and submits); load {c['load_avg']:.1f}"
    )
    if c["error_reasons"]:
        typer.echo(f"errors: {c['error_reasons']}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(rows_json(rows))
        typer.echo(f"wrote {json_path}")


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
) -> None:
    """A worker's inner-step throughput (covey's DiLoCo strategy on build_model('hf:DIR'))
    against a bare transformers + AdamW loop on the same batches, on a tiny Llama built in
    a temp dir: tokens/s of each and covey's overhead (goal: at most 3%)."""
    from covey.bench.model import run_model_bench

    r = run_model_bench(
        steps=steps, repeats=repeats, hidden=hidden, layers=layers, batch_size=batch_size,
        seq_len=seq_len, threads=threads, device=device, echo=typer.echo,
    )  # fmt: skip
    verdict = "goal met" if r["met"] else f"MISSED the {r['goal_pct']}% goal"
    typer.echo(
        f"tiny Llama ({r['model']['parameters']:,} parameters), {r['device']}, "
        f"{r['threads']} threads: bare {r['bare_tokens_per_s']:,.0f} tokens/s, covey "
        f"{r['covey_tokens_per_s']:,.0f} tokens/s, overhead {r['overhead_pct']:+.1f}% "
        f"({verdict}; paired blocks {r['paired_overhead_pct']:+.1f}%, bare blocks spread "
        f"{r['bare_spread_pct']:.1f}%); load {r['load_avg']:.1f}"
    )
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(r, indent=1) + "\n")
        typer.echo(f"wrote {json_path}")


@bench_app.command("trust")
def bench_trust(
    only: Annotated[
        list[str] | None,
        typer.Option(help="calibration, detection, cost, loss, sparse (repeat; default all)"),
    ] = None,
    rate: Annotated[float, typer.Option(help="sampling rate of --only sparse")] = 0.2,
    rounds: Annotated[int, typer.Option(min=5, help="rounds per local run (cost, loss)")] = 30,
    attack: Annotated[str, typer.Option(help="the cheat of the loss comparison")] = "sign-flip",
    model: Annotated[str, typer.Option(help="GPT size for the calibration")] = "nano",
    out: Annotated[Path | None, typer.Option(help="run directory")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
) -> None:
    """The cost of trust: honest vs cheating re-execution distances (the tolerance's
    calibration), detection probability against the sampling rate, validator compute as a
    fraction of worker compute, and validation loss with one of four workers cheating."""
    parts = only or ["calibration", "detection", "cost", "loss", "sparse"]
    unknown = set(parts) - {"calibration", "detection", "cost", "loss", "sparse"}
    if unknown:
        raise _fail(
            f"--only takes calibration, detection, cost, loss, sparse; got {sorted(unknown)}"
        )
    from covey.peer.adversary import BEHAVIORS

    if attack not in BEHAVIORS or attack == "honest":
        raise _fail(f"--attack must be one of {', '.join(BEHAVIORS[1:])}; got {attack!r}")
    from covey.bench import trust as bench

    out = out or Path("runs") / time.strftime("bench-trust-%Y%m%d-%H%M%S")
    results: dict[str, Any] = {}
    if "calibration" in parts:
        from covey.bench.trust_calibration import calibrate

        results["calibration"] = calibrate(model_size=model)
        typer.echo(json.dumps(results["calibration"]["summary"], indent=1))
    if "detection" in parts:
        results["detection"] = bench.detection()
        for rate, row in results["detection"].items():
            cells = ", ".join(
                f"{h}: {v['measured']:.3f} ({v['expected']:.3f})" for h, v in row.items()
            )
            typer.echo(f"sample rate {rate}: detected {cells}")
    if "cost" in parts:
        run = bench.local_run(out / "cost", rounds, ["honest"] * 4)
        results["cost"] = {"rounds": rounds, "compute": run["compute"], "wall_s": run["wall_s"]}
        for phase, c in run["compute"].items():
            typer.echo(
                f"{phase}: {c['re-executed']}/{c['contributions']} re-executed; validator "
                f"{c['validator_s']} s / workers {c['worker_s']} s = {c['fraction']:.1%}"
            )
    if "loss" in parts:
        results["loss"] = bench.loss_under_attack(out / "loss", rounds, attack)
        r = results["loss"]
        typer.echo(
            f"val loss after {rounds} rounds: honest {r['honest_val_loss']:.4f}, with one "
            f"{attack} of 4: {r['attacked_val_loss']:.4f} ({r['relative']:+.2%}); "
            f"caught: {r['caught']}"
        )
    if "sparse" in parts:  # late and intermittent cheaters at a sparse sampling rate
        from covey.bench.trust_sparse import sparse_report

        results["sparse"] = sparse_report(rate, echo=typer.echo)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        typer.echo(f"wrote {json_path}")


@app.command()
def demo(
    workers: Annotated[int, typer.Option(min=1, help="worker processes")] = 4,
    minutes: Annotated[
        float, typer.Option(min=0.05, help="minutes of training, counted from the first join")
    ] = 2.0,
    algorithm: Annotated[str, typer.Option(help=f"algorithm: {METHODS}")] = "diloco",
    chaos: Annotated[
        bool,
        typer.Option("--chaos", help="every 15-25 s, SIGKILL a random worker and start another"),
    ] = False,
    adversaries: Annotated[
        int,
        typer.Option(
            min=0, help="how many of the workers cheat (sign-flip, lazy, noise, free-rider, ...)"
        ),
    ] = 0,
    validators: Annotated[
        int, typer.Option(min=0, help="validator processes re-executing sampled work")
    ] = 1,
    model: Annotated[
        str, typer.Option(help="covey:nano|micro|mini|small|gpt2 (or the bare size), hf:DIR")
    ] = "nano",
    tokenizer: Annotated[str, typer.Option(help="bytes or hf:DIR (tokenizer.json)")] = "bytes",
    data: Annotated[
        list[str] | None, typer.Option(help="text/JSONL/Parquet/... file or dir; repeat")
    ] = None,
    text_column: Annotated[
        str | None, typer.Option(help="data column with the text (default: text)")
    ] = None,
    seed: Annotated[int, typer.Option(help="seeds the model, the data and the chaos")] = 0,
    rounds: Annotated[
        int | None, typer.Option(min=1, help="stop after this many committed rounds")
    ] = None,
    inner_steps: Annotated[
        int | None, typer.Option(min=1, help="H, inner steps per round (big models: small H)")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="sequences per worker step")] = 8,
    seq_len: Annotated[
        int | None, typer.Option(min=2, help="tokens per sequence (default: the model's)")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="run directory (default: runs/demo-YYYYmmdd-HHMMSS)")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help=DEVICE_HELP + "; every peer, validators included")
    ] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
    log_json: Annotated[bool, LOG_JSON] = False,
    log: Annotated[str | None, LOG_TO] = None,
    set_: Annotated[list[str] | None, SET] = None,
    wandb_project: Annotated[str | None, WANDB_PROJECT] = None,
) -> None:
    """A real run on this machine: a coordinator and N workers as processes on 127.0.0.1.

    Prints the status page's address, shows rounds, validation loss, live peers and bytes
    as they happen, then writes metrics.jsonl, loss.png and summary.json to the run
    directory, and checks the run's ledger. With --adversaries N, N of the workers cheat
    and the validators catch them. Ctrl-C stops every process and still writes what was
    committed."""
    from covey.local.cluster import ClusterError
    from covey.local.demo import METHODS as DEMO_METHODS
    from covey.local.demo import run_local_demo

    if algorithm not in DEMO_METHODS:
        raise _fail(f"--algorithm must be one of {METHODS}, got {algorithm!r}")
    if adversaries > workers:
        raise _fail(f"--adversaries ({adversaries}) cannot exceed --workers ({workers})")
    _check_device(device)
    from covey.guards import lock_dir
    from covey.spec import parse_sets

    _guard(lambda: check_data_paths(data or ()))
    try:
        extra = parse_sets(set_ or ())
    except UserError as e:
        raise _fail(str(e)) from None
    out = out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    _logging(False, "demo", log_json)  # --log-json reaches the children through the env
    _check_tracker(log)
    _guard(lambda: lock_dir(out, "covey demo"))  # one run per --out
    try:
        summary = run_local_demo(
            workers=workers,
            minutes=minutes,
            algorithm=algorithm,
            chaos=chaos,
            adversaries=adversaries,
            validators=validators,
            out_dir=out,
            model=model,
            seed=seed,
            progress=progress,
            tokenizer=tokenizer,
            data=tuple(data or ()),
            rounds=rounds,
            inner_steps=inner_steps,
            batch_size=batch_size,
            seq_len=seq_len,
            device=device,
            text_column=text_column,
            overrides=extra,
        )
    except UserError as e:
        raise _fail(str(e)) from None
    except ValueError as e:  # data, model or tokenizer that do not fit: before any process
        hint = " (--text-column names the data's text column)" if "column" in str(e) else ""
        raise _fail(f"{e}{hint}") from None
    except ClusterError as e:
        raise _fail(f"{e}\n(all logs: {out / 'logs'})") from None
    except KeyboardInterrupt:  # before training started: the children are already stopped
        raise typer.Exit(130) from None
    if log and (out / "metrics.jsonl").exists():
        lines = (out / "metrics.jsonl").read_text().splitlines()
        config = {"algorithm": algorithm, "model": model}
        _track(log, out, out.name, config, map(json.loads, lines), wandb_project)
    if summary["interrupted"]:
        raise typer.Exit(130)


@bench_app.command("compare")
def bench_compare(
    workers: Annotated[int, typer.Option(help="simulated workers")] = 4,
    steps: Annotated[int, typer.Option(help="inner steps per worker")] = 240,
    out: Annotated[Path | None, typer.Option(help="run directory")] = None,
) -> None:
    """A minute-long look at the algorithms: DDP vs DiLoCo vs DiLoCo+DCT, simulated
    in-process on the stdlib corpus; prints bytes sent against loss reached."""
    from covey.bench.comms import run_demo

    out = out or Path("runs") / time.strftime("compare-%Y%m%d-%H%M%S")
    run_demo(workers=workers, steps=steps, out_dir=out)


def _say(json_lines: bool) -> Callable[[str], None]:
    """Where a command's progress lines go: stdout, or with --log-json the JSON log."""
    if not json_lines:
        return typer.echo
    import logging

    return logging.getLogger("covey.cli").info


def _logging(verbose: bool, peer: str = "-", json_lines: bool = False) -> None:
    """Every entrypoint's logging: dated lines naming the peer (covey.logs)."""
    from covey.logs import setup_logging

    setup_logging(peer, verbose=verbose, json_lines=json_lines or None)


@app.command()
def coordinator(
    config: Annotated[Path, typer.Argument(help="TOML run spec; its hash is the run id")],
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8470,
    data_dir: Annotated[
        Path, typer.Option(help="SQLite database, blobs and checkpoints; reuse it to resume")
    ] = Path("runs/coordinator"),
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    verbose: Annotated[bool, typer.Option(help="debug logging")] = False,
    log_json: Annotated[bool, LOG_JSON] = False,
    log: Annotated[str | None, LOG_TO] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="where the referee recomputes disputes: auto|cpu|cuda|cuda:N|mps; default "
            "the run's [peer] verify_device. On another class it judges nothing (warned)"
        ),
    ] = None,
    set_: Annotated[list[str] | None, SET] = None,
    wandb_project: Annotated[str | None, WANDB_PROJECT] = None,
) -> None:
    """Serve a training run: membership, rounds, blobs, checkpoints and the status page.

    Killed and restarted on the same --data-dir, it resumes from the last committed round."""
    from covey.config import load_run_config

    cfg = _load(config, {}, load_run_config, set_)
    _check_device(device)
    _logging(verbose, "coordinator", log_json)
    _check_tracker(log)
    from covey.coordinator.integrity import check_data_dir
    from covey.guards import check_port_free, lock_dir

    _guard(lambda: check_port_free(host, port))  # before the banner, before any file
    _guard(lambda: lock_dir(data_dir, "covey coordinator"))  # one coordinator per data dir
    _guard(lambda: check_data_dir(data_dir))  # a damaged database or state: refused
    from covey.coordinator.app import serve
    from covey.coordinator.service import Coordinator

    try:
        coord = Coordinator(cfg, data_dir, threads=threads, device=device)
    except ValueError as e:
        raise _fail(str(e)) from None
    # the run id covers the coordinator's key: it is what peers are told to trust
    typer.echo(f"covey coordinator: {cfg.name}, status page http://{host}:{port}/")
    typer.secho(f"  run id: {coord.run_id}", bold=True)
    typer.echo(f"  coordinator key: {coord.identity.public_key}")
    typer.echo(f"  hand out: covey worker --coordinator URL --run-id {coord.run_id}")
    if log is None:
        serve(coord, host, port)
        return
    import threading

    from covey.tracking import follow_rounds, open_tracker

    tracker = open_tracker(log, data_dir, cfg.name, cfg.model_dump(mode="json"), wandb_project)
    assert tracker is not None  # _check_tracker accepted `log`
    stop = threading.Event()
    follower = follow_rounds(tracker, coord.db, stop)
    try:
        serve(coord, host, port)
    finally:
        stop.set()
        follower.join(timeout=10)


@app.command()
def worker(
    coordinator: Annotated[
        str, typer.Option(help="the coordinator's URL")
    ] = "http://127.0.0.1:8470",
    identity: Annotated[
        Path | None,
        typer.Option(help="Ed25519 key file, created on first use (mode 600); id = its hash"),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="name on the status page; default: the id's start")
    ] = None,
    stake: Annotated[float, typer.Option(min=0, help="credits staked when first joining")] = 0.0,
    behavior: Annotated[
        str,
        typer.Option(help="tests and demos: honest, or a cheat (see covey.peer.adversary)"),
    ] = "honest",
    device: Annotated[
        str | None,
        typer.Option(
            help=DEVICE_HELP + "; default: the run spec's [peer] device, where auto means the "
            "class the run verifies on (verify_device), so rounding cannot start a dispute"
        ),
    ] = None,
    threads: Annotated[int, typer.Option(help="torch CPU threads")] = 1,
    serve_blobs: Annotated[
        bool, typer.Option(help="serve contributions from our own blob server (else upload)")
    ] = True,
    blob_host: Annotated[
        str, typer.Option(help="address the blob server listens on")
    ] = "127.0.0.1",
    advertise_host: Annotated[
        str | None, typer.Option(help="address other peers reach the blob server at")
    ] = None,
    bandwidth_mbps: Annotated[float | None, typer.Option(help="link estimate, Mbit/s")] = None,
    slowdown: Annotated[
        float, typer.Option(help="emulate slower hardware: steps take this many times longer")
    ] = 1.0,
    store_dir: Annotated[Path | None, typer.Option(help="local blob store")] = None,
    max_rounds: Annotated[int | None, typer.Option(help="leave after this many rounds")] = None,
    connect_timeout: Annotated[
        float, typer.Option(help="seconds to keep trying to reach the coordinator at start")
    ] = 120.0,
    run_id: Annotated[str | None, RUN_ID_OPTION] = None,
    verbose: Annotated[bool, typer.Option(help="debug logging")] = False,
    log_json: Annotated[bool, LOG_JSON] = False,
    group: Annotated[
        str,
        typer.Option(
            help="under torchrun: ddp (every rank holds the model) or fsdp (FSDP2: gradients "
            "and optimizer moments sharded; DiLoCo only)"
        ),
    ] = "ddp",
) -> None:
    """Join a run and train: fetch the canonical state, train each round's assignment,
    publish contributions, apply certified rounds. Ctrl-C / SIGTERM leave cleanly."""
    from covey.peer.adversary import check_behavior

    if slowdown < 1:
        raise _fail(f"--slowdown must be >= 1, got {slowdown}")
    try:  # a plain behavior, late:<kind>:<round> or intermittent:<kind>:<fraction>
        check_behavior(behavior)
    except ValueError as e:
        raise _fail(f"--behavior: {e}") from None
    _check_name(name)
    _check_device(device)
    if group not in ("ddp", "fsdp"):
        raise _fail(f"--group must be ddp or fsdp, got {group!r}")
    from covey.peer.group import rank_from_env

    if rank_from_env() > 0:  # under torchrun: rank 0 is the peer, the others follow it
        from covey.peer.group import run_follower

        raise typer.Exit(run_follower(device, threads, group))
    _check_coordinator(coordinator, connect_timeout)
    _logging(verbose, name or "worker", log_json)
    from covey.peer.worker import Worker, WorkerOptions
    from covey.trust.identity import IdentityError

    opts = WorkerOptions(
        coordinator=coordinator,
        identity=identity,
        name=name,
        stake=stake,
        behavior=behavior,
        device=device,
        group=group,
        threads=threads,
        serve_blobs=serve_blobs,
        blob_host=blob_host,
        advertise_host=advertise_host,
        bandwidth_mbps=bandwidth_mbps,
        slowdown=slowdown,
        store_dir=store_dir,
        max_rounds=max_rounds,
        connect_timeout_s=connect_timeout,
        run_id=run_id,
    )
    try:
        peer = Worker(opts)
    except IdentityError as e:
        raise _fail(str(e)) from None
    from covey.logs import set_peer

    set_peer(peer.name)  # the default name is the id's start, known only now
    raise typer.Exit(peer.run())


def _check_tracker(kind: str | None) -> None:
    """A --log kind that is known and whose extra is installed, or exit 2 before any work."""
    from covey.tracking import check_kind

    try:
        check_kind(kind)
    except UserError as e:
        raise _fail(str(e)) from None


def _track(
    kind: str | None,
    out: Path,
    name: str,
    config: dict[str, Any],
    records: Any,
    project: str | None = None,
) -> None:
    """Send a finished run's per-round records to the --log tracker (if any)."""
    if kind is None:
        return
    from covey.tracking import log_records, open_tracker

    tracker = open_tracker(kind, out, name, config, project)
    if tracker is not None:
        n = log_records(tracker, records)
        tracker.close()
        typer.echo(f"logged {n} rounds to {kind} ({out})")


def _check_coordinator(url: str, wait_s: float) -> None:
    """Refuse a URL without a scheme, or a server that is not a covey coordinator, at once
    (waiting up to `wait_s` only for one that is not reachable yet)."""
    try:
        check_coordinator(url, wait_s)
    except UserError as e:
        raise _fail(str(e)) from None


def _check_device(device: str | None) -> None:
    """Exit 2 naming the value when --device is malformed or absent on this machine."""
    if device is None:
        return
    from covey.devices import DeviceError, resolve_device

    try:
        resolve_device(device)
    except DeviceError as e:
        raise _fail(f"--device: {e}") from None


def _check_name(name: str | None) -> None:
    import re

    if name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise _fail(f"--name may use letters, digits and _.- (1-64 of them), got {name!r}")


@app.command()
def validator(
    coordinator: Annotated[
        str, typer.Option(help="the coordinator's URL")
    ] = "http://127.0.0.1:8470",
    identity: Annotated[
        Path | None,
        typer.Option(help="Ed25519 key file (not a worker's), created on first use"),
    ] = None,
    name: Annotated[str | None, typer.Option(help="name on the status page")] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help=DEVICE_HELP + "; default: the run's verify_device. A validator on another "
            "device class or precision than the run's refuses to check (exit 1)"
        ),
    ] = None,
    threads: Annotated[int, typer.Option(help="torch CPU threads")] = 1,
    max_tasks: Annotated[
        int | None, typer.Option(help="stop after re-executing this many contributions")
    ] = None,
    connect_timeout: Annotated[
        float, typer.Option(help="seconds to keep trying to reach the coordinator at start")
    ] = 120.0,
    run_id: Annotated[str | None, RUN_ID_OPTION] = None,
    stake: Annotated[float, typer.Option(help="credits to stake at the first join")] = 0.0,
    aggregate: Annotated[
        bool,
        typer.Option(
            help="also aggregate the shards of sharded rounds drawn to this key (needs a "
            "stake; the run must use DiLoCo and not turn trust.sharded_above_peers off)"
        ),
    ] = False,
    blob_host: Annotated[
        str, typer.Option(help="--aggregate: address the shard blob server listens on")
    ] = "127.0.0.1",
    blob_port: Annotated[
        int, typer.Option(help="--aggregate: its port (0: any free one)", min=0, max=65535)
    ] = 0,
    advertise_host: Annotated[
        str | None, typer.Option(help="--aggregate: address others reach it at")
    ] = None,
    verbose: Annotated[bool, typer.Option(help="debug logging")] = False,
    log_json: Annotated[bool, LOG_JSON] = False,
) -> None:
    """Re-execute sampled contributions of a run and dispute the ones that disagree.

    Each task is replayed from the round's start state on the same data; a disagreement
    is narrowed to one segment of the worker's commitments, which the coordinator's
    referee recomputes. Proven catches are paid in the run's ledger.

    With --aggregate (and a stake) it is also an aggregator of sharded rounds: for the
    shards a round's beacon draws to this key it reads only those shards' byte ranges of
    every contribution, computes the new shard, serves it from its own blob server and
    publishes its signed hash; a wrong shard is slashed."""
    if aggregate and stake <= 0:
        raise _fail("--aggregate needs --stake > 0: aggregators are drawn from staked keys")
    _check_name(name)
    _check_device(device)
    _check_coordinator(coordinator, connect_timeout)
    _logging(verbose, name or "validator", log_json)
    from covey.peer.validator import Validator, ValidatorOptions
    from covey.trust.identity import IdentityError

    opts = ValidatorOptions(
        coordinator=coordinator,
        identity=identity,
        name=name,
        device=device,
        threads=threads,
        max_tasks=max_tasks,
        connect_timeout_s=connect_timeout,
        run_id=run_id,
        stake=stake,
        aggregate=aggregate,
        blob_host=blob_host,
        blob_port=blob_port,
        advertise_host=advertise_host,
    )
    try:
        checker = Validator(opts)
    except IdentityError as e:
        raise _fail(str(e)) from None
    from covey.logs import set_peer

    set_peer(checker.name)
    raise typer.Exit(checker.run())


@app.command()
def halt(
    coordinator: Annotated[str, typer.Option(help="the coordinator's URL")],
    key: Annotated[
        Path,
        typer.Option(
            help="the run owner's key file: the one whose public key is the spec's owner_key, "
            "or, when the spec names none, the coordinator's (DATA_DIR/coordinator.key)"
        ),
    ],
    reason: Annotated[
        str, typer.Option(help="why: written to the ledger and shown to every worker")
    ] = "halted by the run owner",
    run_id: Annotated[str | None, RUN_ID_OPTION] = None,
) -> None:
    """Stop a run for good, as its owner.

    The owner's signed HALT is written to the run's ledger; the open round is aborted and
    no round opens again; workers exit with status 3 at their next heartbeat (at the
    latest when their participation lease runs out). The coordinator keeps serving the
    ledger (`covey ledger verify` accepts a halted run) and the last certified
    checkpoint. Exit 0 once the HALT is in the ledger, 2 if it was refused."""
    if not key.is_file():
        raise _fail(f"no key file at {key}")
    _check_coordinator(coordinator, 10.0)
    from covey.config import RunConfig, run_id_of
    from covey.peer.client import CoordinatorClient, CoordinatorLost, PeerRejected
    from covey.trust.identity import Identity, IdentityError

    try:
        owner = Identity.load_or_create(key)
    except IdentityError as e:
        raise _fail(str(e)) from None
    client = CoordinatorClient(coordinator, timeout_s=30.0, lost_s=30.0, identity=owner)
    try:
        info = client.get("/v1/run")
        spec_run_id = run_id_of(  # spec and data: the id the owner handed out
            RunConfig.model_validate(info["spec"]), str(info["corpus_fingerprint"])
        )
        if spec_run_id != info["run_id"] or (run_id is not None and spec_run_id != run_id):
            raise _fail(
                f"the coordinator serves run {info['run_id']} (its spec hashes to "
                f"{spec_run_id}), not --run-id {run_id}"
            )
        body = {"run_id": spec_run_id, "owner_key": owner.public_key, "reason": reason}
        halted = client.post("/v1/halt", body)["halted"]
    except PeerRejected as e:
        raise _fail(f"the coordinator refused the HALT: {e}") from None
    except (CoordinatorLost, ValueError) as e:
        raise _fail(str(e)) from None
    finally:
        client.close()
    typer.echo(
        f"run {spec_run_id} HALTED at round {halted['round']} (ledger entry {halted['index']}): "
        f"{halted['reason']}"
    )


def main() -> None:
    """The entry point: an error from the input that no command turned into a message
    still ends in one line and exit code 2 (with --debug, after its traceback)."""
    try:
        app()
    except Exception as e:
        from covey.errors import user_message

        message = user_message(e)
        if message is None:
            raise
        if DEBUG:
            import traceback

            traceback.print_exc()
        typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
