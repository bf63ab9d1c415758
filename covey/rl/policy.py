"""Policies as bytes: what the trainer publishes on the blob plane and every role loads.

A policy is covey's GPT, described by its `GPTConfig` (a dict in the run's spec), and its
weights as one safetensors blob (content id = sha256 of the bytes). Loading checks every
tensor against the config's shapes and refuses NaN/Inf, so a blob that hashes right but
was built for another model is an error, never a silently different policy. Nothing here
unpickles: safetensors only.

A policy directory (`--policy`) is what `covey rl sft` writes (policy.json +
policy.safetensors, covey.rl.sft), or `config.json` (GPTConfig fields) + `model.safetensors`.

`--policy hf:DIR` is a Hugging Face causal LM (covey.rl.hf_policy): its model config is a
descriptor `{"arch": "hf", ...}` (allow-listed model type + tokenizer.json text) instead of
GPTConfig fields; every function here takes either. `text_codec(model_cfg)` is the
tokenizer every role must use: bytes for covey's GPT, the descriptor's tokenizer for HF.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from covey.models.gpt import GPT, GPTConfig, gpt_config
from covey.models.naming import gpt_preset, model_name
from covey.rl import hf_policy
from covey.rl.batch import byte_decode, byte_encode

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class PolicyError(ValueError):
    """Policy bytes or a policy directory that cannot be used."""


def config_of(model_cfg: dict[str, Any]) -> GPTConfig | dict[str, Any]:
    """A GPTConfig from a spec's model dict (or the checked descriptor of an HF policy).
    PolicyError naming the field otherwise."""
    if hf_policy.is_hf(model_cfg):
        try:
            return hf_policy.check_descriptor(model_cfg)
        except hf_policy.HFPolicyError as e:
            raise PolicyError(str(e)) from None
    known = set(GPTConfig.__dataclass_fields__)
    extra = set(model_cfg) - known
    if extra:
        raise PolicyError(f"unknown model config fields {sorted(extra)}; known {sorted(known)}")
    try:
        return GPTConfig(**{k: int(v) for k, v in model_cfg.items()})
    except (TypeError, ValueError) as e:
        raise PolicyError(f"bad model config {model_cfg}: {e}") from None


def policy_name(model_cfg: dict[str, Any]) -> str:
    """The policy's name for people (covey.models.naming): `covey GPT nano (2 layers x 64)`
    for a preset's shape, `GPT-2 (2 layers x 64)` for an HF descriptor's config."""
    if hf_policy.is_hf(model_cfg):
        return model_name("hf:", model_cfg.get("config") or {})
    return model_name(f"covey:{gpt_preset(model_cfg) or 'custom'}", model_cfg)


def build_policy(model_cfg: dict[str, Any]) -> torch.nn.Module:
    """An (untrained) GPT of the config (or HF model of the descriptor), in eval mode;
    weights come from `load_weights`. PolicyError for a config that cannot be built."""
    if hf_policy.is_hf(model_cfg):
        try:
            return hf_policy.build_hf_policy(model_cfg)
        except hf_policy.HFPolicyError as e:
            raise PolicyError(str(e)) from None
    torch.manual_seed(0)
    cfg = config_of(model_cfg)
    assert isinstance(cfg, GPTConfig)
    return GPT(cfg).eval()


Codec = tuple[Callable[[str], list[int]], Callable[[list[int]], str]]


def text_codec(model_cfg: dict[str, Any]) -> Codec:
    """(encode, decode) the roles use for prompts and completions: byte tokens for covey's
    GPT, the descriptor's tokenizer for an HF policy."""
    if hf_policy.is_hf(model_cfg):
        return hf_policy.hf_codec(model_cfg)
    return byte_encode, byte_decode


def codec_kwargs(model_cfg: dict[str, Any]) -> dict[str, Any]:
    """`encode=`/`decode=` keyword arguments for rollout, check_batch and pass_at_1."""
    encode, decode = text_codec(model_cfg)
    return {"encode": encode, "decode": decode}


