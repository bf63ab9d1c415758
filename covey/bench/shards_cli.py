"""`covey bench shards`: the command; the measurement is covey.bench.shards (imported when
the command runs, so `covey --help` does not import torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from covey.bench.say import LOG_JSON, bench_say


def register(bench_app: Any) -> None:
    """Add `covey bench shards` to the bench sub-app."""

    @bench_app.command("shards")
    def bench_shards(
        peers: Annotated[str, typer.Option(help="peer counts, comma-separated")] = "4,8,16,32",
        model: Annotated[str, typer.Option(help="covey GPT size of the contributions")] = "micro",
        shards: Annotated[int, typer.Option(min=1, help="shards of the parameter space")] = 16,
        json_path: Annotated[
            Path | None, typer.Option("--json", help="write the rows here")
        ] = None,
        liar: Annotated[
            str | None,
            typer.Option(help="one aggregator lies (drop|noise): measure its catch per round"),
        ] = None,
        trials: Annotated[int, typer.Option(min=1, help="rounds per peer count with --liar")] = 10,
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """Gather vs sharded aggregation, one DiLoCo round per peer count and path, on
        127.0.0.1: seconds to the certificate and to a worker holding the new state, bytes a
        worker downloads, bytes the aggregators read: where the two paths cross over. With
        --liar, sharded rounds with one lying aggregator of three: how often it is caught
        per round, in the round or by the late check after it, and the rounds whose
        certified state holds its lies."""
        bench_say(log_json, "shards")
        try:
            counts = [int(x) for x in peers.split(",") if x.strip()]
        except ValueError:
            counts = []
        if not counts or min(counts) < 2:
            typer.echo(f"error: --peers {peers!r}: give peer counts >= 2, e.g. 4,8,16", err=True)
            raise typer.Exit(2)
        if liar is not None and liar not in ("drop", "noise"):
            typer.echo(f"error: --liar {liar!r}: drop or noise", err=True)
            raise typer.Exit(2)
        from covey.bench.shards import run_shards_bench  # torch: only when it runs

        run_shards_bench(counts, model, shards, json_path, liar, trials)
