"""Count sketches of big vectors, a block at a time: the same bits as one
table over the whole vector, without a model-sized index/sign table or concatenation."""

from __future__ import annotations

import pytest
import torch

from covey.trust import sketch as sk


def reference(vec: torch.Tensor, buckets: int = sk.BUCKETS) -> torch.Tensor:
    """The sketch as defined: one index/sign table over every coordinate."""
    index, sign = sk._hashing_at(0, vec.numel(), buckets)
    out = torch.zeros(buckets, dtype=torch.float64)
    return out.index_add_(0, index, vec.to(torch.float64) * sign)


def test_blocked_sketch_has_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sk, "_BLOCK", 1000)  # many blocks, parts straddling them
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(n, generator=g) for n in (2500, 1, 999, 1000, 4321)]
    whole = torch.cat(parts)
    want = reference(whole)
    assert torch.equal(sk.sketch(whole), want)
    assert torch.equal(sk.sketch_parts(iter(parts)), want)  # a generator: parts one at a time
    assert torch.equal(sk.sketch_parts([]), torch.zeros(sk.BUCKETS, dtype=torch.float64))


def test_commitment_of_sketches_parameter_by_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sk, "_BLOCK", 700)
    g = torch.Generator().manual_seed(4)
    start = {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate((900, 50, 1600))}
    local = {f"param/{k}": v + 0.1 for k, v in start.items()}
    local |= {f"optim/{k}/exp_avg": v * 2 for k, v in start.items()}
    c = sk.commitment_of(local, start, 3)
    deltas = torch.cat([(local[f"param/{k}"] - start[k]) for k in sorted(start)])
    assert c.sketch["params"] == tuple(reference(deltas).tolist())
    moments = torch.cat([local[f"optim/{k}/exp_avg"] for k in sorted(start)])
    assert c.sketch["optim"] == tuple(reference(moments).tolist())
