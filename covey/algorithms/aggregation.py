"""Aggregation rules: how decoded contributions become one update.

The seam: an `Aggregator` maps (vectors, weights) to one vector, deterministically (fixed
summation order, float32). The default is the token-weighted mean; the robust rules plug in
here without touching any strategy:

    NormClip(factor, inner)   clip each norm to factor x the round's median norm, then inner
    TrimmedMean(trim)         per coordinate, drop the k smallest and k largest, average
    CoordinateMedian()        per coordinate median

`build_aggregator` maps `TrustConfig`'s (aggregation, trim_fraction, clip_factor) to one.

Determinism is bit-exact across calls, processes, thread counts and CPUs: every result is
built from element-wise IEEE operations in an order fixed by the code (never from torch's
reductions or sorts, whose order depends on threads and SIMD width). Per-coordinate rules
sort with a sorting network of `torch.minimum`/`torch.maximum` over chunks of coordinates,
so memory stays at about one chunk per contributor beyond the inputs and the output.

Robust rules ignore the token weights (a peer could inflate its claimed tokens; verification,
not aggregation, checks those) but validate them like the mean does. Vector values are
expected finite (`Strategy.validate` rejects anything else at submit); a NaN or Inf that gets
here propagates into the output, except in NormClip, which refuses it (ValueError).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

import torch

#: per-coordinate rules process this many (contributors x coordinates) values at a time
_CHUNK_VALUES = 1 << 20
#: l2 norms sum squares in float64 blocks of this many elements (fixed: it sets the order)
_NORM_BLOCK = 1 << 20


class Aggregator(Protocol):
    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        """Combine equally shaped 1-D float32 vectors; weights are non-negative (tokens)."""
        ...


def check_round(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> float:
    """The weights' total, after checking what every rule needs: at least one vector, one
    weight per vector, equal shapes, finite non-negative weights with a finite positive
    total. ValueError names the first problem."""
    if not vectors:
        raise ValueError("no vectors to aggregate")
    if len(vectors) != len(weights):
        raise ValueError(f"{len(vectors)} vectors but {len(weights)} weights")
    shape = vectors[0].shape
    for i, (v, w) in enumerate(zip(vectors, weights, strict=True)):
        if v.shape != shape:
            raise ValueError(f"vector {i} has shape {tuple(v.shape)}, vector 0 {tuple(shape)}")
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {i} is {w}; need a finite non-negative weight")
    total = float(sum(weights))
    if not math.isfinite(total) or total <= 0:
        raise ValueError(f"weights sum to {total}; need a finite positive total")
    return total


@dataclass(frozen=True)
class WeightedMean:
    """sum_i w_i x_i / sum_i w_i, accumulated in the order given. ValueError as in
    `check_round`."""

    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        total = check_round(vectors, weights)
        out = torch.zeros_like(vectors[0], dtype=torch.float32)
        for v, w in zip(vectors, weights, strict=True):
            out.add_(v.float(), alpha=w / total)
        return out


# -- norm clipping ------------------------------------------------------------------------


def l2_norm(vector: torch.Tensor) -> float:
    """The l2 norm of a float32 tensor, bit-identical on every machine and thread count.

    Squares are exact in float64 (24-bit mantissas), so nothing overflows; they are summed
    by a pairwise tree of element-wise adds inside fixed blocks, then block by block."""
    flat = vector.detach().reshape(-1)
    total = 0.0
    for start in range(0, flat.numel(), _NORM_BLOCK):
        block = flat[start : start + _NORM_BLOCK]
        width = 1 << max(block.numel() - 1, 0).bit_length()  # next power of two
        sq = torch.zeros(width, dtype=torch.float64, device=block.device)  # x + 0 == x
        sq[: block.numel()] = block
        sq.mul_(sq)
        while width > 1:
            width //= 2
            sq[:width].add_(sq[width : 2 * width])
        total += float(sq[0])
    return math.sqrt(total)


def clip_bound(norms: Sequence[float], factor: float) -> float:
    """factor x the lower median of the norms: the largest norm NormClip lets through."""
    return factor * sorted(norms)[(len(norms) - 1) // 2]


@dataclass(frozen=True)
class NormClip:
    """Scale every vector whose l2 norm exceeds `factor` x the round's median norm (the
    lower median for an even count) down to that bound, then aggregate with `inner`.

    Relative to the median, so there is no absolute threshold to tune, and an attacker in a
    minority cannot push the median outside the range of honest norms: a x100 contribution
    weighs at most `factor` honest norms. FLAME (Nguyen et al. 2022, arXiv 2101.02281)
    clips to the median norm the same way. factor 0 turns clipping off; a zero vector stays
    zero; if the median norm is 0, every vector is clipped to zero.

    Memory: a clipped vector is copied, so at worst the inputs are held twice.
    ValueError on bad input as in `check_round`, or when a vector's norm is not finite.
    """

    factor: float
    inner: Aggregator = field(default_factory=WeightedMean)

    def __post_init__(self) -> None:
        if not math.isfinite(self.factor) or self.factor < 0:
            raise ValueError(f"clip factor is {self.factor}; need a finite factor >= 0")

    def clip(self, vectors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The vectors after clipping (unclipped ones are returned as given, not copied)."""
        if self.factor == 0:
            return list(vectors)
        norms = [l2_norm(v) for v in vectors]
        for i, n in enumerate(norms):
            if not math.isfinite(n):
                raise ValueError(f"vector {i} has norm {n}; values must be finite")
        bound = clip_bound(norms, self.factor)
        out = []
        for v, n in zip(vectors, norms, strict=True):
            if n <= bound:
                out.append(v)
            elif bound == 0:
                out.append(torch.zeros_like(v, dtype=torch.float32))
            else:
                out.append(v.float() * (bound / n))
        return out

    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        check_round(vectors, weights)
        return self.inner(self.clip(vectors), weights)


