"""Hugging Face causal LMs from a local directory, never with remote code.

A directory holds `config.json` and, optionally, `*.safetensors` weights. The model is
built with `transformers.AutoModelForCausalLM.from_config` (random init, seeded by the
caller) or, for a pretrained start, `from_pretrained(..., use_safetensors=True)`. Nothing is
downloaded (`local_files_only=True`) and nothing received is executed: a config that names
custom code (`auto_map`) or an architecture transformers does not ship is refused before
transformers sees it. `transformers` is imported inside the functions: it is slow to
import, and `covey --help` must stay instant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class ModelSourceError(ValueError):
    """A model source that cannot be loaded; the message says which file and why."""


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """config.json of `directory` as a dict. ModelSourceError when it is missing, not JSON,
    has no `model_type`, or needs remote code."""
    path = Path(directory).expanduser() / "config.json"
    if not path.is_file():
        raise ModelSourceError(f"hf model directory {directory} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelSourceError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ModelSourceError(f"{path}: needs a string 'model_type' (e.g. 'llama')")
    if "auto_map" in raw:
        raise ModelSourceError(
            f"{path} names custom code (auto_map {sorted(raw['auto_map'])}); covey never runs "
            "trust_remote_code: use an architecture transformers ships"
        )
    return raw


def hf_config(directory: str | Path) -> Any:
    """The transformers PretrainedConfig of `directory` (checked by read_hf_config)."""
    raw = read_hf_config(directory)
    from transformers import CONFIG_MAPPING, AutoConfig

    if raw["model_type"] not in CONFIG_MAPPING:
        raise ModelSourceError(
            f"{directory}/config.json: model_type {raw['model_type']!r} is not an architecture "
            f"this transformers ships (remote code is never run)"
        )
    try:
        return AutoConfig.from_pretrained(
            str(Path(directory).expanduser()), local_files_only=True, trust_remote_code=False
        )
    except (ValueError, OSError) as e:
        raise ModelSourceError(f"{directory}/config.json: {e}") from None


def build_hf_model(directory: str | Path, seed: int, *, pretrained: bool = False) -> nn.Module:
    """A float32 causal LM for `directory`: random init deterministic from `seed`, or its
    safetensors weights when `pretrained` (ModelSourceError if there are none)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(directory)
    torch.manual_seed(seed)
    if pretrained:
        if not any(Path(directory).expanduser().glob("*.safetensors")):
            raise ModelSourceError(f"pretrained start: no *.safetensors in {directory}")
        model = AutoModelForCausalLM.from_pretrained(
            str(Path(directory).expanduser()),
            config=config,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            dtype=torch.float32,
        )
    else:
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=False, dtype=torch.float32
        )
    model.config.use_cache = False  # training: no KV cache to build every step
    return model


def hf_lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a (B, T+1) batch, like covey.models.gpt.lm_loss."""
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))


def max_positions(config: Any) -> int | None:
    """The longest context the architecture accepts, or None when it has no fixed limit."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
