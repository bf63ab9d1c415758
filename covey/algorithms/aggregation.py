"""Aggregation rules: how decoded contributions become one update.

The seam: an `Aggregator` maps (vectors, weights) to one vector, deterministically (fixed
summation order, float32). The default is the token-weighted mean; robust rules (norm
clipping, trimmed mean, coordinate median) plug in here without touching any strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Aggregator(Protocol):
    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        """Combine equally shaped 1-D float32 vectors; weights are non-negative (tokens)."""
        ...


class WeightedMean:
    """sum_i w_i x_i / sum_i w_i, accumulated in the order given."""

    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        if not vectors or len(vectors) != len(weights):
            raise ValueError(f"{len(vectors)} vectors but {len(weights)} weights")
        total = float(sum(weights))
        if total <= 0:
            raise ValueError(f"weights sum to {total}; need a positive total")
        out = torch.zeros_like(vectors[0], dtype=torch.float32)
        for v, w in zip(vectors, weights, strict=True):
            if v.shape != out.shape:
                raise ValueError(f"vector shape {tuple(v.shape)} != {tuple(out.shape)}")
            out.add_(v.float(), alpha=w / total)
        return out
