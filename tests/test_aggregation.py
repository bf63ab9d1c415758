"""Tests for covey.algorithms.aggregation: the mean and the robust rules."""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import typing
from collections.abc import Sequence

import pytest
import torch

from covey.algorithms import aggregation
from covey.algorithms.aggregation import (
    Aggregator,
    CoordinateMedian,
    NormClip,
    TrimmedMean,
    WeightedMean,
    build_aggregator,
    l2_norm,
    sorting_network,
)
from covey.config import TrustConfig


def vecs(*rows: Sequence[float]) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).double().norm() / ref.double().norm())


def integer_vectors(n: int, numel: int) -> list[torch.Tensor]:
    """Inputs built from integer arithmetic only: the same bits on every machine."""
    i = torch.arange(numel, dtype=torch.int64)
    return [(((i * (2 * p + 7919) + p * 104729) % 2003) - 1001).float() / 64 for p in range(n)]


ROBUST: list[tuple[str, Aggregator]] = [
    ("trimmed_mean", TrimmedMean(0.25)),
    ("median", CoordinateMedian()),
    ("clip+trimmed_mean", NormClip(2.0, TrimmedMean(0.25))),
    ("clip+median", NormClip(2.0, CoordinateMedian())),
]
ALL: list[tuple[str, Aggregator]] = [
    ("mean", WeightedMean()),
    ("clip+mean", NormClip(2.0, WeightedMean())),
    *ROBUST,
]


# -- exact values ---------------------------------------------------------------------------


def test_trimmed_mean_exact() -> None:
    v = vecs([1, 10], [2, -5], [3, 0], [100, 1])
    # equal weights, 0.25 x 4 = 1 value cut at each end: coordinate 0 keeps (2, 3),
    # coordinate 1 keeps (0, 1)
    assert torch.equal(TrimmedMean(0.25)(v, [1, 1, 1, 1]), torch.tensor([2.5, 0.5]))
    v5 = vecs([1], [7], [-50], [4], [1e6])
    # equal weights, 0.4 x 5 = 2 cut at each end: only the median is left
    assert torch.equal(TrimmedMean(0.4)(v5, [1] * 5), torch.tensor([4.0]))
    # weights 1, 9, 1, 1, 5 (total 17), sorted -50:1, 1:1, 4:1, 7:9, 1e6:5; 0.2 x 17 = 3.4
    # cut at each end: 7 keeps [3.4, 12] = 8.6 of its 9, 1e6 keeps [12, 13.6] = 1.6
    want = (8.6 * 7 + 1.6 * 1e6) / 10.2
    got = float(TrimmedMean(0.2)(v5, [1, 9, 1, 1, 5]))
    assert got == pytest.approx(want, rel=1e-7)
    # the heavy value at the top is cut when it holds less than the trimmed weight
    assert torch.equal(TrimmedMean(0.2)(v5, [1, 9, 1, 1, 3]), torch.tensor([7.0]))
    # a fraction of a value: 3 equal weights at trim 0.25 keep 0.25, 1, 0.25 of them
    v3 = vecs([0], [4], [8])
    assert torch.equal(TrimmedMean(0.25)(v3, [2, 2, 2]), torch.tensor([4.0]))
    assert float(TrimmedMean(0.25)(vecs([0], [4], [40]), [1, 1, 1])) == pytest.approx(
        (0.25 * 0 + 4 + 0.25 * 40) / 1.5, rel=1e-7
    )


