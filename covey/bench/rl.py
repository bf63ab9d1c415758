"""`covey bench rl`: does RL learn, and what does verifying it cost.

Learning: a short SFT gives a small covey GPT the arithmetic answer format (`covey.rl.sft`),
then GRPO (`covey.rl.learn.Learner`) trains it on rollouts made exactly as a worker makes
them: seeded Gumbel sampling (`covey.rl.sampling.generate`), prompts assigned by
`tasks.assigned_prompts`, rewards by the task, in the `RolloutBatch` format, all in one
process. Held-out pass@1 (greedy, prompts never trained on) is measured every few steps;
the goal is +25 points over the SFT start within 20 CPU minutes. Proofs are not
built here (proof cost belongs to the verification section), so `Sample.proof` is empty.

`lag` > 0 makes every batch come from the policy `lag` versions old, as an asynchronous
trainer sees them (async_level); the importance ratio corrects for it.

Verification: `covey.bench.rl_verify.run`, when that module exists.
"""

from __future__ import annotations

import copy
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from covey.rl import sampling
from covey.rl.batch import (
    RolloutBatch,
    RolloutSpec,
    Sample,
    byte_decode,
    byte_encode,
    completion_text,
)
from covey.rl.learn import ANSWER_EOS, DEFAULT_LR, LearnConfig, Learner, pass_at_1
from covey.rl.loss import LossConfig
from covey.rl.tasks import ArithmeticTask, Task, assigned_prompts

GOAL_POINTS = 25.0  # pass@1 gain over the SFT start, in percentage points
GOAL_MINUTES = 20.0


@dataclass(frozen=True)
class LearningConfig:
    """One learning run: task, SFT warm-up, GRPO settings, evaluation."""

    max_operand: int = 99
    sft_steps: int = 500  # ~15-20% held-out pass@1: the format, often the wrong sum
    rl_steps: int = 1000  # in practice the RL phase ends at `minutes`
    minutes: float = 19.0  # the RL phase stops here (goal: within 20 minutes)
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 0.6  # T=1 samples are mostly wrong; 0.6 keeps G samples diverse
    max_new_tokens: int = 6
    lr: float = DEFAULT_LR  # 2e-4; why in covey.rl.learn (the demo and RLSpec share it)
    epochs: int = 1  # optimizer steps per batch (LearnConfig.epochs)
    lag: int = 0  # batches come from the policy this many versions old
    async_level: int = 2
    eval_every: int = 20
    eval_prompts: int = 400
    seed: int = 0
    threads: int = 1


def honest_batch(
    policy: nn.Module,
    task: Task,
    spec: RolloutSpec,
    *,
    step: int,
    worker_id: str,
    policy_version: int,
    encode: Callable[[str], list[int]] = byte_encode,
    decode: Callable[[list[int]], str] = byte_decode,
) -> RolloutBatch:
    """What an honest worker submits (`covey.rl.batch.rollout`), without proofs: all
    samples generated together by `sampling.generate_batch` (seeded per sample)."""
    indices = assigned_prompts(
        spec.run_id, step, worker_id, spec.prompts_per_step, num_prompts=len(task)
    )
    jobs = [(p, j) for p in indices for j in range(spec.group_size)]
    prompts = {p: encode(task.prompt(p)) for p in set(indices)}
    gens = sampling.generate_batch(
        policy,
        [prompts[p] for p, _ in jobs],
        spec.max_new_tokens,
        spec.temperature,
        [sampling.sample_seed(spec.run_id, step, worker_id, p, j) for p, j in jobs],
        spec.eos_id,
    )
    samples = [
        Sample(
            tokens=gen.tokens,
            logprobs=gen.logprobs.tolist(),
            reward=task.reward(p, completion_text(gen.tokens, spec.eos_id, decode)),
            proof="",
        )
        for (p, _), gen in zip(jobs, gens, strict=True)
    ]
    return RolloutBatch(
        run_id=spec.run_id,
        step=step,
        policy_version=policy_version,
        policy_cid=f"v{policy_version}",
        worker_id=worker_id,
        prompt_indices=indices,
        group_size=spec.group_size,
        samples=samples,
    )


