"""The trainer's learning parts, built on covey.rl.learn: a `Learner` configured from the
run's spec, and pass@1 on held-out prompts for the status page. Both take the run's model
config, whose tokenizer (covey.rl.policy.text_codec) encodes prompts: bytes for covey's
GPT, tokenizer.json for an HF policy."""

from __future__ import annotations

from typing import Any

import torch

from covey.rl.learn import LearnConfig, Learner, pass_at_1
from covey.rl.loss import LossConfig
from covey.rl.policy import text_codec
from covey.rl.runspec import RLSpec
from covey.rl.tasks import Task


def make_learner(
    policy: torch.nn.Module, spec: RLSpec, task: Task, model_cfg: dict[str, Any] | None = None
) -> Learner:
    """The Learner of the run: its lr, temperature, async_level and token budget, and the
    tokenizer of `model_cfg` (bytes when None)."""
    cfg = LearnConfig(
        lr=spec.lr,
        temperature=spec.temperature,
        async_level=spec.async_level,
        loss=LossConfig(max_tokens=spec.max_new_tokens),
    )
    return Learner(policy, cfg, task, encode=text_codec(model_cfg or {})[0])


def held_out_pass_at_1(
    policy: torch.nn.Module, spec: RLSpec, task: Task, model_cfg: dict[str, Any] | None = None
) -> float | None:
    """Greedy pass@1 on `spec.eval_prompts` held-out prompts, with the tokenizer of
    `model_cfg` (bytes when None); None for a task without a held-out split (JSONL)."""
    encode, decode = text_codec(model_cfg or {})
    try:
        return float(
            pass_at_1(
                policy,
                task,
                spec.eval_prompts,
                max_new_tokens=spec.max_new_tokens,
                eos_id=spec.eos_id,
                encode=encode,
                decode=decode,
            )
        )
    except TypeError:
        return None
