"""`covey demo`: a coordinator, workers and validators as processes on this machine."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from covey.cli.common import (
    DEVICE_HELP,
    LOG_JSON,
    LOG_TO,
    METHODS,
    SET,
    WANDB_PROJECT,
    check_device,
    check_tracker,
    fail,
    guard,
    setup_logs,
    track,
)
from covey.cli.root import app
from covey.errors import UserError, check_data_paths


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
    house_workers: Annotated[
        int,
        typer.Option(
            min=0,
            help="of the honest workers, how many are the run owner's house workers, whose "
            "canaries test the validators (docs/trust.md); 0: none, the validators go "
            "unchecked (always 0 without validators, and one plain worker is kept)",
        ),
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
    and the validators catch them; one honest worker is the run owner's house worker, whose
    canaries test the validators (--house-workers). Ctrl-C stops every process and still
    writes what was committed."""
    from covey.local.cluster import ClusterError
    from covey.local.demo import METHODS as DEMO_METHODS
    from covey.local.demo import run_local_demo

    if algorithm not in DEMO_METHODS:
        raise fail(f"--algorithm must be one of {METHODS}, got {algorithm!r}")
    if adversaries > workers:
        raise fail(f"--adversaries ({adversaries}) cannot exceed --workers ({workers})")
    check_device(device)
    from covey.guards import lock_dir
    from covey.spec import parse_sets

    guard(lambda: check_data_paths(data or ()))
    try:
        extra = parse_sets(set_ or ())
    except UserError as e:
        raise fail(str(e)) from None
    out = out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    setup_logs(False, "demo", log_json)  # --log-json reaches the children through the env
    check_tracker(log)
    guard(lambda: lock_dir(out, "covey demo"))  # one run per --out
    try:
        summary = run_local_demo(
            workers=workers,
            minutes=minutes,
            algorithm=algorithm,
            chaos=chaos,
            adversaries=adversaries,
            validators=validators,
            house_workers=house_workers,
            out_dir=out,
            model=model,
            seed=seed,
            progress=progress and not log_json,
            tokenizer=tokenizer,
            data=tuple(data or ()),
            rounds=rounds,
            inner_steps=inner_steps,
            batch_size=batch_size,
            seq_len=seq_len,
            device=device,
            text_column=text_column,
            overrides=extra,
            json_lines=log_json,
        )
    except UserError as e:
        raise fail(str(e)) from None
    except ValueError as e:  # data, model or tokenizer that do not fit: before any process
        hint = " (--text-column names the data's text column)" if "column" in str(e) else ""
        raise fail(f"{e}{hint}") from None
    except ClusterError as e:
        raise fail(f"{e}\n(all logs: {out / 'logs'})") from None
    except KeyboardInterrupt:  # before training started: the children are already stopped
        raise typer.Exit(130) from None
    if log and (out / "metrics.jsonl").exists():
        lines = (out / "metrics.jsonl").read_text().splitlines()
        config = {"algorithm": algorithm, "model": model}
        track(log, out, out.name, config, map(json.loads, lines), wandb_project)
    if summary["interrupted"]:
        raise typer.Exit(130)
