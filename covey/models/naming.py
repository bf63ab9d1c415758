"""A model's name for people: what the status pages, the demo summary and the logs call a
run's model, from what a spec names (covey:<preset>, hf:<dir>, py:<module>:<function>) and
the config the model was built from. Plain data in, a string out: no file is read.

    covey GPT nano (2 layers x 64)        a covey preset (covey.models.gpt.GPT_SIZES)
    GPT-2 (GPT2LMHeadModel, 12 layers x 768)   a Hugging Face config's model_type and class
"""

from __future__ import annotations

from typing import Any

# model_type (a Hugging Face config.json's) -> the name its authors use
FAMILIES = {
    "gpt2": "GPT-2",
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gpt_neox": "GPT-NeoX",
    "olmo": "OLMo",
    "olmo2": "OLMo 2",
    "phi3": "Phi-3",
    "gemma": "Gemma",
}
_LAYERS = ("n_layer", "num_hidden_layers", "num_layers")
_WIDTH = ("n_embd", "hidden_size", "d_model")


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((config[k] for k in keys if isinstance(config.get(k), int)), None)


def _shape(config: dict[str, Any]) -> str:
    layers, width = _first(config, _LAYERS), _first(config, _WIDTH)
    return f"{layers} layers x {width}" if layers is not None and width is not None else ""


def gpt_preset(config: dict[str, Any]) -> str | None:
    """The covey GPT preset whose shape `config` (a GPTConfig as a dict) has, the
    vocabulary aside (a run may resize it to its tokenizer's); None for a custom shape."""
    from covey.models.gpt import GPT_SIZES

    shape = {k: v for k, v in config.items() if k != "vocab_size"}
    for name, preset in GPT_SIZES.items():
        if {k: v for k, v in preset.to_dict().items() if k != "vocab_size"} == shape:
            return name
    return None


def model_name(source: str, config: dict[str, Any] | None = None) -> str:
    """The name of the model built from `source` (with its prefix) with `config` (its
    GPTConfig or Hugging Face config as a dict; {} for a py: factory)."""
    config = config or {}
    kind, _, rest = source.partition(":")
    shape = _shape(config)
    if kind == "covey":
        preset = rest or gpt_preset(config) or "custom"
        return f"covey GPT {preset}" + (f" ({shape})" if shape else "")
    if kind == "hf":
        model_type = str(config.get("model_type") or "")
        architectures = config.get("architectures") or []
        family = FAMILIES.get(model_type, model_type or "Hugging Face model")
        detail = [str(architectures[0])] if architectures else []
        detail += [shape] if shape else []
        return family + (f" ({', '.join(detail)})" if detail else "")
    return f"{rest or source} (a Python factory)"


def count_text(n: int) -> str:
    """A parameter count the way people say it: 124.4M, 1.04M, 0.12M, 3.2B."""
    if n >= 10**9:
        return f"{n / 1e9:.1f}B"
    if n >= 10**8:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e6:.2f}M" if n >= 10**4 else f"{n:,}"


def model_title(name: str, source: str, parameters: int | None) -> str:
    """One line for a summary: `GPT-2 (...), hf:configs/gpt2-124m, 124.4M parameters`."""
    count = f", {count_text(parameters)} parameters" if parameters is not None else ""
    return f"{name}, {source}{count}"
