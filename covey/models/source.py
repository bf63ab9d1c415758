"""One way to build a run's model from its source string, used everywhere a model is built.

Sources:
- `covey:<preset>` (or a bare preset name, as before): covey's GPT (covey.models.gpt).
- `hf:<dir>`: a Hugging Face causal LM from a local config.json (covey.models.hf).
- `py:<module>:<function>`: a factory `function()` returning `(nn.Module, loss_fn)`, where
  `loss_fn(model, batch)` takes a (B, T+1) int64 batch and returns a scalar loss.

Random init is deterministic from the run seed: `torch.manual_seed(seed)` right before the
model is built, so every peer that builds the same source with the same seed holds
bit-identical weights.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from covey.models.gpt import GPT, GPT_SIZES, GPTConfig, gpt_config, lm_loss
from covey.models.hf import ModelSourceError, build_hf_model, hf_lm_loss, max_positions
from covey.models.naming import model_name
from covey.models.randomness import check_reproducible

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of covey needs to know about a built model."""

    source: str  # with its prefix: "covey:nano", "hf:dir", "py:mod:fn"
    kind: str  # "covey", "hf" or "py"
    parameters: int
    vocab_size: int | None  # rows of the input embedding; None if unknown (py: factories)
    max_positions: int | None  # longest context; None if the model has no fixed limit
    config: dict[str, Any] = field(default_factory=dict)  # GPTConfig or HF config as a dict

    @property
    def name(self) -> str:
        """For people: `covey GPT nano (2 layers x 64)`, `GPT-2 (GPT2LMHeadModel, ...)`."""
        return model_name(self.source, self.config)


def parse_source(source: str) -> tuple[str, str]:
    """(kind, rest) of a model source; a bare preset name means `covey:<preset>`.
    ModelSourceError for an unknown prefix or an empty remainder."""
    if source in GPT_SIZES:
        return "covey", source
    kind, sep, rest = source.partition(":")
    if not sep or kind not in ("covey", "hf", "py") or not rest:
        raise ModelSourceError(
            f"model source {source!r}: expected covey:<preset> ({', '.join(GPT_SIZES)}), "
            "hf:<dir> or py:<module>:<function>"
        )
    return kind, rest


def build_model(
    source: str, seed: int, *, vocab_size: int | None = None, init: str | None = None
) -> tuple[nn.Module, LossFn, ModelInfo]:
    """(model, loss_fn, info) for `source`, randomly initialized from `seed`.

    vocab_size: for covey presets only, resize the GPT's vocabulary to a tokenizer's
    (HF and py: models bring their own). init: None for random init, or "hf:<dir>" to start
    from that directory's safetensors weights (fine-tuning; hf: sources only).
    Raises ModelSourceError (a ValueError) naming the source on any problem.
    """
    kind, rest = parse_source(source)
    config: dict[str, Any]
    if init is not None and (kind != "hf" or not init.startswith("hf:")):
        raise ModelSourceError(
            f"init {init!r}: a pretrained start needs an hf:<dir> init and an hf:<dir> model "
            f"(model is {source!r})"
        )
    if kind == "covey":
        cfg = gpt_config(rest)
        if vocab_size is not None and vocab_size != cfg.vocab_size:
            cfg = GPTConfig(**{**cfg.to_dict(), "vocab_size": vocab_size})
        torch.manual_seed(seed)
        model: nn.Module = GPT(cfg)
        loss: LossFn = lm_loss
        vocab, positions, config = cfg.vocab_size, cfg.block_size, cfg.to_dict()
    elif kind == "hf":
        directory = init[3:] if init is not None else rest
        model = build_hf_model(directory, seed, pretrained=init is not None)
        loss = hf_lm_loss
        hf_cfg = model.config  # type: ignore[union-attr]
        vocab = model.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
        positions, config = max_positions(hf_cfg), hf_cfg.to_dict()
    else:
        model, loss = _from_factory(rest, seed)
        emb = getattr(model, "get_input_embeddings", None)
        vocab = emb().weight.shape[0] if callable(emb) else None
        positions, config = None, {}
    info = ModelInfo(
        source=f"{kind}:{rest}",
        kind=kind,
        parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=vocab,
        max_positions=positions,
        config=config,
    )
    return model, loss, info


def _from_factory(spec: str, seed: int) -> tuple[nn.Module, LossFn]:
    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise ModelSourceError(f"model source 'py:{spec}': expected py:<module>:<function>")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelSourceError(
            f"model source 'py:{spec}': cannot import {module_name}: {e}"
        ) from None
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise ModelSourceError(f"model source 'py:{spec}': {module_name} has no {fn_name}()")
    torch.manual_seed(seed)
    made = factory()
    if (
        not isinstance(made, tuple)
        or len(made) != 2
        or not isinstance(made[0], nn.Module)
        or not callable(made[1])
    ):
        raise ModelSourceError(
            f"model source 'py:{spec}': {fn_name}() must return (nn.Module, loss_fn), "
            f"got {type(made).__name__}"
        )
    return made[0], made[1]


DEFAULT_SEQ_LEN = 256  # for models without a block size of their own (hf:, py:)


def check_fit(info: ModelInfo, tokenizer_vocab: int, seq_len: int) -> None:
    """ValueError, before any training, when the tokenizer or the context does not fit the
    model: both values are named."""
    if info.vocab_size is not None and tokenizer_vocab > info.vocab_size:
        raise ValueError(
            f"tokenizer vocabulary ({tokenizer_vocab}) is larger than the model's embeddings "
            f"({info.vocab_size} rows, {info.source})"
        )
    if info.max_positions is not None and seq_len > info.max_positions:
        raise ValueError(
            f"context length data.seq_len ({seq_len}) exceeds the model's positions "
            f"({info.max_positions}, {info.source})"
        )


def build_run_model(
    model_cfg: Any, seed: int, *, tokenizer_vocab: int, seq_len: int | None
) -> tuple[nn.Module, LossFn, ModelInfo, int]:
    """The model a run spec names (a covey.config.ModelConfig), checked against the run's
    tokenizer and context: (model, loss_fn, info, seq_len). A covey preset takes the
    tokenizer's vocabulary size; seq_len defaults to the GPT's block size, else
    min(DEFAULT_SEQ_LEN, the model's positions). ValueError when they do not fit;
    ModelSourceError when the model's forward in train mode is random in a way a validator
    cannot reproduce (`check_reproducible`)."""
    source = model_cfg.spec
    kind, _ = parse_source(source)
    vocab = tokenizer_vocab if kind == "covey" and tokenizer_vocab != 256 else None
    # a covey checkpoint init is loaded by whoever owns the initial state (covey.models.warmstart)
    init = model_cfg.init if (model_cfg.init or "").startswith("hf:") else None
    model, loss, info = build_model(source, seed, vocab_size=vocab, init=init)
    if seq_len is None:
        seq_len = info.max_positions if kind == "covey" else DEFAULT_SEQ_LEN
        if info.max_positions is not None:
            seq_len = min(seq_len or DEFAULT_SEQ_LEN, info.max_positions)
    assert seq_len is not None
    check_fit(info, tokenizer_vocab, seq_len)
    # every inner step must re-execute exactly: randomness not drawn from torch's global
    # generators (which each step seeds: covey.models.randomness) is refused here
    check_reproducible(model, loss, seq_len=seq_len, vocab_size=info.vocab_size, source=info.source)
    return model, loss, info, seq_len