def test_weighted_median_exact() -> None:
    odd = vecs([5, -1], [1, -3], [3, 8])
    assert torch.equal(CoordinateMedian()(odd, [1, 1, 1]), torch.tensor([3.0, -1.0]))
    even = vecs([5, -1], [1, -3], [3, 8], [100, 0])
    assert torch.equal(CoordinateMedian()(even, [1, 1, 1, 1]), torch.tensor([4.0, -0.5]))
    # two contributions: the one holding more than half the tokens
    assert torch.equal(CoordinateMedian()(vecs([0], [1]), [1, 100]), torch.tensor([1.0]))
    assert torch.equal(CoordinateMedian()(vecs([0], [1]), [3, 3]), torch.tensor([0.5]))
    # weights 1, 1, 4 (total 6): cumulative 1, 2, 6 passes 3 at the third value
    assert torch.equal(CoordinateMedian()(vecs([1], [2], [9]), [1, 1, 4]), torch.tensor([9.0]))
    # weights 1, 2, 3 with values sorted 1, 2, 9: cumulative 1, 3, 6 -> exactly half at 2
    assert torch.equal(CoordinateMedian()(vecs([9], [1], [2]), [3, 1, 2]), torch.tensor([5.5]))
    # a zero weight is never the median
    assert torch.equal(CoordinateMedian()(vecs([-7], [3]), [0, 5]), torch.tensor([3.0]))
    one = vecs([1.5, -2.0])
    out = CoordinateMedian()(one, [3])
    assert torch.equal(out, one[0]) and out.data_ptr() != one[0].data_ptr()
    # near float32's maximum the two middle values do not overflow
    big = vecs([3e38], [3e38])
    assert torch.equal(CoordinateMedian()(big, [1, 1]), torch.tensor([3e38]))


def test_norm_clip_exact() -> None:
    v = vecs([3, 0], [0, 4], [30, 40])  # norms 3, 4, 50: median 4
    clipped = NormClip(1.0).clip(v)
    assert clipped[0] is v[0] and clipped[1] is v[1]  # within the bound: passed through
    assert torch.allclose(clipped[2], torch.tensor([2.4, 3.2]), rtol=1e-6, atol=0)
    out = NormClip(1.0, WeightedMean())(v, [1, 1, 1])
    assert torch.allclose(out, torch.tensor([1.8, 2.4]), rtol=1e-6, atol=0)
    # factor 2: bound 8, so [30, 40] becomes [4.8, 6.4]
    assert torch.allclose(NormClip(2.0).clip(v)[2], torch.tensor([4.8, 6.4]), rtol=1e-6, atol=0)
    # tokens 1, 1, 5: the third did 5x the median work, so its bound is 5 x 4 = 20
    assert torch.allclose(
        NormClip(1.0).clip(v, [1, 1, 5])[2], torch.tensor([12.0, 16.0]), rtol=1e-6, atol=0
    )


def test_norm_clip_lower_median_for_even_count() -> None:
    v = vecs([1, 0], [0, 2], [3, 0], [0, 4])  # norms 1, 2, 3, 4: lower median 2
    clipped = NormClip(1.0).clip(v)
    assert [round(l2_norm(c), 5) for c in clipped] == [1, 2, 2, 2]
    assert aggregation.clip_bounds([4.0, 1.0, 3.0, 2.0], [1, 1, 1, 1], 1.5) == [3.0] * 4
    # tokens: lower median 20; bounds 1.5 x 2 x max(1, w / 20)
    assert aggregation.clip_bounds([4.0, 1.0, 3.0, 2.0], [10, 20, 40, 80], 1.5) == [
        3.0,
        3.0,
        6.0,
        12.0,
    ]
    # a majority of zero weights: no scaling
    assert aggregation.clip_bounds([1.0, 2.0, 3.0], [0, 0, 7], 1.0) == [2.0] * 3


def test_norm_clip_zero_vectors() -> None:
    v = vecs([0, 0], [3, 4], [6, 8])  # norms 0, 5, 10: median 5
    clipped = NormClip(1.0).clip(v)
    assert torch.equal(clipped[0], torch.zeros(2))
    assert torch.allclose(clipped[2], torch.tensor([3.0, 4.0]), rtol=1e-6, atol=0)
    # a majority of zero vectors: the bound is 0 and everything is clipped to zero
    v = vecs([0, 0], [0, 0], [-3, 4])
    assert torch.equal(NormClip(5.0, WeightedMean())(v, [1, 1, 1]), torch.zeros(2))


def test_norm_clip_factor_zero_is_off() -> None:
    v = vecs([1, 2], [100, -300], [0, 1])
    assert NormClip(0.0).clip(v) == v
    assert torch.equal(NormClip(0.0, TrimmedMean(0.0))(v, [1, 2, 3]), WeightedMean()(v, [1, 2, 3]))


