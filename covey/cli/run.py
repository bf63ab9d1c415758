"""`covey sim`: N simulated workers in one process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from covey.cli.common import (
    DEVICE_HELP,
    LOG_JSON,
    LOG_TO,
    METHODS,
    SET,
    WANDB_PROJECT,
    check_tracker,
    fail,
    guard,
    load_config,
    overrides_of,
    say_to,
    setup_logs,
    track,
)
from covey.cli.root import app
from covey.config import SimConfig


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
    overrides = overrides_of(
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
            raise fail(f"{out}/checkpoint/config.json is damaged ({e}); start again") from None
    cfg: SimConfig = load_config(config, overrides, sets=set_)
    setup_logs(False, "sim", log_json)
    check_tracker(log)
    from covey.guards import lock_dir, prepare_out

    guard(lambda: lock_dir(out, "covey sim"))  # one run per --out
    guard(lambda: prepare_out(out, resume=resume, overwrite=overwrite, command="covey sim"))
    say = say_to(log_json)
    from covey.algorithms.codecs import get_codec
    from covey.sim.report import save_run
    from covey.sim.resume import SnapshotError, load_snapshot, save_snapshot, write_config
    from covey.sim.simulator import simulate

    try:
        get_codec(cfg.algorithm.codec)
    except ValueError as e:
        raise fail(f"algorithm.codec: {e}") from None

    snapshot = None
    if resume:
        try:
            snapshot = load_snapshot(out / "checkpoint", cfg.config_hash())
        except SnapshotError as e:
            raise fail(str(e)) from None
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
        raise fail(str(e)) from None
    plotted = save_run(out, cfg.algorithm.method, result.records, result.summary)
    name = f"sim-{cfg.algorithm.method}"
    track(log, out, name, cfg.model_dump(mode="json"), result.records, wandb_project)
    from covey.io.export import save_sim_run

    save_sim_run(out, cfg, result.state)  # checkpoint, model and tokenizer for covey export
    s = result.summary
    say(
        f"final val loss {s['final_val_loss']:.4f}"
        f" | sent/worker {s['bytes_sent_per_worker']:,.0f} B"
        f" | simulated {s['sim_time_s']:.1f} s | utilization {s['utilization']:.1%}"
    )
    say(f"wrote {out}/metrics.jsonl, summary.json" + (", plot.png" if plotted else ""))
