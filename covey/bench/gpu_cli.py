"""`covey bench gpu` (covey/bench/gpu.py): registered on the bench sub-app by covey/cli/__init__.py.
Arguments are parsed before torch is imported, so --help is instant."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from covey.bench.say import LOG_JSON, bench_say


def register(bench_app: typer.Typer) -> None:
    bench_app.command("gpu")(bench_gpu)


def bench_gpu(
    model: Annotated[
        str, typer.Option(help="covey preset; a Llama of its shape is measured too")
    ] = "covey:gpt2",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps")] = "auto",
    precision: Annotated[str, typer.Option(help="auto (bf16 on CUDA), fp32, bf16")] = "auto",
    batch_size: Annotated[int, typer.Option(min=1, help="sequences per step")] = 8,
    seq_len: Annotated[int, typer.Option(min=2, help="tokens per sequence (<= context)")] = 1024,
    steps: Annotated[int, typer.Option(min=1, help="timed steps per block")] = 10,
    blocks: Annotated[int, typer.Option(min=2, help="timed blocks per side, alternating")] = 4,
    inner_steps: Annotated[
        int, typer.Option("--inner-steps", "-H", min=1, help="H: inner steps per round")
    ] = 50,
    compile: Annotated[bool, typer.Option(help="torch.compile covey's forward pass")] = False,
    llama: Annotated[bool, typer.Option(help="also measure the Llama of the same shape")] = True,
    peak_tflops: Annotated[
        float | None, typer.Option(help="device peak for MFU (default: known GPUs' bf16)")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the result here")] = None,
    log_json: Annotated[bool, LOG_JSON] = False,
) -> None:
    """A peer's throughput on its own device: covey's inner step vs a bare PyTorch loop
    (tokens/s, MFU), DiLoCo's overhead per round, codec encode/decode ms per MB, for a covey
    GPT preset and a Hugging Face Llama of its shape. On a CPU: --model covey:micro."""
    say = bench_say(log_json, "gpu")
    from covey.bench.gpu import GOAL_MFU, GOAL_OVERHEAD_PCT, run_gpu_bench
    from covey.devices import DeviceError

    try:
        r = run_gpu_bench(
            model=model, device=device, precision=precision, batch_size=batch_size,
            seq_len=seq_len, steps=steps, blocks=blocks, inner_steps=inner_steps,
            compile=compile, llama=llama, peak_tflops=peak_tflops, echo=say,
        )  # fmt: skip
    except (DeviceError, ValueError) as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    say(f"{r['device']}, {r['precision']}{', compiled' if compile else ''}:")
    for m in r["models"]:
        mfu = "" if m["covey_mfu"] is None else f", MFU {m['covey_mfu']:.1%}"
        say(
            f"  {m['model']}: bare {m['bare_tokens_per_s']:,.0f} tokens/s, covey "
            f"{m['covey_tokens_per_s']:,.0f}{mfu}; overhead {m['overhead_pct']:+.1f}% (goal "
            f"{GOAL_OVERHEAD_PCT}%); round overhead {m['round_overhead_s']:.3f} s "
            f"({m['round_overhead_pct_of_h_steps']:.1f}% of H={m['inner_steps']} steps)"
        )
    if r["mfu_note"]:
        say(f"  {r['mfu_note']} (goal {GOAL_MFU:.0%} on an H100)")
    for c in r["codecs"]:
        say(
            f"  codec {c['codec']}: encode {c['encode_ms_per_mb']:.2f} ms/MB, decode "
            f"{c['decode_ms_per_mb']:.2f} ms/MB ({c['payload_bytes']:,} B for {c['mb']:.1f} MB)"
        )
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(r, indent=1) + "\n")
        say(f"wrote {json_path}")
