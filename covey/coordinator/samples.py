"""The status page's samples: what the canonical model writes after a few fixed prompts.

The coordinator's evaluator thread (covey.coordinator.service) refreshes them every
`rounds.samples_every` certified rounds with covey.io.generate's seeded sampling (fixed
seed, so two refreshes differ only because the weights did), and /v1/status serves them.
Works for every model source: a covey GPT returns logits, a Hugging Face model an output
with `.logits`; both are seen here as the latter.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from covey.data.tokenizer import Tokenizer
from covey.io.generate import sample

SAMPLE_TEMPERATURE = 0.8  # a little below 1: readable early, still shows what was learned
SAMPLE_SEED = 0


class _CausalLMView(nn.Module):
    """`model` as covey.io.generate.sample expects a causal LM: `.config` names the context
    window, `forward(input_ids=...)` has `.logits`. `hf`: a transformers model (called with
    `input_ids=`), else one called with the ids alone (covey's GPT, py: factories)."""

    def __init__(self, model: nn.Module, window: int, hf: bool) -> None:
        super().__init__()
        self.model, self.hf = model, hf
        self.config = SimpleNamespace(max_position_embeddings=window)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        out = self.model(input_ids=input_ids) if self.hf else self.model(input_ids)
        return SimpleNamespace(logits=out if isinstance(out, torch.Tensor) else out.logits)


def draw_samples(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: tuple[str, ...] | list[str],
    *,
    round: int,
    window: int,
    max_new_tokens: int,
    hf: bool,
) -> dict[str, Any]:
    """{"round", "temperature", "seed", "max_new_tokens", "samples": [{"prompt", "text"}]}
    for `model` (the canonical weights after `round` certified rounds), `window` tokens of
    context at most (`hf`: see _CausalLMView). The model is put in eval mode; exceptions
    propagate (the caller logs them and keeps the previous samples)."""
    view = _CausalLMView(model.eval(), window, hf)
    samples = [
        {
            "prompt": p,
            "text": sample(
                view,
                tokenizer,  # type: ignore[arg-type]  # encode/decode/eos_id is all it uses
                p,
                max_new_tokens=max_new_tokens,
                temperature=SAMPLE_TEMPERATURE,
                seed=SAMPLE_SEED,
            ),
        }
        for p in prompts
    ]
    return {
        "round": round,
        "temperature": SAMPLE_TEMPERATURE,
        "seed": SAMPLE_SEED,
        "max_new_tokens": max_new_tokens,
        "samples": samples,
    }
