"""Hugging Face causal LMs as RL policies: a descriptor that travels, never code.

An HF policy is described by a JSON-able dict (the run spec's `model`, hashed into the run
id) instead of covey's GPTConfig:

    {"arch": "hf", "config": {...config.json...}, "vocab_size": V,
     "tokenizer": "<tokenizer.json text>", "tokenizer_sha256": "..."}

`config` must name a `model_type` in `ALLOWED_MODEL_TYPES` (architectures transformers
ships; `auto_map` and `quantization_config` are refused), and every role builds the model
from it with `AutoModelForCausalLM.from_config` (float32, eager attention, no remote code),
then loads the published safetensors weights into it. The tokenizer is the `tokenizers`
JSON of the policy directory: a fast tokenizer, data not code. Prompts are encoded with its
post-processor (e.g. a BOS), completions decoded with special tokens skipped.

A policy directory for `--policy hf:DIR` holds config.json, *.safetensors (never pickles:
`use_safetensors=True`) and tokenizer.json; nothing is downloaded (`local_files_only`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Plain decoder-only architectures whose LM head reads the final-norm output (the hidden
# state the proofs commit to). Others may work but are not admitted from a peer's spec.
ALLOWED_MODEL_TYPES = frozenset(
    {"gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "olmo", "olmo2", "phi3", "gemma"}
)
REFUSED_KEYS = ("auto_map", "quantization_config")
# Bookkeeping keys of a saved config that do not change the model (or that covey sets).
_DROPPED_KEYS = (
    "_name_or_path",
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
    "use_cache",
    "_attn_implementation",
    "_attn_implementation_autoset",
)
ATTENTION = "eager"  # the same kernel on every role: trainer, workers and validators


class HFPolicyError(ValueError):
    """An HF policy descriptor or directory that cannot be used (the message says why)."""


def is_hf(model_cfg: dict[str, Any]) -> bool:
    return isinstance(model_cfg, dict) and model_cfg.get("arch") == "hf"


def check_descriptor(desc: dict[str, Any]) -> dict[str, Any]:
    """`desc` itself when it is a usable HF descriptor; HFPolicyError naming the field."""
    extra = set(desc) - {"arch", "config", "vocab_size", "tokenizer", "tokenizer_sha256"}
    if extra:
        raise HFPolicyError(f"unknown hf policy fields {sorted(extra)}")
    cfg, tok = desc.get("config"), desc.get("tokenizer")
    if not isinstance(cfg, dict) or not isinstance(tok, str):
        raise HFPolicyError("an hf policy needs a 'config' object and a 'tokenizer' string")
    mt = cfg.get("model_type")
    if mt not in ALLOWED_MODEL_TYPES:
        raise HFPolicyError(
            f"hf model_type {mt!r} is not allowed; allowed: {sorted(ALLOWED_MODEL_TYPES)}"
        )
    for key in REFUSED_KEYS:
        if key in cfg:
            raise HFPolicyError(f"hf config names {key!r}: covey never runs remote code")
    vocab = desc.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 2 or cfg.get("vocab_size") != vocab:
        raise HFPolicyError(f"vocab_size {vocab!r} must equal config.vocab_size (an int >= 2)")
    if hashlib.sha256(tok.encode()).hexdigest() != desc.get("tokenizer_sha256"):
        raise HFPolicyError("tokenizer_sha256 does not match the tokenizer text")
    return desc


def build_hf_policy(desc: dict[str, Any]) -> nn.Module:
    """An (untrained, seeded) float32 model of the descriptor, in eval mode, with dropout
    off: the learner's logprobs must be the ones the workers sampled from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_descriptor(desc)
    cfg = dict(desc["config"])
    model_type = cfg.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except (TypeError, ValueError) as e:
        raise HFPolicyError(f"bad hf config: {e}") from None
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, trust_remote_code=False, dtype=torch.float32, attn_implementation=ATTENTION
    )
    return model.eval()


def _descriptor_config(config: Any) -> dict[str, Any]:
    raw = config.to_diff_dict()
    for key in REFUSED_KEYS:
        if key in raw:
            raise HFPolicyError(f"config.json names {key!r}: covey never runs remote code")
    out = {k: v for k, v in raw.items() if k not in _DROPPED_KEYS}
    out["model_type"] = config.model_type
    out["vocab_size"] = int(config.vocab_size)
    return json.loads(json.dumps(out))  # plain JSON values only


