"""The served model: an exported Hugging Face folder (`covey export`), or a rounds run's
latest certified checkpoint exported into the server's data directory; its content id;
the nucleus (top_p) filter as a wrapper the seeded sampling and its check both run through;
the chat template with a documented fallback.

Safetensors and JSON only, never remote code (covey.io.generate.load_exported).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from covey.data.tokenizer import HFTokenizer

# the files that make up a served model; anything else in the folder is not hashed
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def model_dir(source: str | Path, data_dir: Path | None = None) -> Path:
    """The Hugging Face folder to serve: `source` itself when it holds config.json, else
    `source` is a rounds run directory (a coordinator's data dir, or a `covey demo` run
    directory holding one) whose latest certified checkpoint is exported (once) into
    `data_dir`/model (covey.io.export.export_run). ValueError otherwise."""
    d = Path(source)
    if (d / "config.json").is_file():
        return d
    if data_dir is None:
        raise ValueError(f"{d} has no config.json and no --data-dir to export the run into")
    from covey.io.export import export_run

    if (d / "coordinator" / "coordinator.db").is_file():  # a `covey demo` run directory
        d = d / "coordinator"
    out = Path(data_dir) / "model"
    if not (out / "config.json").is_file():
        export_run(d, out)  # ValueError for a run without a certified checkpoint
    return out


def model_cid(directory: str | Path) -> str:
    """sha256 over the model's files (name and sha256 of each present in MODEL_FILES):
    the same folder copied to any machine has the same id. ValueError without weights."""
    d = Path(directory)
    if not (d / "model.safetensors").is_file():
        raise ValueError(f"{d} has no model.safetensors (sharded checkpoints are not served)")
    h = hashlib.sha256(b"covey-serve-model/v1")
    for name in MODEL_FILES:
        p = d / name
        if p.is_file():
            h.update(f"\n{name}\n{hashlib.sha256(p.read_bytes()).hexdigest()}".encode())
    return h.hexdigest()


def load_model(directory: str | Path) -> tuple[nn.Module, HFTokenizer]:
    """The model (fp32, eval) and tokenizer of an exported folder."""
    from covey.io.generate import load_exported

    return load_exported(directory)


def load_tokenizer(directory: str | Path) -> HFTokenizer:
    return HFTokenizer(directory)


def context_window(model_or_config: Any) -> int | None:
    from covey.models.hf import max_positions

    config = getattr(model_or_config, "config", model_or_config)
    return max_positions(config)


def hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        v = getattr(config, name, None)
        if isinstance(v, int):
            return v
    head = model.get_output_embeddings()  # type: ignore[operator]
    return int(head.weight.shape[1])


class NucleusLM(nn.Module):
    """A causal LM whose logits outside the top_p nucleus of softmax(logits / T) are -inf.

    covey.rl.sampling's Gumbel-max over these logits draws from the nucleus exactly, and its
    check (one prefill through the same wrapper) refuses a token outside it. The hidden
    states (the LM head's input) are the inner model's, so the proofs are unchanged.
    A token whose cumulative probability sits within float noise of top_p may fall on
    either side of the cut in a worker's and a validator's pass; that edge is not
    forgiven (measured: never hit in `covey bench serve`)."""

    def __init__(self, inner: nn.Module, top_p: float, temperature: float) -> None:
        super().__init__()
        if not 0 < top_p <= 1 or not temperature > 0:
            raise ValueError(f"top_p must be in (0, 1] and T > 0, got {top_p}, {temperature}")
        self.inner, self.top_p, self.temperature = inner, top_p, temperature

    def get_output_embeddings(self) -> nn.Module:
        return self.inner.get_output_embeddings()  # type: ignore[operator,no-any-return]

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        logits = self.inner(input_ids=input_ids, use_cache=False).logits.float()
        probs = torch.softmax(logits / self.temperature, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked above
        drop_sorted = before >= self.top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        return SimpleNamespace(logits=logits.masked_fill(drop, float("-inf")))


def sampler(model: nn.Module, top_p: float, temperature: float) -> nn.Module:
    """The model that seeded sampling and its check run: `model` itself at top_p = 1."""
    return model if top_p >= 1 else NucleusLM(model, top_p, temperature)


def render_chat(tok: HFTokenizer, messages: list[dict[str, Any]]) -> str:
    """The tokenizer's chat template with the assistant's turn opened; a tokenizer without
    one (covey's own, a tiny test tokenizer) gets the fallback: one "role: content" line
    per message, then "assistant:" (docs/serve.md)."""
    template = getattr(tok.tok, "chat_template", None)
    if template:
        return str(
            tok.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])
