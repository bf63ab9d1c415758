"""Cut a decoder model into S contiguous pipeline stages, then build each stage's module.

Planning is a pure function on per-block costs (parameter counts or measured seconds),
separate from applying it (torchtitan's split of plan and execute). Stage 0 holds the
embedding and its blocks, the last stage its blocks and the head; a stage module maps the
stage input (token ids for stage 0, hidden states (B, T, C) otherwise) to its output
(hidden states, or logits (B, T, vocab) for the last stage).

Tied weights (covey's GPT ties lm_head to wte) are shared Parameters when the stages are
built from one model in one process; a server that loads a single stage holds its own
copy, so across servers the tie is untied and each copy trains on its own gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from covey.models.gpt import GPT


def plan_stages(
    block_costs: Sequence[float],
    n_stages: int,
    *,
    embed_cost: float = 0.0,
    head_cost: float = 0.0,
) -> list[list[int]]:
    """Contiguous block indices per stage minimizing the most expensive stage.

    Stage 0 also pays `embed_cost` and the last stage `head_cost`. Every stage gets at
    least one block. Exact (dynamic programming, O(S n^2)); ties go to the earliest cut.
    ValueError names the values when n_stages < 1, n_stages > len(block_costs), or a cost
    is negative or not finite.
    """
    n = len(block_costs)
    if n_stages < 1:
        raise ValueError(f"Number of stages ({n_stages}) must be at least 1")
    if n_stages > n:
        raise ValueError(f"Number of stages ({n_stages}) cannot be greater than blocks ({n})")
    costs = [float(c) for c in block_costs]
    for i, c in enumerate([*costs, embed_cost, head_cost]):
        if not (c >= 0.0 and c != float("inf")):
            raise ValueError(f"cost {c} at position {i} must be finite and >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def seg(lo: int, hi: int) -> float:
        extra = (embed_cost if lo == 0 else 0.0) + (head_cost if hi == n else 0.0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[k][j]: least max cost of blocks [0, j) cut into k stages; cut[k][j]: last start.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], seg(i, j))
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    bounds = [n]
    for k in range(n_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [list(range(bounds[k], bounds[k + 1])) for k in range(n_stages)]


def block_param_costs(model: nn.Module) -> list[float]:
    """Parameter count of each transformer block of `model` (covey GPT or HF decoder)."""
    return [float(sum(p.numel() for p in b.parameters())) for b in _parts(model)["blocks"]]


def _parts(model: nn.Module) -> dict[str, object]:
    if isinstance(model, GPT):
        return {"kind": "gpt", "blocks": model.blocks}
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers") and hasattr(inner, "embed_tokens"):
        return {"kind": "llama", "blocks": inner.layers}
    tr = getattr(model, "transformer", None)
    if tr is not None and hasattr(tr, "h") and hasattr(tr, "wte"):
        return {"kind": "gpt2", "blocks": tr.h}
    raise ValueError(
        f"cannot cut {type(model).__name__} into stages: expected covey GPT, a Llama-style "
        "model (model.embed_tokens, model.layers) or GPT-2 (transformer.wte, transformer.h)"
    )


class StageModule(nn.Module):
    """One stage: optional embedding, a run of blocks, optional head. Subclasses say how."""

    hidden_size: int  # C of the hidden states between stages
    vocab_size: int  # token ids a first stage takes are in [0, vocab_size)

    def __init__(self, blocks: list[nn.Module], first: bool, last: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.first = first
        self.last = last

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) for the first stage, hidden (B, T, C) otherwise -> hidden
        states, or logits (B, T, vocab) for the last stage."""
        if self.first:
            if inputs.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"stage 0 takes token ids, got dtype {inputs.dtype}")
            x = self.embed(inputs)
        else:
            if inputs.dim() != 3:
                raise ValueError(f"stage input must be (B, T, C), got shape {tuple(inputs.shape)}")
            x = inputs
        x = self.run_blocks(x)
        return self.head(x) if self.last else x


class GPTStage(StageModule):
    """A stage of covey's GPT (covey/models/gpt.py)."""

    def __init__(self, model: GPT, idx: list[int], first: bool, last: bool) -> None:
        super().__init__([model.blocks[i] for i in idx], first, last)
        self.block_size = model.cfg.block_size
        self.hidden_size, self.vocab_size = model.cfg.n_embd, model.cfg.vocab_size
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if self.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        return self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class HFStage(StageModule):
    """A stage of a Hugging Face decoder: Llama-style (rotary) or GPT-2 (learned positions).

    Each stage rebuilds the causal mask and positions from the sequence length, so only
    hidden states travel between stages (no padding masks: covey batches are full rows).
    """

    def __init__(self, model: nn.Module, kind: str, idx: list[int], first: bool, last: bool):
        parts = _parts(model)
        super().__init__([parts["blocks"][i] for i in idx], first, last)  # type: ignore[index]
        self.kind = kind
        self.config = model.config
        self.hidden_size, self.vocab_size = (
            int(model.config.hidden_size),
            int(model.config.vocab_size),
        )
        if kind == "llama":
            inner = model.model  # type: ignore[attr-defined]
            self.rotary_emb = inner.rotary_emb
            if first:
                self.embed_tokens = inner.embed_tokens
            if last:
                self.norm, self.lm_head = inner.norm, model.lm_head  # type: ignore[attr-defined]
        else:
            tr = model.transformer  # type: ignore[attr-defined]
            if first:
                self.wte, self.wpe, self.drop = tr.wte, tr.wpe, tr.drop
            if last:
                self.ln_f, self.lm_head = tr.ln_f, model.lm_head  # type: ignore[attr-defined]

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        if self.kind == "llama":
            return self.embed_tokens(idx)
        pos = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=x,
            attention_mask=None,
            past_key_values=None,
            position_ids=pos,
        )
        if self.kind == "llama":
            rope = self.rotary_emb(x, position_ids=pos)
            for b in self.blocks:
                x = b(x, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        else:
            for b in self.blocks:
                x = b(x, None, mask, position_ids=pos)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "llama":
            return self.lm_head(self.norm(x))
        return self.lm_head(self.ln_f(x))


def stage_modules(model: nn.Module, plan: list[list[int]]) -> list[StageModule]:
    """One module per stage of `plan` (from plan_stages), sharing `model`'s parameters.

    ValueError when the plan is not a contiguous cover of the model's blocks in order.
    """
    parts = _parts(model)
    n = len(parts["blocks"])  # type: ignore[arg-type]
    flat = [i for s in plan for i in s]
    if not plan or any(not s for s in plan) or flat != list(range(n)):
        raise ValueError(f"plan {plan} must cut blocks 0..{n - 1} in order, every stage non-empty")
    out: list[StageModule] = []
    for k, idx in enumerate(plan):
        first, last = k == 0, k == len(plan) - 1
        if parts["kind"] == "gpt":
            out.append(GPTStage(model, idx, first, last))  # type: ignore[arg-type]
        else:
            out.append(HFStage(model, str(parts["kind"]), idx, first, last))
    return out