def test_honest_token_spread_is_not_clipped() -> None:
    """Four honest peers with tokens spread 4x whose update norms grow with their tokens
    (+-10%) pass the default clip untouched, with or without an attacker among them; a
    x100 attacker is clipped to its bound. (Clipping to the plain median norm cut the 4x
    peer down: its norm, ~4.4x the smallest, is over 2x the lower median, ~2x.)"""
    rng = random.Random(0)
    clip = NormClip(2.0, TrimmedMean(0.25))
    for case in range(50):
        base = 1000 * rng.randint(1, 8)
        tokens = [base * s for s in (1, 2, 3, 4)]
        rng.shuffle(tokens)
        g = torch.Generator().manual_seed(case)
        honest = []
        for t in tokens:
            x = torch.randn(500, generator=g)
            honest.append(x * (t / base * rng.uniform(0.9, 1.1) / l2_norm(x)))
        if case == 0:  # the lowest and highest of the spread: what the old rule clipped
            honest[tokens.index(base)] *= 0.9 / l2_norm(honest[tokens.index(base)])
            honest[tokens.index(2 * base)] *= 1.9 / l2_norm(honest[tokens.index(2 * base)])
            honest[tokens.index(4 * base)] *= 4.4 / l2_norm(honest[tokens.index(4 * base)])
        clipped = clip.clip(honest, tokens)
        assert all(c is h for c, h in zip(clipped, honest, strict=True)), case
        t_bad = base * rng.choice((1, 2, 3, 4))
        bad = 100 * honest[0] * (t_bad / tokens[0])
        clipped = clip.clip([*honest, bad], [*tokens, t_bad])
        assert all(c is h for c, h in zip(clipped[:4], honest, strict=True)), case
        assert l2_norm(clipped[4]) < 0.1 * l2_norm(bad), case
        bounds = aggregation.clip_bounds(
            [l2_norm(x) for x in [*honest, bad]], [*tokens, t_bad], 2.0
        )
        assert l2_norm(clipped[4]) == pytest.approx(bounds[4], rel=1e-5)


def test_l2_norm_is_exact_float64() -> None:
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1_100_001, generator=g)  # two blocks, the last one ragged
    exact = math.sqrt(math.fsum(x * x for x in v.double().tolist()))
    assert l2_norm(v) == pytest.approx(exact, rel=1e-14)
    assert l2_norm(torch.zeros(0)) == 0.0
    assert l2_norm(torch.full((4,), 3e38)) == pytest.approx(6e38, rel=1e-7)  # no overflow


@pytest.mark.parametrize("n", [*range(1, 19), 31, 33, 64])
def test_sorting_network_sorts(n: int) -> None:
    network = sorting_network(n)
    assert all(0 <= i < j < n for i, j in network)
    rng = random.Random(n)
    # 0-1 principle (Knuth, TAOCP 5.3.4): sorting every 0/1 input proves the network
    inputs = (
        itertools.product((0, 1), repeat=n)
        if n <= 12
        else ([rng.randint(0, 1) for _ in range(n)] for _ in range(2000))
    )
    for x in itertools.chain(inputs, ([rng.random() for _ in range(n)] for _ in range(200))):
        y = list(x)
        for i, j in network:
            if y[i] > y[j]:
                y[i], y[j] = y[j], y[i]
        assert y == sorted(x)


def reference(values: list[float], weights: list[float], trim: float | None) -> float:
    """The definition, in float64 on one coordinate: trimmed mean (trim) or median (None)."""
    pairs = sorted(zip(values, weights, strict=True))
    total = sum(w for _, w in pairs)
    cum = 0.0
    if trim is None:
        lo = next(
            v for i, (v, _) in enumerate(pairs) if sum(w for _, w in pairs[: i + 1]) >= total / 2
        )
        hi = next(
            v for i, (v, _) in enumerate(pairs) if sum(w for _, w in pairs[: i + 1]) > total / 2
        )
        return lo / 2 + hi / 2
    cut_lo, cut_hi, acc = trim * total, total - trim * total, 0.0
    for v, w in pairs:
        acc += max(0.0, min(cum + w, cut_hi) - max(cum, cut_lo)) * v
        cum += w
    return acc / (cut_hi - cut_lo)


