"""`covey bench swarm` and `covey bench swarm-codecs`: the commands (covey.bench.swarm and
covey.bench.swarm_codecs run them). Only typer is imported here, so `--help` is instant."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from covey.bench.say import LOG_JSON, bench_say


def register(bench_app: Any) -> None:
    """Add `covey bench swarm` and `covey bench swarm-codecs` to the bench sub-app."""

    @bench_app.command("swarm")
    def bench_swarm(
        quick: Annotated[bool, typer.Option(help="60 s per run: all four in ~10 min")] = False,
        seconds: Annotated[
            float | None, typer.Option(help="training seconds per run (default 60 quick, 180)")
        ] = None,
        kill_every: Annotated[
            float, typer.Option(help="heterogeneous-churn: SIGKILL a server this often")
        ] = 30.0,
        emulate_s: Annotated[
            float, typer.Option(help="emulated seconds per request at 1x speed")
        ] = 0.2,
        json_path: Annotated[Path | None, typer.Option("--json", help="write the rows")] = None,
        plot_path: Annotated[Path | None, typer.Option("--plot", help="write a PNG")] = None,
        inflight: Annotated[
            int | None,
            typer.Option(
                help="microbatches in flight, both modes (fixed: split per pipeline) "
                "[default: the SWARM trainer's, 2 per server]"
            ),
        ] = None,
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """SWARM vs a fixed GPipe-style pipeline on the same 4 servers (2 stages), emulated
        speeds: homogeneous, and heterogeneous (1x-4x) with a server SIGKILLed every
        --kill-every s. Prints samples/s, loss, reroutes, rebalances, the decentralization
        multiplier, bytes between stages."""
        say = bench_say(log_json, "swarm")
        from covey.bench.swarm import SCENARIOS, run_swarm_bench

        if (
            (seconds is not None and seconds <= 0)
            or kill_every <= 0
            or emulate_s < 0
            or (inflight is not None and inflight < 1)
        ):
            typer.echo(
                "error: --seconds and --kill-every must be > 0, --emulate-s >= 0, --inflight >= 1",
                err=True,
            )
            raise typer.Exit(2)
        rows = run_swarm_bench(
            quick=quick, seconds=seconds, kill_every=kill_every, emulate_s=emulate_s,
            json_path=json_path, plot_path=plot_path, echo=say, inflight=inflight,
        )  # fmt: skip
        for scenario in SCENARIOS:
            by = {r["mode"]: r for r in rows if r["scenario"] == scenario}
            ratio = by["swarm"]["samples_per_s"] / max(by["fixed"]["samples_per_s"], 1e-9)
            say(
                f"{scenario}: swarm {by['swarm']['samples_per_s']:.2f} samples/s, fixed "
                f"{by['fixed']['samples_per_s']:.2f} samples/s (x{ratio:.2f}); loss "
                f"{by['swarm']['final_loss']} vs {by['fixed']['final_loss']}; reroutes "
                f"{by['swarm']['reroutes']}, rebalances {by['swarm']['rebalances']}; "
                f"multiplier {by['swarm']['multiplier']} vs {by['fixed']['multiplier']}"
            )

    @bench_app.command("swarm-codecs")
    def bench_swarm_codecs(
        microbatches: Annotated[
            int, typer.Option(help="training microbatches per codec (same tokens for each)")
        ] = 600,
        seeds: Annotated[int, typer.Option(help="runs per codec (weights, basis, batches)")] = 3,
        codec: Annotated[
            list[str] | None,
            typer.Option(help="plain, int8 or subspace:RANK (repeat; default: all five)"),
        ] = None,
        json_path: Annotated[Path | None, typer.Option("--json", help="write the rows")] = None,
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """Bytes between stages per microbatch (over HTTP) and held-out loss after the same
        tokens, for fp32, 8-bit and subspace (ranks 4, 8, 16) activations between stages."""
        say = bench_say(log_json, "swarm-codecs")
        from covey.bench.swarm_codecs import CODECS, run_codecs

        chosen = tuple(codec or CODECS)
        bad = [
            c
            for c in chosen
            if not (c in ("plain", "int8") or (c.startswith("subspace:") and c[9:].isdigit()))
        ]
        if bad:
            typer.echo(
                f"error: --codec {bad[0]!r}: expected plain, int8 or subspace:RANK", err=True
            )
            raise typer.Exit(2)
        if microbatches < 50 or seeds < 1:
            typer.echo(
                f"error: --microbatches ({microbatches}) must be >= 50, --seeds ({seeds}) >= 1",
                err=True,
            )
            raise typer.Exit(2)
        rows = run_codecs(microbatches, seeds, json_path, say, chosen)
        for r in rows:
            say(
                f"{r['codec']:>12}: {r['bytes_per_microbatch_http']:>7} bytes/microbatch, "
                f"held-out loss {r['held_out_loss']:.4f} ({100 * r['held_out_vs_plain']:+.2f}%; "
                f"per seed {r['held_out_loss_per_seed']})"
            )

    @bench_app.command("swarm-liars")
    def bench_swarm_liars(
        trials: Annotated[int, typer.Option(min=1, help="runs, each until the liar's ban")] = 5,
        verify_rate: Annotated[
            float, typer.Option(help="share of hops duplicated on a second server")
        ] = 0.1,
        seconds: Annotated[float, typer.Option(help="give up on a trial after this long")] = 180,
        json_path: Annotated[Path | None, typer.Option("--json", help="write the rows")] = None,
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """A stage server that answers 1 request in 5 slightly wrong (1.4x the tolerance),
        beside an honest one: per trial, the microbatches, checks and lies until the referee
        convicts and bans it, and whether `covey ledger verify --recompute` recomputes it."""
        say = bench_say(log_json, "swarm-liars")
        if not 0 < verify_rate <= 1 or seconds <= 0:
            typer.echo("error: --verify-rate must be in (0, 1], --seconds > 0", err=True)
            raise typer.Exit(2)
        from covey.bench.swarm_liars import run_swarm_liars_bench

        run_swarm_liars_bench(trials, verify_rate, seconds, json_path, say)
