"""`covey rl sft`: the command that teaches a policy the task's format before RL (torch
loads late). `register_sft(rl_app)` adds `sft` to the `covey rl` group (`covey bench rl` is
covey.bench.rl_cli's). Only typer is imported here, so `--help` is instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def register_sft(rl_app: typer.Typer) -> None:
    """Add `covey rl sft` to the rl command group."""

    @rl_app.command("sft")
    def sft_command(
        out: Annotated[Path, typer.Option(help="policy directory to write (created)")],
        steps: Annotated[int, typer.Option(min=1, help="optimizer steps (batches of 64)")] = 500,
        minutes: Annotated[
            float | None, typer.Option(min=0.01, help="stop early after this many minutes")
        ] = None,
        max_operand: Annotated[
            int, typer.Option(min=1, help="arithmetic task: a+b with 0 <= a, b <= this")
        ] = 99,
        model: Annotated[
            str, typer.Option(help="'rl' (0.36M params, the default) or a covey GPT preset")
        ] = "rl",
        lr: Annotated[float, typer.Option(min=1e-6, help="AdamW learning rate")] = 3e-3,
        seed: Annotated[int, typer.Option(help="seeds the init and the batches")] = 0,
        threads: Annotated[int, typer.Option(min=1, help="torch threads")] = 1,
        hf: Annotated[
            bool, typer.Option(help="also write the Hugging Face form (hf:DIR, covey generate)")
        ] = True,
    ) -> None:
        """Teach a small byte-level covey GPT the arithmetic answer format ("12+7=" ->
        "19\\n") on CPU before RL, and write a policy directory (policy.json +
        policy.safetensors, and a Hugging Face copy) for `covey rl trainer --policy`.
        Deterministic for a seed on one machine; prints held-out pass@1 at the end."""
        import json

        import torch

        from covey.rl.sft import sft
        from covey.rl.tasks import ArithmeticTask, TaskError

        if (out / "policy.json").exists():
            raise _fail(f"{out} holds a policy already; give another --out")
        if model != "rl":
            from covey.models.gpt import GPT_SIZES

            if model not in GPT_SIZES:
                raise _fail(f"unknown model {model!r}; choose 'rl' or one of {sorted(GPT_SIZES)}")
        torch.set_num_threads(threads)
        try:
            task = ArithmeticTask(seed=seed, max_operand=max_operand)
            d = sft(task, out, steps=steps, minutes=minutes, seed=seed, model=model, lr=lr,
                    hf=hf, progress=True)  # fmt: skip
        except (TaskError, ValueError) as e:
            raise _fail(str(e)) from None
        doc = json.loads((d / "policy.json").read_text())
        typer.echo(
            f"wrote {d}: {doc['sft_steps']} steps, loss {doc['sft_loss']:.3f}, held-out "
            f"pass@1 {100 * doc.get('pass_at_1', float('nan')):.1f}%"
        )