@pytest.mark.parametrize("case", range(40))
def test_weighted_rules_match_the_definition(case: int) -> None:
    """Property test on seeded random rounds: contributors, integer token weights (some
    equal, some zero), values with ties, trim fractions; each coordinate against the
    float64 definition."""
    rng = random.Random(case)
    n = rng.randint(1, 12)
    weights = [float(rng.choice((0, 1, 7, 64, 1000, rng.randint(1, 5000)))) for _ in range(n)]
    if sum(weights) == 0:
        weights[0] = 3.0
    if case % 5 == 0:
        weights = [256.0] * n  # the equal-weight path
    numel = 64
    g = torch.Generator().manual_seed(case)
    v = [torch.randn(numel, generator=g) * 10 ** rng.randint(-3, 3) for _ in range(n)]
    for x in v:  # ties
        x[: numel // 4] = torch.round(x[: numel // 4])
    rows = torch.stack(v).double().T.tolist()
    trim = rng.choice((0.05, 0.1, 0.2, 0.25, 0.3, 0.45))
    got_t = TrimmedMean(trim)(v, weights).double()
    got_m = CoordinateMedian()(v, weights).double()
    want_t = torch.tensor([reference(r, weights, trim) for r in rows], dtype=torch.float64)
    want_m = torch.tensor([reference(r, weights, None) for r in rows], dtype=torch.float64)
    assert torch.allclose(got_t, want_t, rtol=1e-6, atol=1e-9), (case, trim, weights)
    assert torch.equal(got_m, want_m.float().double()), (case, weights)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13, 16, 17])
