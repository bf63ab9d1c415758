"""Incremental decoders for seeded generation (covey/rl/sampling.py): a prefill of
right-padded prompts, then one token per row per step at each row's own position, with
the model's cache. Each returns, per row, the logits (float32, (B, V)) of its last
position and the hidden state there (the LM head's input, float32, (B, D)), the tensors
`sampling.forward_hidden` returns for the last position of a full forward.

- covey's GPT: `covey.models.gpt.KVCache` (attention causal by position, so a row's pads
  sit above its real tokens and are overwritten as it grows);
- a Hugging Face causal LM with an output embedding: its cache (`past_key_values`, named
  `cache` since transformers 5), an attention mask that leaves each row's prefill pads
  out, and explicit position ids.

A row that is done keeps being fed (its outputs are ignored) so that the batch keeps its
shape; `step(..., moving)` leaves its position where it is.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Protocol

import torch
from torch import nn

from covey.models.gpt import GPT, KVCache


class Decoder(Protocol):
    max_positions: int | None

    def prefill(
        self, ids: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, W) right-padded ids, (B,) real lengths -> each row's last real position."""
        ...

    def step(self, ids: torch.Tensor, moving: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 1) ids at each row's next position; rows with `moving` False stay there."""
        ...


def capture(module: nn.Module, pre: bool) -> tuple[list[torch.Tensor], Any]:
    """(captured, handle): `module`'s input (`pre`) or output of each forward run by this
    thread, appended to `captured` until `handle.remove()`. A module's hooks are shared by
    every thread that runs it, and a hook runs in the thread of its forward, so one that
    kept another thread's tensors would mix the hidden states of concurrent generations
    (a serving worker answers several requests at once: covey.serve.worker)."""
    captured: list[torch.Tensor] = []
    me = threading.get_ident()

    def keep(tensor: torch.Tensor) -> None:
        if threading.get_ident() == me:
            captured.append(tensor)

    if pre:
        handle = module.register_forward_pre_hook(lambda _m, args: keep(args[0]))
    else:
        handle = module.register_forward_hook(lambda _m, _i, out: keep(out))
    return captured, handle


class GPTDecoder:
    def __init__(self, model: GPT, batch: int, size: int) -> None:
        self.model = model
        self.cache = KVCache(model, batch, min(model.cfg.block_size, size))
        self.max_positions: int | None = model.cfg.block_size

    def _forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        captured, handle = capture(self.model.ln_f, pre=False)
        try:
            logits = self.model(ids, self.cache)
        finally:
            handle.remove()
        return logits.float(), captured[0].float()

    def prefill(
        self, ids: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, h = self._forward(ids)
        at, last = torch.arange(ids.shape[0], device=ids.device), lengths - 1
        self.cache.advance(lengths)
        return logits[at, last], h[at, last]

    def step(self, ids: torch.Tensor, moving: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, h = self._forward(ids)
        self.cache.advance(moving.long())
        return logits[:, 0], h[:, 0]


class HFDecoder:
    def __init__(self, model: nn.Module, head: nn.Module) -> None:
        self.model, self.head = model, head
        self.max_positions: int | None = None  # the model says so itself
        # transformers 5 names the cache argument and output `cache`, 4.x `past_key_values`
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.past: Any = None
        self.mask: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None

    def _forward(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        captured, handle = capture(self.head, pre=True)
        try:
            out = self.model(**{self.cache_arg: self.past}, use_cache=True, **kwargs)
        finally:
            handle.remove()
        self.past = getattr(out, self.cache_arg)
        return out.logits.float(), captured[0].float()

    def prefill(
        self, ids: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = ids.shape[1]
        self.mask = (torch.arange(width, device=ids.device) < lengths[:, None]).long()
        self.pos = lengths.clone()
        logits, h = self._forward(input_ids=ids, attention_mask=self.mask)
        at, last = torch.arange(ids.shape[0], device=ids.device), lengths - 1
        return logits[at, last], h[at, last]

    def step(self, ids: torch.Tensor, moving: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.mask is not None and self.pos is not None, "prefill first"
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        logits, h = self._forward(
            input_ids=ids, attention_mask=self.mask, position_ids=self.pos[:, None]
        )
        self.pos = self.pos + moving.long()
        return logits[:, 0], h[:, 0]


def decoder_for(model: nn.Module, batch: int, size: int) -> Decoder | None:
    """The decoder of `model` for `batch` rows of up to `size` positions, or None for a
    model without a cache covey knows (it reruns the prefix)."""
    if isinstance(model, GPT):
        return GPTDecoder(model, batch, size)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module) and getattr(model, "config", None) is not None:
        return HFDecoder(model, head)
    return None