def learning_run(
    cfg: LearningConfig,
    work_dir: Path,
    echo: Callable[[str], None] = print,
    policy_dir: Path | str | None = None,
) -> dict[str, Any]:
    """SFT (unless `policy_dir` holds a policy already: a `covey rl sft` directory, or
    `hf:DIR`, a Hugging Face causal LM with its own tokenizer), then GRPO for cfg.rl_steps
    steps or cfg.minutes, whichever ends first. Returns the curve [(step, minutes,
    pass@1)], start/end pass@1, the goal verdict and the settings."""
    from covey.rl import policy as pol
    from covey.rl.hf_policy import hf_newline_id, is_hf
    from covey.rl.sft import sft

    torch.set_num_threads(cfg.threads)
    task = ArithmeticTask(seed=cfg.seed, max_operand=cfg.max_operand)
    t0 = time.monotonic()
    if policy_dir is None:
        echo(f"sft: {cfg.sft_steps} steps on {task.name} (max operand {cfg.max_operand})")
        policy_dir = sft(task, work_dir / "sft", steps=cfg.sft_steps, seed=cfg.seed, hf=False)
    sft_minutes = (time.monotonic() - t0) / 60
    model_cfg, policy = pol.load_policy_dir(policy_dir)
    codec = pol.codec_kwargs(model_cfg)  # bytes for covey GPT, tokenizer.json for hf:
    spec = RolloutSpec(
        run_id="bench-rl",
        prompts_per_step=cfg.prompts_per_step,
        group_size=cfg.group_size,
        temperature=cfg.temperature,
        max_new_tokens=cfg.max_new_tokens,
        vocab_size=int(model_cfg["vocab_size"]),
        eos_id=hf_newline_id(model_cfg) if is_hf(model_cfg) else ANSWER_EOS,
    )
    learn_cfg = LearnConfig(
        lr=cfg.lr,
        temperature=cfg.temperature,
        async_level=cfg.async_level,
        epochs=cfg.epochs,
        loss=LossConfig(max_tokens=cfg.max_new_tokens),
    )
    learner = Learner(policy, learn_cfg, task, encode=codec["encode"])
    old: deque[dict[str, torch.Tensor]] = deque(maxlen=cfg.lag + 1)
    actor = copy.deepcopy(policy) if cfg.lag else policy

    def evaluate() -> float:
        return pass_at_1(
            policy,
            task,
            cfg.eval_prompts,
            max_new_tokens=cfg.max_new_tokens,
            eos_id=spec.eos_id,
            **codec,
        )

    start = evaluate()
    curve: list[tuple[int, float, float]] = [(0, 0.0, start)]
    rewards: list[float] = []
    echo(f"rl: pass@1 at the SFT start {100 * start:.1f}%")
    t_rl = time.monotonic()
    version = 0
    while version < cfg.rl_steps and time.monotonic() - t_rl < 60 * cfg.minutes:
        old.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
        made_by = max(0, version - cfg.lag)
        if cfg.lag:
            actor.load_state_dict(old[0])
        batch = honest_batch(
            actor, task, spec, step=version, worker_id="bench", policy_version=made_by, **codec
        )
        stats = learner.step([(batch, made_by)], version)
        rewards.append(stats["reward_mean"])
        version += 1
        if version % cfg.eval_every == 0 or version == cfg.rl_steps:
            minutes = (time.monotonic() - t_rl) / 60
            p = evaluate()
            curve.append((version, minutes, p))
            recent = sum(rewards[-cfg.eval_every :]) / len(rewards[-cfg.eval_every :])
            echo(
                f"rl step {version}: pass@1 {100 * p:.1f}% reward {recent:.3f} "
                f"clip {stats.get('clip_fraction', 0):.3f} [{minutes:.1f} min]"
            )
    if curve[-1][0] != version:
        curve.append((version, (time.monotonic() - t_rl) / 60, evaluate()))
    end = curve[-1][2]
    best = max(p for _, _, p in curve)
    rl_minutes = curve[-1][1]
    gain = 100 * (end - start)
    return {
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in policy.parameters()),
        "sft_minutes": sft_minutes,
        "rl_minutes": rl_minutes,
        "rl_steps": version,
        "pass_at_1_start": start,
        "pass_at_1_end": end,
        "pass_at_1_best": best,
        "gain_points": gain,
        "goal_points": GOAL_POINTS,
        "goal_minutes": GOAL_MINUTES,
        "met": gain >= GOAL_POINTS and rl_minutes <= GOAL_MINUTES,
        "curve": [{"step": s, "minutes": m, "pass_at_1": p} for s, m, p in curve],
        "reward_per_step": rewards,
    }


QUICK = LearningConfig(
    max_operand=19, sft_steps=60, rl_steps=6, minutes=2.0, prompts_per_step=4, eval_every=3,
    eval_prompts=40,
)  # fmt: skip


def plot_curve(path: Path, result: dict[str, Any]) -> bool:
    """pass@1 against RL step (and minutes, top axis label) as a PNG; False without
    matplotlib."""
    from covey.sim.report import pyplot

    if (plt := pyplot()) is None:
        return False
    curve = result["curve"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([c["step"] for c in curve], [100 * c["pass_at_1"] for c in curve], marker=".")
    start = 100 * result["pass_at_1_start"]
    ax.axhline(start, color="grey", linestyle=":", label=f"SFT start {start:.1f}%")
    ax.axhline(start + GOAL_POINTS, color="green", linestyle="--", label=f"goal +{GOAL_POINTS:g}")
    cfg = result["config"]
    ax.set_xlabel(f"GRPO step ({cfg['prompts_per_step']} prompts x G={cfg['group_size']}; "
                  f"{result['rl_minutes']:.1f} min in all)")  # fmt: skip
    ax.set_ylabel("held-out pass@1 (%, greedy)")
    ax.set_title(f"covey bench rl: {result['parameters']:,}-param GPT, a+b with a,b <= "
                 f"{cfg['max_operand']}")  # fmt: skip
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_bench(
    quick: bool,
    work_dir: Path,
    *,
    json_path: Path | None = None,
    verify: bool = True,
    cfg: LearningConfig | None = None,
    policy_dir: Path | str | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The learning section (and the verification section, when `verify` and
    covey.bench.rl_verify exists). Writes `json_path` and the curve as a PNG next to it
    (same name, .png). Restores torch's thread count."""
    cfg = cfg or (QUICK if quick else LearningConfig())
    before = torch.get_num_threads()

    def write(result: dict[str, Any]) -> None:
        if json_path is None:
            return
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        png = json_path.with_suffix(".png")
        if "plot" not in result and plot_curve(png, result["learning"]):
            result["plot"] = str(png)

    try:
        result: dict[str, Any] = {"learning": learning_run(cfg, work_dir, echo, policy_dir)}
        write(result)  # the learning result is kept even if verification fails
        if verify:
            try:
                from covey.bench import rl_verify
            except ImportError:
                result["verification"] = None
                echo("verification: covey.bench.rl_verify is not available; skipped")
            else:
                rows = rl_verify.run(quick, progress=echo)
                result["verification"] = {"summary": rl_verify.summary(rows), "rows": rows}
            write(result)
    finally:
        torch.set_num_threads(before)
    return result