def test_equal_weights_match_a_sort(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    v = [torch.randn(1000, generator=g) for _ in range(n)]
    ranked = torch.stack(v).sort(dim=0).values.double()
    median = ranked[n // 2] if n % 2 else (ranked[n // 2 - 1] + ranked[n // 2]) / 2
    assert torch.allclose(CoordinateMedian()(v, [1] * n).double(), median, rtol=0, atol=1e-6)
    for trim in (0.1, 0.25, 0.4):
        k = trim * n
        if k != int(k) or k == 0:
            continue  # a whole number of values cut: the unweighted trimmed mean
        want = ranked[int(k) : n - int(k)].mean(dim=0)
        got = TrimmedMean(trim)(v, [5] * n).double()
        assert torch.allclose(got, want, rtol=0, atol=1e-6)


def test_a_duplicate_is_a_double_weight() -> None:
    """Weighted rules see tokens, not heads: sending the same vector twice is the same as
    sending it once with twice the tokens."""
    g = torch.Generator().manual_seed(2)
    v = [torch.randn(2000, generator=g) for _ in range(5)]
    w = [3.0, 1.0, 4.0, 1.0, 5.0]
    for agg in (TrimmedMean(0.25), CoordinateMedian(), NormClip(2.0, TrimmedMean(0.2))):
        twice = agg([*v, v[1]], [*w, w[1]])
        doubled = agg(v, [w[0], 2 * w[1], *w[2:]])
        assert torch.allclose(twice, doubled, rtol=1e-6, atol=1e-7), agg


def test_trim_zero_is_weighted_mean_exactly() -> None:
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 8):
        v = [torch.randn(5000, generator=g) for _ in range(n)]
        w = [float(100 + 37 * i) for i in range(n)]
        assert torch.equal(TrimmedMean(0.0)(v, w), WeightedMean()(v, w))


def test_output_dtype_and_shape() -> None:
    v = [torch.arange(6, dtype=torch.float64).view(2, 3) * s for s in (1, 2, 3, 4, 5)]
    before = [x.clone() for x in v]
    for _, agg in ALL:
        out = agg(v, [1] * 5)
        assert out.dtype == torch.float32 and out.shape == (2, 3)
    assert all(torch.equal(x, y) for x, y in zip(v, before, strict=True))  # inputs untouched


# -- determinism ----------------------------------------------------------------------------


# sha256 of the outputs on `integer_vectors(7, 100_003)` with weights 1..7: golden values,
# so a change of summation order (or of semantics) anywhere shows up here
GOLDEN = {
    "mean": "bb7f653e5fea811d0b43f544c53423ca17f8a0936aa3237f47a78cd191a17fc4",
    "clip+mean": "5febf0980380d05057cb645ea4769c2c4f307c367af3664ff70e123481a8df35",
    "trimmed_mean": "220df64e0430999b5e46fb01a6bb3063dde754da1e1761e663b570e458e3ebad",
    "median": "17966bb8e094f628172c1605b4802c2ccc17a7408d21bd3e022812e0eb63af0c",
    "clip+trimmed_mean": "f0361dedcb2db33fa146fef70b92a5cd0eef456aa0854d12b2c473fd8f425c0a",
    "clip+median": "032473a726d63caa525345bf08557e616a7eaf94809b1cc9b9605aa7fc39fe86",
}


@pytest.mark.parametrize(("name", "agg"), ALL, ids=[n for n, _ in ALL])
def test_golden_bytes(name: str, agg: Aggregator) -> None:
    v = integer_vectors(7, 100_003)
    v[3] = v[3] * 50  # so that clipping clips
    assert digest(agg(v, [1, 2, 3, 4, 5, 6, 7])) == GOLDEN[name]


@pytest.mark.parametrize(("name", "agg"), ALL, ids=[n for n, _ in ALL])
def test_same_bytes_across_calls_threads_and_chunks(
    name: str, agg: Aggregator, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(7)
    v = [torch.randn(300_007, generator=g) * (1 + 9 * (i == 2)) for i in range(6)]
    w = [float(i + 1) for i in range(6)]
    first = digest(agg(v, w))
    assert digest(agg(v, w)) == first
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert digest(agg(v, w)) == first
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(aggregation, "_CHUNK_VALUES", 6 * 1001)  # chunks not dividing numel
    assert digest(agg(v, w)) == first


@pytest.mark.parametrize(("name", "agg"), ROBUST, ids=[n for n, _ in ROBUST])
def test_permutation_invariance(name: str, agg: Aggregator) -> None:
    g = torch.Generator().manual_seed(11)
    v = [torch.randn(20_000, generator=g) for _ in range(7)]
    v[4] = v[4] * 100
    for i, x in enumerate(v):  # ties of +0.0 and -0.0 must not make bytes depend on order
        x[:100] = 0.0
        x[i % 3 : 100 : 3] = -0.0
        x[100:200] = float(i % 2)  # ties of values with different weights
    rng = random.Random(0)
    for w in ([1.0] * 7, [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0]):
        want = digest(agg(v, w))
        for _ in range(5):
            perm = rng.sample(range(7), 7)
            assert digest(agg([v[i] for i in perm], [w[i] for i in perm])) == want


# -- robustness -----------------------------------------------------------------------------


def honest_round(numel: int = 50_000) -> list[torch.Tensor]:
    """Three honest pseudo-gradients: a common signal plus independent noise of similar size."""
    g = torch.Generator().manual_seed(5)
    signal = torch.randn(numel, generator=g)
    return [signal + 0.8 * torch.randn(numel, generator=g) for _ in range(3)]


ATTACKS = {
    "sign-flip": lambda h: -h[0],
    "x100": lambda h: 100 * h[0],
    "noise": lambda h: 100 * torch.randn(h[0].numel(), generator=torch.Generator().manual_seed(9)),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("rule", ["trimmed_mean", "median"])
def test_one_attacker_of_four(attack: str, rule: str) -> None:
    honest = honest_round()
    ref = WeightedMean()(honest, [1, 1, 1])
    v = [*honest, ATTACKS[attack](honest)]
    plain = rel_err(WeightedMean()(v, [1] * 4), ref)
    robust = rel_err(build_aggregator(rule, 0.25, 2.0)(v, [1] * 4), ref)
    # measured at 100k elements: mean 0.52 / 28.8 / 22.8, robust 0.32 / 0.33 / 0.32
    assert plain > 0.5
    assert robust < 0.4 and robust < 0.7 * plain


@pytest.mark.parametrize("scale", [10.0, 1e3, 1e6, 1e30])
def test_clipping_bounds_the_deviation(scale: float) -> None:
    """One attacker of weight w_a among honest vectors that clipping leaves alone: the
    clipped mean moves at most w_a / W x (bound + |honest mean|) from the honest mean,
    however large the attack."""
    honest = honest_round(10_000)
    g = torch.Generator().manual_seed(13)
    bad = scale * torch.randn(10_000, generator=g)
    w = [10.0, 20.0, 30.0, 40.0]
    factor = 2.0
    hm = WeightedMean()(honest, w[:3])
    bounds = aggregation.clip_bounds([l2_norm(x) for x in [*honest, bad]], w, factor)
    assert all(l2_norm(h) <= b for h, b in zip(honest, bounds, strict=False))
    bound = bounds[3]
    out = NormClip(factor, WeightedMean())([*honest, bad], w)
    dev = float((out - hm).double().norm())
    assert dev <= w[3] / sum(w) * (bound + float(hm.double().norm())) * (1 + 1e-5)
    # and the aggregate no longer depends on how large the attack was
    ref = NormClip(factor, WeightedMean())([*honest, bad / scale * 1e9], w)
    assert torch.allclose(out, ref, rtol=0, atol=1e-5)


def test_plain_mean_is_unbounded() -> None:
    honest = honest_round(10_000)
    out = WeightedMean()([*honest, 1e6 * honest[0]], [1] * 4)
    assert rel_err(out, WeightedMean()(honest, [1] * 3)) > 1e4


# -- configuration and errors ---------------------------------------------------------------


def test_build_aggregator_from_config() -> None:
    cfg = TrustConfig()
    assert build_aggregator(cfg.aggregation, cfg.trim_fraction, cfg.clip_factor) == NormClip(
        2.0, TrimmedMean(0.25)
    )
    assert build_aggregator("mean", 0.25, 0.0) == WeightedMean()
    assert build_aggregator("median", 0.25, 3.0) == NormClip(3.0, CoordinateMedian())
    assert build_aggregator("trimmed_mean", 0.1, 0.0) == TrimmedMean(0.1)
    names = typing.get_args(TrustConfig.model_fields["aggregation"].annotation)
    assert set(names) == set(aggregation.AGGREGATIONS)
    for name in names:
        build_aggregator(name, 0.25, 2.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"aggregation": "krum", "trim_fraction": 0.25, "clip_factor": 2.0}, "unknown aggregation"),
        ({"aggregation": "trimmed_mean", "trim_fraction": 0.5, "clip_factor": 2.0}, "trim"),
        ({"aggregation": "trimmed_mean", "trim_fraction": -0.1, "clip_factor": 2.0}, "trim"),
        ({"aggregation": "mean", "trim_fraction": 0.25, "clip_factor": -1.0}, "clip factor"),
        ({"aggregation": "mean", "trim_fraction": 0.25, "clip_factor": math.inf}, "clip factor"),
        ({"aggregation": "mean", "trim_fraction": 0.25, "clip_factor": math.nan}, "clip factor"),
    ],
)
def test_build_aggregator_errors(kwargs: dict[str, typing.Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_aggregator(**kwargs)


BAD_ROUNDS: list[tuple[list[torch.Tensor], list[float], str]] = [
    ([], [], "no vectors"),
    (vecs([1.0], [2.0]), [1.0], "2 vectors but 1 weights"),
    (vecs([1.0], [2.0, 3.0]), [1.0, 1.0], r"vector 1 has shape \(2,\), vector 0 \(1,\)"),
    (vecs([1.0], [2.0]), [1.0, -1.0], "weight 1 is -1.0"),
    (vecs([1.0], [2.0]), [math.nan, 1.0], "weight 0 is nan"),
    (vecs([1.0], [2.0]), [math.inf, 1.0], "weight 0 is inf"),
    (vecs([1.0], [2.0]), [1e308, 1e308], "weights sum to inf"),
    (vecs([1.0], [2.0]), [0.0, 0.0], "weights sum to 0.0"),
]


@pytest.mark.parametrize(("name", "agg"), ALL, ids=[n for n, _ in ALL])
@pytest.mark.parametrize(("vectors", "weights", "match"), BAD_ROUNDS)
def test_bad_rounds(
    name: str, agg: Aggregator, vectors: list[torch.Tensor], weights: list[float], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        agg(vectors, weights)


def test_norm_clip_refuses_non_finite_values() -> None:
    v = vecs([1.0, 2.0], [math.inf, 0.0], [0.5, 0.5])
    with pytest.raises(ValueError, match="vector 1 has norm inf"):
        NormClip(2.0, WeightedMean())(v, [1, 1, 1])


# -- whole rounds: the canonical weights hash on 1 and 2 threads ----------------------------


def test_ddp_clip_norm_is_exact() -> None:
    """DDP clips the averaged gradient with a norm that is exact float64 (math.fsum of
    exact squares), not torch's thread- and SIMD-dependent float32 reduction."""
    from covey.algorithms.ddp import clip_global_norm_, global_norm

    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(n, generator=g) for n in (70_001, 3, 1_200_000)]
    exact = math.sqrt(math.fsum(x * x for t in grads for x in t.double().tolist()))
    assert global_norm(grads) == pytest.approx(exact, rel=1e-15)
    before = [t.clone() for t in grads]
    assert clip_global_norm_(grads, 1.0) == global_norm(before)
    scale = 1.0 / (global_norm(before) + 1e-6)
    assert all(torch.equal(a, b * scale) for a, b in zip(grads, before, strict=True))
    assert clip_global_norm_(grads, 0.0) == pytest.approx(1.0, rel=1e-6)  # 0 = off


ROUNDS = {
    "ddp-clip": {"method": "ddp", "optim": {"grad_clip": 0.5}},
    "diloco-dct": {"method": "diloco", "inner_steps": 2, "codec": "dct:64:8"},
    "demo-dct2": {"method": "demo", "chunk": 16, "dims": 2, "topk": 16, "values": "fp32"},
}


@pytest.mark.parametrize("method", list(ROUNDS))
def test_round_weights_hash_same_on_1_and_2_threads(method: str) -> None:
    """The same accepted set gives the same new weights hash whatever the thread count:
    decode, token-weighted robust aggregation, clip and outer step together. Contributions
    carry unequal tokens (1x..4x) and one is an attacker, so every branch runs."""
    import copy

    from pydantic import TypeAdapter

    from covey.algorithms import Contribution, build_strategy
    from covey.config import AlgorithmConfig
    from covey.models.gpt import GPT, gpt_config, lm_loss

    cfg = TypeAdapter(AlgorithmConfig).validate_python(ROUNDS[method])
    torch.manual_seed(0)
    model = GPT(gpt_config("nano"))
    agg = build_aggregator(
        **TrustConfig().model_dump(include={"aggregation", "trim_fraction", "clip_factor"})
    )
    s = build_strategy(cfg, copy.deepcopy(model), lm_loss, agg)
    start = s.init_state()
    numel = sum(p.numel() for p in start.params.values())
    g = torch.Generator().manual_seed(1)
    contributions = [
        Contribution(s.codec.encode(torch.randn(numel, generator=g) * k * 1e-2), 512 * k, 1)
        for k in (1, 2, 3, 4)
    ]
    contributions.append(
        Contribution(s.codec.encode(torch.randn(numel, generator=g) * 5.0), 1024, 1)
    )
    threads = torch.get_num_threads()
    digests = []
    try:
        for t in (1, 2, 1, 2):
            torch.set_num_threads(t)
            digests.append(s.apply_round(start, contributions).digest())
    finally:
        torch.set_num_threads(threads)
    assert len(set(digests)) == 1, digests


@pytest.mark.parametrize("case", range(30))
def test_one_contribution_moves_the_aggregate_at_most_max_shift(case: int) -> None:
    """Property test of the bound behind the re-execution tolerance: a contribution
    changed by ||d|| (a cheat within tolerance, or honest non-determinism) moves the
    weighted mean by <= share x ||d|| and the weighted trimmed mean by
    <= share x ||d|| / (1 - 2 trim)."""
    rng = random.Random(case)
    n = rng.randint(2, 9)
    g = torch.Generator().manual_seed(case)
    v = [torch.randn(3000, generator=g) for _ in range(n)]
    w = [float(rng.randint(1, 100)) for _ in range(n)]
    i = rng.randrange(n)
    d = torch.randn(3000, generator=g) * rng.choice((1e-3, 0.02, 1.0, 30.0))
    moved = [x + d if j == i else x for j, x in enumerate(v)]
    share, change = w[i] / sum(w), l2_norm(moved[i] - v[i])
    for trim in (0.0, 0.1, 0.25, 0.4):
        agg = TrimmedMean(trim)
        shift = l2_norm(agg(moved, w) - agg(v, w))
        bound = aggregation.max_shift(share, change, trim)
        assert shift <= bound * (1 + 1e-4) + 1e-6, (case, trim, shift, bound)
