"""`covey bench agreement`: the command; the measurement is covey.bench.agreement (imported
when the command runs, so `covey --help` does not import torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from covey.bench.say import LOG_JSON, bench_say


def register(bench_app: Any) -> None:
    """Add `covey bench agreement` to the bench sub-app."""

    @bench_app.command("agreement")
    def bench_agreement(
        quick: Annotated[
            bool, typer.Option(help="a toy size (2 workers, 2 rounds of 2 steps): seconds")
        ] = False,
        from_dir: Annotated[
            Path | None,
            typer.Option(
                "--from",
                help="a `covey bench comms --long --out` directory: reuse its warm start and "
                "the method's simulation (run here when it is not there)",
            ),
        ] = None,
        out: Annotated[
            Path, typer.Option(help="directory for the network run, plot and anything simulated")
        ] = Path("runs/bench-agreement"),
        json_path: Annotated[
            Path | None, typer.Option("--json", help="write the rows here")
        ] = None,
        method: Annotated[
            str | None,
            typer.Option(help="a `covey bench comms --long` method; default diloco-h<H>-int4-ef"),
        ] = None,
        steps: Annotated[int | None, typer.Option(help="override inner steps per worker")] = None,
        workers: Annotated[int | None, typer.Option(help="override the workers")] = None,
        batch_size: Annotated[
            int | None, typer.Option(help="override sequences/worker/step")
        ] = None,
        inner_steps: Annotated[
            int | None, typer.Option("--inner-steps", "-H", help="override H")
        ] = None,
        pretrain_steps: Annotated[
            int | None, typer.Option(help="override the warm-up's DDP steps")
        ] = None,
        timeout_min: Annotated[
            float, typer.Option(min=0.1, help="give up on the network run after this long")
        ] = 120.0,
        progress: Annotated[bool, typer.Option(help="show progress bars")] = True,
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """The simulator and the network agree: the --long preset's method (default DiLoCo
        H=100 int4 + error feedback) in the simulator and over real processes on 127.0.0.1
        from the same warm start, both evaluated on the simulator's validation batches;
        the goal is a tail-mean val loss within 1%."""
        say = bench_say(log_json, "agreement")
        from covey.bench.agreement import agreement_size, pick_method, run_agreement_bench
        from covey.local.cluster import ClusterError

        try:
            size = agreement_size(
                quick, steps=steps, workers=workers, batch_size=batch_size,
                inner_steps=inner_steps, pretrain_steps=pretrain_steps,
            )  # fmt: skip
            pick_method(size, method)
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        if from_dir is not None and not from_dir.is_dir():
            typer.echo(f"error: --from {from_dir}: no such directory", err=True)
            raise typer.Exit(2)
        try:
            rows = run_agreement_bench(size=size, method_name=method, out_dir=out,
                                       from_dir=from_dir, timeout_s=timeout_min * 60,
                                       progress=progress and not log_json)  # fmt: skip
        except (ValueError, ClusterError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        if json_path:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(rows, indent=2) + "\n")
            say(f"wrote {json_path}")
