"""`covey bench hostsync`: the command; the measurement is covey.bench.hostsync (imported
when the command runs, so `covey --help` does not import torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from covey.bench.say import LOG_JSON, bench_say


def register(bench_app: Any) -> None:
    """Add `covey bench hostsync` to the bench sub-app."""

    @bench_app.command("hostsync")
    def bench_hostsync(
        model: Annotated[str, typer.Option(help="covey GPT size: nano micro mini small")] = "micro",
        steps: Annotated[int, typer.Option(min=1, help="inner steps timed per method")] = 12,
        commit_params: Annotated[
            int, typer.Option(min=1, help="parameters of the state a commitment is timed on")
        ] = 4 << 20,
        workers: Annotated[
            int, typer.Option(min=1, help="payloads in the round result that is timed")
        ] = 8,
        json_path: Annotated[
            Path | None, typer.Option("--json", help="write the rows here")
        ] = None,
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """Per method (DDP, DiLoCo, Streaming DiLoCo, DeMo): host milliseconds per inner
        step per 1M parameters on this machine's CPU, and the device-to-host
        synchronizations one inner step makes (counted on the meta device); then host
        milliseconds per 1M parameters and host bytes (counted on the meta device) of an
        intermediate commitment (sketches of parameters and AdamW moments), and of one with
        the state's hash, as every commitment carried before; then host milliseconds per 1M
        parameters of a DiLoCo round result (decode and aggregate --workers payloads, outer
        step, state digest) on the host path and on the device path run in torch on the
        CPU, which must give the same state."""
        say = bench_say(log_json, "hostsync")
        from covey.bench.hostsync import run_hostsync_bench  # torch: only when it runs
        from covey.models.gpt import GPT_SIZES

        if model not in GPT_SIZES:
            typer.echo(f"error: --model {model!r}: choose from {sorted(GPT_SIZES)}", err=True)
            raise typer.Exit(2)
        rows = run_hostsync_bench(model, steps)
        for r in rows:
            say(
                f"{r['method']:>10}: {r['host_ms_per_step_per_m']:8.3f} host ms/step/1M params "
                f"(fastest {r['fastest_ms_per_step_per_m']:.3f}; {r['parameters_m']}M), "
                f"{r['syncs_per_step']:.2f} syncs/step"
            )
        from covey.bench.hostsync import time_commitment

        c = time_commitment(commit_params)
        say(
            f"intermediate commitment: {c['ms_per_m']:8.3f} host ms/1M params, "
            f"{c['host_bytes']} host bytes (the commitment: {c['commitment_bytes']}); with the "
            f"state's hash, as before: {c['before_ms_per_m']:.3f} ms/1M params (hash "
            f"{c['hash_ms_per_m']:.3f}), {c['before_host_bytes']} host bytes (first "
            f"{c['first_ms_per_m']:.3f}, tables made; {c['parameters_m']}M params + 2 moments)"
        )
        from covey.bench.hostsync import time_round_result

        results = []
        for device_path in (False, True):
            r = time_round_result(commit_params, workers, device_path=device_path)
            results.append(r)
            say(
                f"round result, {r['path']}: {r['ms_per_m']:8.3f} host ms/1M params for "
                f"{workers} {r['codec']} payloads: decode + {r['aggregation']} "
                f"{r['aggregate_ms_per_m']:.3f}, outer step {r['outer_ms_per_m']:.3f}, state "
                f"digest {r['hash_ms_per_m']:.3f}"
            )
        same = results[0]["digest"] == results[1]["digest"]
        say(f"round result: both paths' new states {'hash alike' if same else 'DIFFER'}")
        if not same:
            raise typer.Exit(1)
        if json_path:
            rows_out = {"methods": rows, "commitment": c, "round_result": results}
            json_path.write_text(json.dumps(rows_out, indent=1) + "\n")

    @bench_app.command("roundpath")
    def bench_roundpath(
        model: Annotated[
            str, typer.Option(help="covey GPT size whose parameter count the state has")
        ] = "gpt2",
        workers: Annotated[int, typer.Option(min=1, help="payloads in the round result")] = 8,
        repeats: Annotated[int, typer.Option(min=1, help="timed repeats (the fastest)")] = 1,
        inner_steps: Annotated[int, typer.Option(min=1, help="H, for the round's share")] = 100,
        step_s: Annotated[
            float | None,
            typer.Option(min=0, help="seconds per inner step (e.g. from `covey bench gpu`)"),
        ] = None,
        json_path: Annotated[Path | None, typer.Option("--json", help="write the row here")] = None,
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """What a worker's training thread waits for between a plain DiLoCo round's
        certificate and the next round's first inner step, on this machine's CPU: before
        (decode and aggregate --workers payloads, outer step, the state's SHA-256, its
        serialization for joiners) and after the hash check and the serving moved behind
        the next round (covey.peer.pending_check); with --step-s, the share of a round of
        --inner-steps steps that each is."""
        say = bench_say(log_json, "roundpath")
        from covey.bench.round_path import preset_params, round_fraction, time_round_path
        from covey.models.gpt import GPT_SIZES

        if model not in GPT_SIZES:
            typer.echo(f"error: --model {model!r}: choose from {sorted(GPT_SIZES)}", err=True)
            raise typer.Exit(2)
        r = time_round_path(preset_params(model), workers, repeats)
        say(
            f"round result at {r['parameters_m']}M params, {workers} {r['codec']} payloads, "
            f"{r['aggregation']}: before {r['before_s']:.3f} s on the training thread "
            f"(decode + aggregate + outer step {r['apply_s']:.3f}, digest {r['digest_s']:.3f}, "
            f"serve {r['serve_s']:.3f}); after {r['after_s']:.3f} s (starting the check "
            f"{r['start_check_s']:.4f}), the check {r['behind_s']:.3f} s behind the next round"
        )
        say(
            f"per 1M params: apply {r['apply_ms_per_m']:.2f} ms, digest "
            f"{r['digest_ms_per_m']:.2f} ms, serve {r['serve_ms_per_m']:.2f} ms"
        )
        if step_s is not None:
            for when in ("before", "after"):
                share = round_fraction(r[f"{when}_s"], inner_steps, step_s)
                r[f"{when}_share"] = round(share, 5)
                say(f"{when}: {100 * share:.2f}% of a round of {inner_steps} x {step_s} s steps")
        if json_path:
            json_path.write_text(json.dumps(r, indent=1) + "\n")