def load_hf_dir(directory: str | Path) -> tuple[dict[str, Any], nn.Module]:
    """(descriptor, model with the directory's weights) for `hf:DIR`. HFPolicyError when the
    directory lacks config.json / *.safetensors / tokenizer.json, names remote code or a
    model type outside ALLOWED_MODEL_TYPES."""
    from covey.models.hf import ModelSourceError, read_hf_config

    d = Path(directory).expanduser()
    try:
        raw = read_hf_config(d)
    except ModelSourceError as e:
        raise HFPolicyError(str(e)) from None
    if raw["model_type"] not in ALLOWED_MODEL_TYPES:
        raise HFPolicyError(
            f"{d}/config.json: model_type {raw['model_type']!r} is not allowed as an RL policy; "
            f"allowed: {sorted(ALLOWED_MODEL_TYPES)}"
        )
    if not any(d.glob("*.safetensors")):
        raise HFPolicyError(f"hf policy {d} has no *.safetensors weights")
    if not (d / "tokenizer.json").is_file():
        raise HFPolicyError(
            f"hf policy {d} has no tokenizer.json (a fast tokenizer; tokenizer.model alone "
            "is not supported)"
        )
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(d),
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            dtype=torch.float32,
            attn_implementation=ATTENTION,
        )
    except (OSError, ValueError) as e:
        raise HFPolicyError(f"hf policy {d}: {e}") from None
    tok = (d / "tokenizer.json").read_text()
    desc = {
        "arch": "hf",
        "config": _descriptor_config(model.config),
        "vocab_size": int(model.config.vocab_size),
        "tokenizer": tok,
        "tokenizer_sha256": hashlib.sha256(tok.encode()).hexdigest(),
    }
    n_tok = _tokenizer(tok).get_vocab_size()
    if n_tok > desc["vocab_size"]:
        raise HFPolicyError(f"tokenizer has {n_tok} tokens, the model only {desc['vocab_size']}")
    return desc, model


@lru_cache(maxsize=8)
def _tokenizer(text: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises its own Exception type for bad JSON
        raise HFPolicyError(f"tokenizer.json does not load: {e}") from None


def hf_codec(
    desc: dict[str, Any],
) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """(encode, decode) of the descriptor's tokenizer. encode applies the post-processor
    (a BOS where the tokenizer adds one); decode skips special tokens and ids the tokenizer
    does not have (a model's vocabulary may be padded past the tokenizer's)."""
    tok = _tokenizer(desc["tokenizer"])
    size = tok.get_vocab_size()

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=True).ids)

    def decode(ids: list[int]) -> str:
        return tok.decode([i for i in ids if 0 <= i < size], skip_special_tokens=True)

    return encode, decode


def hf_newline_id(desc: dict[str, Any]) -> int | None:
    """The token that ends an answer: "\\n" when it is one token, else the config's
    eos_token_id (when inside the vocabulary), else None (fixed-length completions)."""
    return _newline_id(desc["tokenizer"], desc["config"])


def dir_newline_id(directory: str | Path) -> int | None:
    """`hf_newline_id` of a policy directory, reading only tokenizer.json and config.json
    (the weights are not loaded). HFPolicyError when either is missing or unreadable."""
    d = Path(directory).expanduser()
    try:
        return _newline_id(
            (d / "tokenizer.json").read_text(), json.loads((d / "config.json").read_text())
        )
    except (OSError, json.JSONDecodeError) as e:
        raise HFPolicyError(f"hf policy {d}: {e}") from None


def _newline_id(tokenizer: str, config: dict[str, Any]) -> int | None:
    ids = _tokenizer(tokenizer).encode("\n", add_special_tokens=False).ids
    if len(ids) == 1:
        return int(ids[0])
    eos = config.get("eos_token_id")
    vocab = config.get("vocab_size")
    ok = isinstance(eos, int) and isinstance(vocab, int) and 0 <= eos < vocab
    return int(eos) if ok else None
