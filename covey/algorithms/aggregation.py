"""Aggregation rules: how decoded contributions become one update.

The seam: an `Aggregator` maps (vectors, weights) to one vector, deterministically (fixed
summation order, float32 out). Weights are the contributions' tokens. The default is the
token-weighted mean; the robust rules plug in here without touching any strategy:

    NormClip(factor, inner)   clip each norm to factor x the round's median norm, scaled
                              by the peer's tokens over the median tokens, then inner
    TrimmedMean(trim)         per coordinate, drop trim x the total WEIGHT at each end of
                              the sorted values, weighted mean of the rest
    CoordinateMedian()        per coordinate weighted median

`build_aggregator` maps `TrustConfig`'s (aggregation, trim_fraction, clip_factor) to one;
the coordinator, the peers and the simulator all build theirs with it from the run spec.

Why weighted: a peer that trained on 4x the tokens of another is 4x the evidence, and an
unweighted rule would let four small honest contributions outvote it (or, clipping to the
plain median norm, cut it down for having done more work). Claimed tokens are bounded by
the coordinator's assignment and checked by re-execution (covey/trust/verify.py), so a
cheater cannot buy weight it does not pay for in compute, unnoticed.

Determinism is bit-exact across calls, processes, thread counts and CPUs: every result is
built from element-wise IEEE operations (a multiply and an add are separate kernels, never a
fused multiply-add, whose use differs between vectorized and scalar loops) in an order fixed
by the code, never from torch's reductions or sorts, whose order depends on threads and SIMD
width. Per-coordinate rules sort (value, weight) pairs with a sorting network of compare-
exchanges over chunks of coordinates, so memory stays at a few chunks per contributor
beyond the inputs and the output.

Vector values are expected finite (`Strategy.validate` rejects anything else at submit);
NormClip refuses a non-finite vector (ValueError), the other rules give a deterministic but
meaningless result (NaN where it lands) for one.
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
#: ... on a device other than the CPU, where each of the rule's element-wise ops is a
#: kernel launch: chunks as large as memory allows keep the launches few (the bits do not
#: depend on the chunk: every op acts on each coordinate alone)
_DEVICE_CHUNK_VALUES = 1 << 26
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
            # multiply, then add: add_(alpha=) is a fused multiply-add in torch's vectorized
            # loop and not in its scalar tail, and threads move where the tail falls
            out.add_(v.float() * (w / total))
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


def lower_median(values: Sequence[float]) -> float:
    """The middle value, the lower of the two middle ones for an even count."""
    return sorted(values)[(len(values) - 1) // 2]


def clip_bounds(norms: Sequence[float], weights: Sequence[float], factor: float) -> list[float]:
    """The largest norm NormClip lets through for each vector:
    factor x median norm x max(1, w_i / median weight) (lower medians).

    Scaled by tokens because a pseudo-gradient grows with the work behind it (DiLoCo's
    roughly linearly in inner steps): an honest peer with 4x the median tokens may send up
    to 4x the median norm. Never below factor x the median norm, so a small honest peer
    is not clipped either (DDP's gradient, a mean over the batch, does not grow)."""
    m = factor * lower_median(norms)
    w_med = lower_median(weights)
    if w_med <= 0:  # a majority of zero weights: scaling by tokens means nothing
        return [m] * len(norms)
    return [m * max(1.0, w / w_med) for w in weights]


@dataclass(frozen=True)
class NormClip:
    """Scale every vector whose l2 norm exceeds its bound (`clip_bounds`: `factor` x the
    round's median norm, scaled up by its tokens over the median tokens) down to that bound,
    then aggregate with `inner`.

    Relative to the median, so there is no absolute threshold to tune, and an attacker in a
    minority cannot push the median outside the range of honest norms: a x100 contribution
    weighs at most `factor` x (its tokens' share) honest norms. FLAME (Nguyen et al. 2022,
    arXiv 2101.02281) clips to the median norm the same way; the token scaling keeps honest
    peers whose work differs (4x spread of tokens, norms growing with tokens) unclipped.
    factor 0 turns clipping off; a zero vector stays zero; if the median norm is 0, every
    vector is clipped to zero.

    Memory: a clipped vector is copied, so at worst the inputs are held twice.
    ValueError on bad input as in `check_round`, or when a vector's norm is not finite.
    """

    factor: float
    inner: Aggregator = field(default_factory=WeightedMean)

    def __post_init__(self) -> None:
        if not math.isfinite(self.factor) or self.factor < 0:
            raise ValueError(f"clip factor is {self.factor}; need a finite factor >= 0")

    def clip(
        self, vectors: Sequence[torch.Tensor], weights: Sequence[float] | None = None
    ) -> list[torch.Tensor]:
        """The vectors after clipping (unclipped ones are returned as given, not copied);
        weights None means equal weights."""
        if self.factor == 0:
            return list(vectors)
        norms = [l2_norm(v) for v in vectors]
        for i, n in enumerate(norms):
            if not math.isfinite(n):
                raise ValueError(f"vector {i} has norm {n}; values must be finite")
        bounds = clip_bounds(norms, weights or [1.0] * len(vectors), self.factor)
        out = []
        for v, n, bound in zip(vectors, norms, bounds, strict=True):
            if n <= bound:
                out.append(v)
            elif bound == 0:
                out.append(torch.zeros_like(v, dtype=torch.float32))
            else:
                out.append(v.float() * (bound / n))
        return out

    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        check_round(vectors, weights)
        return self.inner(self.clip(vectors, weights), weights)


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


#: reduce(values, weights): n rows each, sorted ascending by (value, weight) per coordinate
Reduce = Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor]


