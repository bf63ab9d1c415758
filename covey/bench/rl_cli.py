"""`covey bench rl`: does RL learn, and what does checking it cost (covey.bench.rl runs
it; torch loads late). `register(bench_app)` adds `rl` to `covey bench`. Only typer is
imported here, so `--help` is instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from covey.bench.say import LOG_JSON, bench_say


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def register(bench_app: typer.Typer) -> None:
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
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """Does RL learn, and what does checking it cost: SFT then GRPO on held-out
        arithmetic (pass@1 curve, start/end, minutes; goal +25 points within 20 CPU
        minutes), plus honest false rejections, cheats caught, validator cost share, proof
        bytes and rollout throughput from the verification bench."""
        say = bench_say(log_json, "rl")
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
                               policy_dir=policy, echo=say)  # fmt: skip
        r = result["learning"]
        verdict = "goal met" if r["met"] else "goal MISSED"
        if quick and not r["met"]:
            verdict = "quick run, too short for the goal"
        say(
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
            say(
                f"verification: {s.get('honest_rejected')}/{s.get('honest_rollouts')} honest "
                f"rejected, {s.get('cheats_missed')} cheats missed over {s.get('cheat_kinds')} "
                f"kinds x {s.get('min_tries')}+ tries, validator share "
                f"{100 * s.get('validator_share', float('nan')):.1f}% of generation, proof "
                f"{s.get('proof_bytes_per_full_chunk')} B per 32 tokens, {rate:.1f} rollouts/s"
            )
        if json_path:
            say(f"wrote {json_path}" + (f" and {result['plot']}" if "plot" in result else ""))
