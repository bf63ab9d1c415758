"""`covey rl sft` and `covey bench rl`: the commands of RL learning (torch loads late).

`register_sft(rl_app)` adds `sft` to the `covey rl` group; `register_bench(bench_app)` adds
`rl` to `covey bench`. Only typer is imported here, so `--help` is instant.
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


def register_bench(bench_app: typer.Typer) -> None:
    """Add `covey bench rl` to the bench command group."""

    @bench_app.command("rl")
    def bench_rl(
        quick: Annotated[bool, typer.Option(help="a tiny task and a few steps (~1-2 min)")] = False,
        json_path: Annotated[
            Path | None, typer.Option("--json", help="write results here and the curve as .png")
        ] = None,
        policy: Annotated[
            str | None,
            typer.Option(
                help="start from this policy instead of SFT: a covey rl sft directory, or "
                "hf:DIR (a local Hugging Face causal LM: config.json, *.safetensors, "
                "tokenizer.json)"
            ),
        ] = None,
        minutes: Annotated[
            float | None, typer.Option(min=0.1, help="cap on the RL phase's wall time")
        ] = None,
        rl_steps: Annotated[int | None, typer.Option(min=1, help="GRPO steps")] = None,
        lr: Annotated[float | None, typer.Option(min=1e-7, help="GRPO learning rate")] = None,
        lag: Annotated[
            int, typer.Option(min=0, help="train on batches this many policy versions old")
        ] = 0,
        verify: Annotated[
            bool, typer.Option(help="also run the verification section (covey.bench.rl_verify)")
        ] = True,
        seed: Annotated[int, typer.Option(help="seeds SFT, prompts and sampling")] = 0,
    ) -> None:
        """Does RL learn, and what does checking it cost: SFT then GRPO on held-out
        arithmetic (pass@1 curve, start/end, minutes; goal +25 points within 20 CPU
        minutes), plus honest false rejections, cheats caught, validator cost share, proof
        bytes and rollout throughput from the verification bench."""
        import dataclasses
        import tempfile

        from covey.bench.rl import QUICK, LearningConfig, run_bench

        if policy is not None and policy.startswith("hf:"):
            if not (Path(policy[3:]).expanduser() / "config.json").is_file():
                raise _fail(f"--policy {policy}: no config.json there (a Hugging Face model dir)")
        elif policy is not None and not (Path(policy) / "policy.json").is_file():
            raise _fail(f"--policy {policy} has no policy.json (write one with covey rl sft)")
        cfg = QUICK if quick else LearningConfig()
        changes = {"minutes": minutes, "rl_steps": rl_steps, "lr": lr}
        cfg = dataclasses.replace(
            cfg, lag=lag, seed=seed, **{k: v for k, v in changes.items() if v is not None}
        )
        with tempfile.TemporaryDirectory(prefix="covey-bench-rl-") as work:
            result = run_bench(quick, Path(work), json_path=json_path, verify=verify, cfg=cfg,
                               policy_dir=policy, echo=typer.echo)  # fmt: skip
        r = result["learning"]
        verdict = "goal met" if r["met"] else "goal MISSED"
        if quick and not r["met"]:
            verdict = "quick run, too short for the goal"
        typer.echo(
            f"learning: pass@1 {100 * r['pass_at_1_start']:.1f}% -> {100 * r['pass_at_1_end']:.1f}%"
            f" ({r['gain_points']:+.1f} points, best {100 * r['pass_at_1_best']:.1f}%) in "
            f"{r['rl_steps']} steps, {r['rl_minutes']:.1f} min ({verdict}: +{r['goal_points']:g} "
            f"within {r['goal_minutes']:g} min)"
        )
        v = result.get("verification")
        if v:
            s = v["summary"]
            cost = [r for r in v["rows"] if r.get("section") == "cost"]
            rate = max((r.get("rollouts_per_s", 0.0) for r in cost), default=float("nan"))
            typer.echo(
                f"verification: {s.get('honest_rejected')}/{s.get('honest_rollouts')} honest "
                f"rejected, {s.get('cheats_missed')} cheats missed over {s.get('cheat_kinds')} "
                f"kinds x {s.get('min_tries')}+ tries, validator share "
                f"{100 * s.get('validator_share', float('nan')):.1f}% of generation, proof "
                f"{s.get('proof_bytes_per_full_chunk')} B per 32 tokens, {rate:.1f} rollouts/s"
            )
        if json_path:
            typer.echo(
                f"wrote {json_path}" + (f" and {result['plot']}" if "plot" in result else "")
            )
