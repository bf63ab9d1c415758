"""A peer's memory (issue 13, section 3): a round's update holds model + one decoded
contribution + the new state, not N contributions, a model-sized product or dead heap.

RSS is the kernel's count (/proc/self/status): torch allocates outside what tracemalloc
sees. The peak is reset before the measured phase (/proc/self/clear_refs), in process.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from covey.algorithms import Contribution, TrainState, build_strategy
from covey.algorithms.aggregation import WeightedMean
from covey.algorithms.lazy_aggregation import _BLOCK_VALUES, aggregate_lazily, drop_mapped_pages
from covey.config import DiLoCoConfig
from covey.memory import bound_heap, reset_peak, rss_mib, shapes_only
from covey.protocol.checkpoint import CheckpointError, state_from_file, state_to_file

linux = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc")


def _mapped(path: Path) -> memoryview:
    with open(path, "rb") as f:  # as BlobStore.view maps a stored blob
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def test_the_mean_in_blocks_has_the_rules_bits() -> None:
    gen = torch.Generator().manual_seed(3)
    n = _BLOCK_VALUES + 1003  # a block and a tail
    vectors = [torch.randn(n, generator=gen) * s for s in (1.0, 1e-3, 7.0)]
    weights = [3.0, 1.0, 11.0]
    want = WeightedMean()(vectors, weights)
    got = aggregate_lazily(WeightedMean(), 3, lambda i: vectors[i], weights)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@linux
def test_a_decoded_payloads_pages_are_let_go(tmp_path: Path) -> None:
    path = tmp_path / "payload"
    data = np.random.default_rng(0).integers(0, 255, 48 << 20, dtype=np.uint8)
    data.tofile(path)
    view = _mapped(path)
    before = rss_mib()["RssFile"]
    total = int(np.frombuffer(view, dtype=np.uint8).sum(dtype=np.int64))  # touch every page
    assert rss_mib()["RssFile"] - before > 40, "reading a mapped payload maps its pages in"
    drop_mapped_pages(view)
    assert rss_mib()["RssFile"] - before < 8
    assert int(np.frombuffer(view, dtype=np.uint8).sum(dtype=np.int64)) == total  # re-read
    drop_mapped_pages(memoryview(b"abc"))  # not a mapping: nothing to do, no error


def test_a_shapes_only_template_checks_states_and_holds_no_bytes(tmp_path: Path) -> None:
    state = TrainState({"w": torch.randn(64, 8), "b": torch.zeros(8)}, {}, 2)
    template = shapes_only(state)
    assert all(t.device.type == "meta" for t in template.params.values())
    path = tmp_path / "state"
    state_to_file(state, path)
    assert state_from_file(path, template).digest() == state.digest()
    wrong = TrainState({"w": torch.randn(8, 64), "b": torch.zeros(8)}, {}, 2)
    state_to_file(wrong, path)
    with pytest.raises(CheckpointError, match="expected"):
        state_from_file(path, template)


@linux
def test_a_rounds_update_holds_one_contribution_not_two(tmp_path: Path) -> None:
    """DiLoCo's apply_round of two mapped 32 MiB contributions: before this work the peak
    was ~5.1 model sizes above the start (N decoded payload pages, a model-sized product,
    heap kept after the per-tensor updates); now the sum (1), one decoded contribution (1)
    and the new weights + momentum (2) less what is freed between: measured 3.3-3.4."""
    assert bound_heap()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    size = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    cfg = DiLoCoConfig(method="diloco", inner_steps=1)
    strategy = build_strategy(cfg, model, lambda m, b: m(b).pow(2).mean())
    state = strategy.init_state()
    strategy.load_state(state)
    strategy.inner_step(torch.randn(4, 1024))
    paths = [tmp_path / f"c{i}" for i in range(2)]
    payload = strategy.make_contribution().payload
    for p in paths:  # two files: two mappings, as two stored contributions are
        p.write_bytes(payload)
    del payload
    contributions = [Contribution(_mapped(p), 100, 1, None) for p in paths]
    start = rss_mib()["VmRSS"]
    assert reset_peak()
    new = strategy.apply_round(state, contributions)
    peak = (rss_mib()["VmHWM"] - start) / size
    assert new.round == 1 and set(new.outer) == {f"momentum/{n}" for n in new.params}
    assert peak < 3.9, f"apply_round peaked {peak:.2f} model sizes above its start"
