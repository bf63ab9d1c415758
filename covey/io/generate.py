"""Sampling text from an exported model (or a run directory, exported on the fly).

The loop is covey's own, a few lines over the model's logits, so a seed gives the same
sample on every machine and every transformers version: temperature 0 is greedy, otherwise
tokens are drawn from softmax(logits / T) with a torch.Generator seeded by `seed`.
Generation stops at the tokenizer's EOS or after `max_new_tokens`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from covey.data.tokenizer import HFTokenizer


def load_exported(directory: str | Path) -> tuple[nn.Module, HFTokenizer]:
    """A model and tokenizer from a Hugging Face directory: safetensors and JSON only,
    never remote code. ValueError when the directory has no config.json."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise ValueError(f"{d} has no config.json (export a run first: covey export RUN --out DIR)")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from covey.models.hf import hf_config

    hf_logging.disable_progress_bar()

    model = AutoModelForCausalLM.from_pretrained(
        str(d),
        config=hf_config(d),
        local_files_only=True,
        trust_remote_code=False,
        use_safetensors=True,
        dtype=torch.float32,
    )
    return model.eval(), HFTokenizer(d)


@torch.no_grad()
def sample(
    model: nn.Module,
    tok: HFTokenizer,
    prompt: str,
    *,
    max_new_tokens: int = 40,
    temperature: float = 1.0,
    seed: int = 0,
) -> str:
    """The text generated after `prompt` (without the prompt). ValueError for a negative
    temperature or token count."""
    if temperature < 0 or max_new_tokens < 0:
        raise ValueError(
            f"temperature ({temperature}) and max_new_tokens ({max_new_tokens}) must be >= 0"
        )
    from covey.models.hf import max_positions

    window = max_positions(model.config) or 1024  # type: ignore[union-attr]
    ids = tok.encode(prompt) or [tok.eos_id]
    start = len(ids)
    g = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], dtype=torch.long)
        logits = model(input_ids=context).logits[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=g))
        if nxt == tok.eos_id:
            break
        ids.append(nxt)
    return tok.decode(ids[start:])


def generate(
    model_or_run: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 40,
    temperature: float = 1.0,
    seed: int = 0,
) -> str:
    """Sample from an exported directory, or from a run directory's latest checkpoint."""
    d = Path(model_or_run)
    if (d / "config.json").is_file():
        model, tok = load_exported(d)
        return sample(
            model, tok, prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed
        )
    from covey.io.export import export_run

    with tempfile.TemporaryDirectory(prefix="covey-generate-") as tmp:
        export_run(d, tmp)
        model, tok = load_exported(tmp)
        return sample(
            model, tok, prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed
        )