def per_coordinate(
    vectors: Sequence[torch.Tensor], weights: Sequence[float], reduce: Reduce
) -> torch.Tensor:
    """Apply `reduce` to the per-coordinate sorted (value, weight) pairs, a chunk of
    coordinates at a time.

    `reduce` gets n equally long float32 tensors, rows[r][c] being the r-th smallest value
    at coordinate c, and n float64 tensors, wrows[r][c] being the weight of the vector that
    value came from (ties of values are ordered by weight, so the pairs' order depends on
    the pairs alone); it returns one float tensor of that length. The output is float32
    in the vectors' shape; its zeros are +0.0, so the result does not depend on the order
    of the vectors."""
    n = len(vectors)
    flats = [v.detach().reshape(-1) for v in vectors]
    out = torch.empty(flats[0].numel(), dtype=torch.float32, device=flats[0].device)
    chunk = max(1, (_CHUNK_VALUES if out.device.type == "cpu" else _DEVICE_CHUNK_VALUES) // n)
    network = sorting_network(n)
    uniform = all(w == weights[0] for w in weights)
    for start in range(0, out.numel(), chunk):
        rows = [f[start : start + chunk].float() for f in flats]
        width = rows[0].numel()
        if uniform:  # equal weights travel with nothing: min/max is enough
            for i, j in network:
                lo, hi = rows[i], rows[j]
                rows[i], rows[j] = torch.minimum(lo, hi), torch.maximum(lo, hi)
            w0 = torch.full((width,), float(weights[0]), dtype=torch.float64, device=out.device)
            wrows = [w0] * n
        else:
            wrows = [
                torch.full((width,), float(w), dtype=torch.float64, device=out.device)
                for w in weights
            ]
            for i, j in network:
                lo, hi, wlo, whi = rows[i], rows[j], wrows[i], wrows[j]
                swap = (lo > hi) | ((lo == hi) & (wlo > whi))
                rows[i], rows[j] = torch.where(swap, hi, lo), torch.where(swap, lo, hi)
                wrows[i], wrows[j] = torch.where(swap, whi, wlo), torch.where(swap, wlo, whi)
        # -0.0 + 0.0 == +0.0: the network may hand out either zero for a tie of two zeros
        out[start : start + chunk] = reduce(rows, wrows).float().add_(0.0)
    return out.view(vectors[0].shape)


def _cumulative(wrows: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per coordinate, the weight before each sorted position, and the total, summed in
    sorted order (exact for integer token counts below 2^53)."""
    before, cum = [], torch.zeros_like(wrows[0])
    for w in wrows:
        before.append(cum)
        cum = cum + w
    return before, cum


@dataclass(frozen=True)
class TrimmedMean:
    """Token-weighted trimmed mean: per coordinate, sort the values, drop trim_fraction of
    the total weight at each end (cutting through a value's weight where the cut falls),
    and take the weighted mean of what is left (Yin et al. 2018, arXiv 1803.01498, analyse
    the unweighted coordinate-wise trimmed mean, order-optimal against a minority of
    Byzantine workers; with equal weights and trim_fraction x n whole, this is it).

    trim_fraction 0 is exactly WeightedMean. An attacker's value moves a coordinate only
    within the range of values holding the middle (1 - 2 trim) of the weight; so with less
    than trim of the weight it cannot move it outside the honest values' range.
    Accumulates in float64, returns float32. ValueError on bad input as in `check_round`.
    """

    trim_fraction: float

    def __post_init__(self) -> None:
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim fraction is {self.trim_fraction}; need 0 <= trim < 0.5")

    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        check_round(vectors, weights)
        if self.trim_fraction == 0:
            return WeightedMean()(vectors, weights)
        trim = self.trim_fraction

        def mean_of_middle(rows: list[torch.Tensor], wrows: list[torch.Tensor]) -> torch.Tensor:
            before, total = _cumulative(wrows)
            lo_cut = total * trim
            hi_cut = total - lo_cut
            acc = torch.zeros_like(total)
            for v, w, start in zip(rows, wrows, before, strict=True):
                # the part of [start, start + w] inside [lo_cut, hi_cut]
                kept = torch.minimum(start + w, hi_cut).sub_(torch.maximum(start, lo_cut))
                acc.add_(kept.clamp_(min=0).mul_(v))  # ascending order: fixed by the pairs
            return acc.div_(hi_cut - lo_cut)

        return per_coordinate(vectors, weights, mean_of_middle)


@dataclass(frozen=True)
class CoordinateMedian:
    """Token-weighted per-coordinate median: the value at which the cumulative weight of
    the sorted values reaches half the total (Yin et al. 2018, arXiv 1803.01498, for the
    unweighted one). Where half the weight ends exactly between two values (an even count
    of equal weights), the mean of the two, computed as a/2 + b/2: symmetric, and no
    overflow. ValueError on bad input as in `check_round`."""

    def __call__(self, vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        check_round(vectors, weights)

        def middle(rows: list[torch.Tensor], wrows: list[torch.Tensor]) -> torch.Tensor:
            before, total = _cumulative(wrows)
            half = total * 0.5
            lo, hi = rows[-1].clone(), rows[-1].clone()
            lo_found = torch.zeros(lo.shape, dtype=torch.bool, device=lo.device)
            hi_found = lo_found.clone()
            for v, w, start in zip(rows, wrows, before, strict=True):
                end = start + w
                take = ~lo_found & (end >= half)  # first value reaching half the weight
                lo = torch.where(take, v, lo)
                lo_found |= take
                take = ~hi_found & (end > half)  # first value passing it
                hi = torch.where(take, v, hi)
                hi_found |= take
            return lo * 0.5 + hi * 0.5

        return per_coordinate(vectors, weights, middle)


def max_shift(share: float, change: float, trim_fraction: float = 0.0) -> float:
    """The most the aggregate can move when one contribution of weight share `share`
    (w_i / W) moves by `change` (an l2 distance), other inputs fixed, before clipping:
    share x change for the weighted mean, share x change / (1 - 2 trim) for the weighted
    trimmed mean. Why: per coordinate the trimmed mean is the mean of the weighted values'
    quantile function over [trim, 1 - trim]; moving one value by d moves that function by
    d on a set of measure `share` at most (Wasserstein-1 <= share x |d|), so the trimmed
    mean by at most share x |d| / (1 - 2 trim); squared and summed over coordinates, the
    same bound holds in l2. This is what bounds an undetected cheat (covey/bench/
    trust_calibration.py: a re-execution within the tolerance tau lets through a change of
    at most tau / (1 - tau) x the contribution's norm). ValueError on a share outside
    [0, 1], a negative change or a trim outside [0, 0.5)."""
    if not 0 <= share <= 1 or change < 0 or not 0 <= trim_fraction < 0.5:
        raise ValueError(
            f"need 0 <= share <= 1, change >= 0, 0 <= trim < 0.5; got {share}, {change}, "
            f"{trim_fraction}"
        )
    return share * change / (1 - 2 * trim_fraction)


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
