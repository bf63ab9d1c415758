"""aggregate_lazily: the same bits as the aggregation rules, one contribution in memory."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from covey.algorithms import lazy_aggregation
from covey.algorithms.aggregation import AGGREGATIONS, build_aggregator
from covey.algorithms.lazy_aggregation import aggregate_lazily


def vectors(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(numel, generator=g) * (1 + i) for i in range(n)]
    out[0][:7] = 0.0  # ties of zeros: the per-coordinate rules' +0.0 rule
    if n > 2:
        out[-1] = out[-1] * 50  # one outlier the clip must cut
    return out


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("clip", [0.0, 2.0])
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_same_bits_as_the_rule(
    aggregation: str, clip: float, uniform: bool, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lazy_aggregation, "_BLOCK_VALUES", 1000)  # many blocks, ragged end
    vs = vectors(n, 4099, seed=n)
    weights = [1.0] * n if uniform else [float(3 + 2 * i) for i in range(n)]
    rule = build_aggregator(aggregation, 0.25, clip)
    want = rule(vs, weights)
    got = aggregate_lazily(rule, n, lambda i: vs[i].clone(), weights)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit, +0.0 too


def test_one_loaded_vector_alive_at_a_time(tmp_path: Path) -> None:
    """Counted by finalizers: CPython frees a tensor as its last reference goes."""
    alive: set[int] = set()
    most = 0
    vs = vectors(6, 10_000, seed=1)

    def load(i: int) -> torch.Tensor:
        nonlocal most
        t = vs[i].clone()
        alive.add(id(t))
        weakref.finalize(t, alive.discard, id(t))
        most = max(most, len(alive))
        return t

    for aggregation in AGGREGATIONS:
        for clip in (0.0, 2.0):
            most = 0
            aggregate_lazily(build_aggregator(aggregation, 0.25, clip), 6, load, [1.0] * 6,
                             spill_dir=tmp_path)  # fmt: skip
            assert most == 1, (aggregation, clip, most)
    assert list(tmp_path.iterdir()) == []  # spill files removed


def test_bad_input_is_refused_as_the_rules_refuse_it() -> None:
    rule = build_aggregator("trimmed_mean", 0.25, 2.0)
    with pytest.raises(ValueError, match="no vectors"):
        aggregate_lazily(rule, 0, lambda i: torch.zeros(3), [])
    with pytest.raises(ValueError, match="2 vectors but 1 weights"):
        aggregate_lazily(rule, 2, lambda i: torch.zeros(3), [1.0])
    with pytest.raises(ValueError, match="vector 1 has shape"):
        aggregate_lazily(rule, 2, lambda i: torch.zeros(3 + i), [1.0, 1.0])
    with pytest.raises(ValueError, match="weight 0 is -1"):
        aggregate_lazily(rule, 2, lambda i: torch.zeros(3), [-1.0, 1.0])
    bad = torch.tensor([float("inf"), 0.0])
    with pytest.raises(ValueError, match="norm"):
        aggregate_lazily(rule, 2, lambda i: bad, [1.0, 1.0])
