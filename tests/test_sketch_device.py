"""The count sketch's hash tables in torch (covey/trust/sketch_hashing.py): numpy's bits at
any offset, cached while the budget lasts, and sketches with the same bits as before."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from covey.bench.hostsync import HostSyncDetector
from covey.trust import sketch as sk
from covey.trust import sketch_hashing as sh

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    sh.clear()
    yield
    sh.clear()


@pytest.mark.parametrize(
    "start", [0, 1 << 20, (1 << 40) + 7, (1 << 63) - 3, (1 << 64) - sk.SEED - 2]
)
@pytest.mark.parametrize("buckets", [64, 7, 1])
def test_torch_tables_are_numpys(start: int, buckets: int) -> None:
    index, sign = sk._hashing_at(start, 5000, buckets)
    for table in (
        sh.compute_table(start, 5000, buckets, sk.SEED, CPU),  # numpy
        sh.compute_table(start, 5000, buckets, sk.SEED, torch.device("meta")),  # torch's shapes
    ):
        assert table[0].dtype == torch.int32 and table[1].dtype == torch.float32
    # torch's integer ops, run on the CPU: the device path's bits
    with_torch = _torch_table(start, 5000, buckets)
    numpy_made = sh.compute_table(start, 5000, buckets, sk.SEED, CPU)
    for bucket, signs in (with_torch, numpy_made):
        assert torch.equal(bucket.long(), index)
        assert torch.equal(signs.double(), sign)


def _torch_table(start: int, length: int, buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_table`'s torch branch run on CPU tensors (it is what a GPU runs)."""
    base = (start + sk.SEED) % (1 << 64)
    base -= (1 << 64) if base >= 1 << 63 else 0
    h = sh.splitmix64(torch.arange(length, dtype=torch.int64) + base)
    return (sh._srl(h, 1) % buckets).to(torch.int32), 1.0 - 2.0 * (h & 1).to(torch.float32)


def test_tables_are_cached_until_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    first = sh.table(0, 1000, 64, sk.SEED, CPU)
    assert sh.table(0, 1000, 64, sk.SEED, CPU) is first  # not rebuilt
    assert sh.held_bytes(CPU) == 8 * 1000
    monkeypatch.setattr(sh, "TABLE_BUDGET", 8 * 1500)
    sh.table(1000, 1000, 64, sk.SEED, CPU)  # over the budget: made, not kept
    assert sh.held_bytes(CPU) == 8 * 1000
    again = sh.table(1000, 1000, 64, sk.SEED, CPU)
    assert torch.equal(again[0], sh.compute_table(1000, 1000, 64, sk.SEED, CPU)[0])


def reference(vec: torch.Tensor) -> torch.Tensor:
    """The sketch as defined, from numpy's tables over the whole vector."""
    index, sign = sk._hashing_at(0, vec.numel(), sk.BUCKETS)
    out = torch.zeros(sk.BUCKETS, dtype=torch.float64)
    return out.index_add_(0, index, vec.to(torch.float64) * sign)


@pytest.mark.parametrize("budget", [sh.TABLE_BUDGET, 0])
def test_sketch_bits_with_cached_and_computed_tables(
    monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    monkeypatch.setattr(sk, "_BLOCK", 1000)
    monkeypatch.setattr(sh, "TABLE_BUDGET", budget)
    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(n, generator=g) for n in (2500, 1, 999, 4321)]
    parts[1][0] = -0.0
    want = reference(torch.cat(parts))
    for _ in range(2):  # the second time from the cache (when it holds them)
        assert torch.equal(sk.sketch_parts(iter(parts)), want)
    assert sh.held_bytes(CPU) == (8 * sum(p.numel() for p in parts) if budget else 0)


def test_a_device_sketch_moves_only_its_sums_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts on the meta device (a device without values, as the host sees a GPU's): the
    tables are made there and the one device-to-host copy is the sums' own."""
    monkeypatch.setattr(sk, "_BLOCK", 1000)
    detector = HostSyncDetector(raise_on_sync=False)
    with detector:
        out = sk.sketch_parts([torch.empty(2500, device="meta"), torch.empty(7, device="meta")])
    assert out.shape == (sk.BUCKETS,) and out.device == CPU
    assert len(detector.syncs) == 1, detector.syncs
    assert "_to_copy" in detector.syncs[0].op and "sketch.py" in detector.syncs[0].where
    assert sh.held_bytes("meta") == 8 * 2507