def spec_defaults(policy: str | None) -> dict[str, Any]:
    """RLSpec fields a policy implies unless the run's TOML sets them: an HF policy's
    `eos_id` is its tokenizer's newline token (covey GPT's byte 10 is RLSpec's default)."""
    if policy is None or not policy.startswith("hf:"):
        return {}
    try:
        return {"eos_id": hf_policy.dir_newline_id(policy[3:])}
    except hf_policy.HFPolicyError as e:
        raise PolicyError(str(e)) from None


def policy_bytes(model: torch.nn.Module) -> bytes:
    """The model's weights as safetensors bytes (float32, contiguous, CPU)."""
    tensors = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return st_save(tensors)


def load_weights(model: torch.nn.Module, data: bytes) -> torch.nn.Module:
    """Load safetensors `data` into `model` in place. PolicyError when a name is missing
    or extra, a shape differs, or a value is not finite; the model is then unchanged."""
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own SafetensorError for bad headers
        raise PolicyError(f"policy blob is not safetensors: {e}") from None
    own = model.state_dict()
    _check_tied(model, tensors)
    if set(tensors) != set(own):
        missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        raise PolicyError(f"policy tensors differ: missing {missing[:4]}, extra {extra[:4]}")
    for name, t in tensors.items():
        if t.shape != own[name].shape:
            raise PolicyError(f"{name}: shape {tuple(t.shape)}, model has {tuple(own[name].shape)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise PolicyError(f"{name} holds NaN or Inf")
    model.load_state_dict({k: t.to(own[k].dtype) for k, t in tensors.items()}, strict=True)
    return model


def _check_tied(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Names that share one tensor in the model (an HF LM head tied to the embedding) must
    hold equal values in the blob: otherwise which one "wins" would depend on load order."""
    seen: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t.numel() == 0:
            continue
        first = seen.setdefault(t.data_ptr(), name)
        if first != name and first in tensors and name in tensors:
            a, b = tensors[first], tensors[name]
            if a.shape != b.shape or not torch.equal(a, b):
                raise PolicyError(f"{name} is tied to {first} but the blob gives it other values")


def save_policy_dir(model: GPT, directory: str | Path) -> Path:
    """Write `model` as a policy directory (config.json + model.safetensors)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=1))
    (d / WEIGHTS_FILE).write_bytes(policy_bytes(model))
    return d


def load_policy_dir(directory: str | Path) -> tuple[dict[str, Any], torch.nn.Module]:
    """(model config dict, model) from a policy directory, from `covey:<preset>` for a
    randomly initialized preset, or from `hf:DIR` for a Hugging Face causal LM (see
    covey.rl.hf_policy). PolicyError naming the path when it cannot be used."""
    text = str(directory)
    if text.startswith("hf:"):
        try:
            desc, loaded = hf_policy.load_hf_dir(text[3:])
            # the model every role builds from the descriptor, with the directory's weights
            return desc, load_weights(hf_policy.build_hf_policy(desc), policy_bytes(loaded))
        except hf_policy.HFPolicyError as e:
            raise PolicyError(str(e)) from None
    if text.startswith("covey:"):
        try:
            cfg = gpt_config(text[6:]).to_dict()
        except ValueError as e:
            raise PolicyError(str(e)) from None
        return cfg, build_policy(cfg)
    d = Path(directory)
    if (d / "policy.json").is_file():  # covey rl sft's format (covey.rl.sft)
        from covey.rl.sft import load_policy

        try:
            model, _doc = load_policy(d)
        except (ValueError, OSError) as e:
            raise PolicyError(str(e)) from None
        return model.cfg.to_dict(), model
    try:
        raw = json.loads((d / CONFIG_FILE).read_text())
        data = (d / WEIGHTS_FILE).read_bytes()
    except (OSError, json.JSONDecodeError) as e:
        raise PolicyError(
            f"{d} is not a policy directory ({CONFIG_FILE} + {WEIGHTS_FILE}): {e}"
        ) from None
    if isinstance(raw, dict) and isinstance(raw.get("gpt"), dict):
        raw = raw["gpt"]
    if not isinstance(raw, dict):
        raise PolicyError(f"{d / CONFIG_FILE} is not a JSON object")
    fields = set(GPTConfig.__dataclass_fields__)
    cfg = {k: v for k, v in raw.items() if k in fields}
    model = build_policy(cfg)
    load_weights(model, data)
    return GPTConfig(**{k: int(v) for k, v in cfg.items()}).to_dict(), model