# -- per-coordinate order statistics ------------------------------------------------------


@lru_cache(maxsize=64)
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Comparators (i, j), i < j, that sort n values ascending when each puts the smaller
    value at i: Batcher's odd-even merge sort (Batcher 1968, "Sorting networks and their
    applications"; Knuth, TAOCP vol. 3, 5.3.4), O(n log^2 n) comparators. Built for the
    next power of two; comparators reaching past n are dropped, which is exact because the
    missing inputs act as +inf and such a comparator never moves anything."""
    width = 1 << max(n - 1, 0).bit_length()
    out = []
    p = 1
    while p < width:
        k = p
        while k >= 1:
            for j in range(k % p, width - k, 2 * k):
                for i in range(min(k, width - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p) and i + j + k < n:
                        out.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(out)


def per_coordinate(
    vectors: Sequence[torch.Tensor], reduce: Callable[[list[torch.Tensor]], torch.Tensor]
) -> torch.Tensor:
    """Apply `reduce` to the per-coordinate sorted values, a chunk of coordinates at a time.

    `reduce` gets n equally long float32 tensors, rows[r][c] being the r-th smallest value
    at coordinate c, and returns one tensor of that length. The output has the vectors'
    shape; its zeros are +0.0, so the result does not depend on the order of the vectors."""
    n = len(vectors)
    flats = [v.detach().reshape(-1) for v in vectors]
    out = torch.empty(flats[0].numel(), dtype=torch.float32, device=flats[0].device)
    chunk = max(1, _CHUNK_VALUES // n)
    network = sorting_network(n)
    for start in range(0, out.numel(), chunk):
        rows = [f[start : start + chunk].float() for f in flats]
        for i, j in network:
            lo, hi = rows[i], rows[j]
            rows[i], rows[j] = torch.minimum(lo, hi), torch.maximum(lo, hi)
        # -0.0 + 0.0 == +0.0: the network may hand out either zero for a tie of two zeros
        out[start : start + chunk] = reduce(rows).add_(0.0)
    return out.view(vectors[0].shape)


@dataclass(frozen=True)
class TrimmedMean:
    """Per coordinate, drop the k = floor(trim_fraction x n) smallest and k largest of the
    n values and average the rest, unweighted (Yin et al. 2018, arXiv 1803.01498: the
    coordinate-wise trimmed mean is order-optimal against a minority of Byzantine workers).

    With k == 0 (e.g. 2 or 3 contributions at trim 0.25) this is exactly WeightedMean, the
    token-weighted mean. ValueError on bad input as in `check_round`.
    """

    trim_fraction: float

    def __post_init__(self) -> None:
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim fraction is {self.trim_fraction}; need 0 <= trim < 0.5")

    def trim_count(self, n: int) -> int:
        """k for n contributions; at least one value per coordinate is always kept."""
        # + 1e-9: a fraction meant as an exact decimal (0.29 x 100) is not cut short by
        # binary rounding (28.999999999999996)
        return min(math.floor(self.trim_fraction * n + 1e-9), (n - 1) // 2)

    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        check_round(vectors, weights)
        n = len(vectors)
        k = self.trim_count(n)
        if k == 0:
            return WeightedMean()(vectors, weights)

        def mean_of_middle(rows: list[torch.Tensor]) -> torch.Tensor:
            acc = rows[k].clone()
            for r in rows[k + 1 : n - k]:  # ascending order: fixed by the values alone
                acc.add_(r)
            return acc.div_(n - 2 * k)

        return per_coordinate(vectors, mean_of_middle)


@dataclass(frozen=True)
class CoordinateMedian:
    """Per-coordinate median, unweighted (Yin et al. 2018, arXiv 1803.01498). For an even
    count, the mean of the two middle values (computed as a/2 + b/2: symmetric, and no
    overflow). ValueError on bad input as in `check_round`."""

    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        check_round(vectors, weights)
        n = len(vectors)

        def middle(rows: list[torch.Tensor]) -> torch.Tensor:
            if n % 2:
                return rows[n // 2].clone()
            return rows[n // 2 - 1] * 0.5 + rows[n // 2] * 0.5

        return per_coordinate(vectors, middle)


AGGREGATIONS = ("mean", "trimmed_mean", "median")


def build_aggregator(aggregation: str, trim_fraction: float, clip_factor: float) -> Aggregator:
    """The rule `TrustConfig` names: "mean" | "trimmed_mean" | "median", wrapped in
    NormClip(clip_factor) unless clip_factor is 0. ValueError on an unknown name or an
    out-of-range parameter."""
    inner: Aggregator
    if aggregation == "mean":
        inner = WeightedMean()
    elif aggregation == "trimmed_mean":
        inner = TrimmedMean(trim_fraction)
    elif aggregation == "median":
        inner = CoordinateMedian()
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    if clip_factor == 0:
        return inner
    return NormClip(clip_factor, inner)
