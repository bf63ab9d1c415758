"""The trainer's learning parts, from R2's covey.rl.learn: a `Learner` configured from the
run's spec, and pass@1 on held-out prompts for the status page."""

from __future__ import annotations

import torch

from covey.rl.learn import LearnConfig, Learner, pass_at_1
from covey.rl.loss import LossConfig
from covey.rl.runspec import RLSpec
from covey.rl.tasks import Task


def make_learner(policy: torch.nn.Module, spec: RLSpec, task: Task) -> Learner:
    """The Learner of the run: its lr, temperature, async_level and token budget."""
    cfg = LearnConfig(
        lr=spec.lr,
        temperature=spec.temperature,
        async_level=spec.async_level,
        loss=LossConfig(max_tokens=spec.max_new_tokens),
    )
    return Learner(policy, cfg, task)


def held_out_pass_at_1(policy: torch.nn.Module, spec: RLSpec, task: Task) -> float | None:
    """Greedy pass@1 on `spec.eval_prompts` held-out prompts; None for a task without a
    held-out split (JSONL prompts)."""
    try:
        return float(
            pass_at_1(
                policy,
                task,
                spec.eval_prompts,
                max_new_tokens=spec.max_new_tokens,
                eos_id=spec.eos_id,
            )
        )
    except TypeError:
        return None
