"""A byte-level GPT: the reference model every covey benchmark trains.

A plain decoder-only transformer in the style of nanoGPT. It knows nothing about
distribution, compression or networks; covey's strategies wrap it from outside.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 128  # longest context, in tokens
    vocab_size: int = 256  # bytes
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


# Named sizes. Parameter counts (GPT.num_parameters) are in the comments.
GPT_SIZES: dict[str, GPTConfig] = {
    "nano": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64),  # 0.12M
    "micro": GPTConfig(block_size=128, n_layer=5, n_head=4, n_embd=128),  # 1.04M
    "mini": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),  # 10.8M
    "small": GPTConfig(block_size=512, n_layer=12, n_head=9, n_embd=576),  # 48.3M
    # GPT-2 small's shape, with its 50257-token vocabulary padded to 50304. The byte
    # tokenizer uses ids 0..255 only; the size exists to measure 124M-parameter payloads. 124.5M
    "gpt2": GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768),
}


def gpt_config(size: str) -> GPTConfig:
    try:
        return GPT_SIZES[size]
    except KeyError:
        raise ValueError(
            f"unknown model size {size!r}; choose one of {sorted(GPT_SIZES)}"
        ) from None


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:
            y = cache.attend(layer, q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections: 0.02 / sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """idx: (B, T) int64 token ids -> logits (B, T, vocab_size). With `cache`, idx are
        the tokens at positions `cache.positions(T)` of each row (see `KVCache`)."""
        _, T = idx.shape
        if cache is None:
            if self.cfg.block_size < T:
                raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
            pos = torch.arange(T, device=idx.device)
        else:
            pos = cache.positions(T)  # (B, T)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        return self.lm_head(self.ln_f(x))


class KVCache:
    """Keys and values of every layer for the positions a batch has seen, for incremental
    decoding: buffers (B, nh, size, hs) per layer, and each row's next position `length`.

    A forward with the cache writes the keys/values of its T tokens at positions
    length .. length + T - 1 of each row and attends, for a query at position p, to the
    slots <= p (causal by position), so a right-padded prefill followed by one token per
    row at each row's own length is exact: a row's pads sit at slots above its real tokens
    and are overwritten as it grows. The caller moves `length` on (`advance`)."""

    def __init__(self, model: GPT, batch: int, size: int) -> None:
        if size > model.cfg.block_size:
            raise ValueError(f"cache of {size} positions exceeds block_size {model.cfg.block_size}")
        p = next(model.parameters())
        nh, hs = model.cfg.n_head, model.cfg.n_embd // model.cfg.n_head
        self.keys = [p.new_zeros(batch, nh, size, hs) for _ in model.blocks]
        self.values = [p.new_zeros(batch, nh, size, hs) for _ in model.blocks]
        self.length = torch.zeros(batch, dtype=torch.long, device=p.device)
        self._pos: torch.Tensor | None = None

    def positions(self, T: int) -> torch.Tensor:
        """(B, T) positions of the next T tokens of each row (kept for `attend`)."""
        self._pos = self.length[:, None] + torch.arange(T, device=self.length.device)
        return self._pos

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pos = self._pos
        assert pos is not None, "positions() runs first (GPT.forward calls it)"
        slots = pos[:, None, :, None].expand_as(k)  # (B, nh, T, hs)
        keys = self.keys[layer].scatter_(2, slots, k)
        values = self.values[layer].scatter_(2, slots, v)
        reach = torch.arange(keys.shape[2], device=pos.device)
        mask = (reach[None, None, :] <= pos[:, :, None])[:, None]  # (B, 1, T, size)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    def advance(self, by: torch.Tensor | int) -> None:
        """Move each row's next position on by `by` (per row, or all alike)."""
        self.length += by


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a (B, T+1) batch: inputs [:, :-1], targets [:, 1:]."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
