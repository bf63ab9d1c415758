"""Aggregation that holds one decoded contribution at a time (docs/memory.md).

`aggregate_lazily(aggregator, n, load, weights)` returns exactly what
`aggregator([load(0), ..., load(n-1)], weights)` returns, bit for bit, while a peer's memory
stays about model + optimizer + one contribution, never N of them:

    WeightedMean        one pass: each vector is loaded, added (same order, same ops) a
                        16 MiB block at a time (no model-sized product), dropped
    NormClip(f, inner)  a first pass loads each vector for its norm only; the second applies
                        the clip as each vector is loaded again and hands it to `inner`
    TrimmedMean,        these need all N values of a coordinate at once: each vector is
    CoordinateMedian    loaded once and spilled to a scratch file, then the rule runs on
                        blocks of coordinates read back from the N files (pread, not mmap,
                        so the files' pages never count as the process's memory)

Per-coordinate rules act on each coordinate alone, with element-wise IEEE operations whose
result does not depend on where a value sits in a tensor (covey.algorithms.aggregation's
determinism rules), so a block of the output equals that block of the whole computation.
Any other aggregator gets the N vectors materialized, as before. `load(i)` may be called
twice for a clipped rule: it must return the same vector each time (decoding does).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from covey.algorithms.aggregation import (
    Aggregator,
    CoordinateMedian,
    NormClip,
    TrimmedMean,
    WeightedMean,
    check_round,
    clip_bounds,
    l2_norm,
)

#: coordinates x contributors read back per block by the per-coordinate rules (16 MiB)
_BLOCK_VALUES = 4 << 20

Load = Callable[[int], torch.Tensor]


def aggregate_lazily(
    aggregator: Aggregator,
    n: int,
    load: Load,
    weights: Sequence[float],
    *,
    spill_dir: str | Path | None = None,
    spill: bool = True,
) -> torch.Tensor:
    """`aggregator([load(i) for i in range(n)], weights)`, holding one loaded vector at a
    time where the rule allows (see the module docstring); `spill_dir` holds the scratch
    files of per-coordinate rules (default: the system's temporary directory; removed
    after). `spill` False: per-coordinate rules keep the n loaded vectors where `load`
    put them (a device's memory: nothing is copied to the host). ValueError as
    `check_round` raises it (no vectors, a weight count other than n,
    differing shapes, bad weights), or as the rule raises it."""
    if n < 1:
        raise ValueError("no vectors to aggregate")
    if len(weights) != n:
        raise ValueError(f"{n} vectors but {len(weights)} weights")
    shape = _Shape()
    checked = lambda i: shape.check(i, load(i))  # noqa: E731 -- every vector passes the check
    if isinstance(aggregator, WeightedMean) or (
        isinstance(aggregator, TrimmedMean) and aggregator.trim_fraction == 0
    ):
        return _mean(checked, n, weights)
    if isinstance(aggregator, NormClip):
        return _clipped(aggregator, checked, n, weights, spill_dir, spill)
    if isinstance(aggregator, (TrimmedMean, CoordinateMedian)) and spill:
        return _by_blocks(aggregator, checked, n, weights, spill_dir)
    return aggregator([checked(i) for i in range(n)], weights)


class _Shape:
    """The first vector's shape; every later one must match (check_round's message)."""

    def __init__(self) -> None:
        self.shape: torch.Size | None = None

    def check(self, i: int, v: torch.Tensor) -> torch.Tensor:
        if self.shape is None:
            self.shape = v.shape
        elif v.shape != self.shape:
            raise ValueError(f"vector {i} has shape {tuple(v.shape)}, vector 0 {tuple(self.shape)}")
        return v


def _check_weights(weights: Sequence[float]) -> float:
    """The total of `weights`, checked as `check_round` checks them."""
    probe = [torch.zeros(0)] * len(weights)  # shapes are checked as vectors arrive
    return check_round(probe, weights)


def _mean(load: Load, n: int, weights: Sequence[float]) -> torch.Tensor:
    """WeightedMean, one vector at a time: the same multiply-then-add in the same order."""
    total = _check_weights(weights)
    out: torch.Tensor | None = None
    for i in range(n):
        v = load(i)
        if out is None:
            out = torch.zeros_like(v, dtype=torch.float32)
        _scaled_add(out, v, weights[i] / total)
        del v
    assert out is not None
    return out


def _scaled_add(out: torch.Tensor, v: torch.Tensor, w: float) -> None:
    """`out.add_(v.float() * w)` a block of _BLOCK_VALUES at a time: the product's
    temporary is 16 MiB, not a model-sized vector. Element-wise multiply, then add, as
    WeightedMean does: every element's two roundings are the same, so the bits are too."""
    if not out.is_contiguous():  # zeros_like kept a strided layout: no flat view
        out.add_(v.float() * w)
        return
    flat_out, flat_v = out.view(-1), v.reshape(-1)
    for start in range(0, flat_out.numel(), _BLOCK_VALUES):
        end = start + _BLOCK_VALUES
        flat_out[start:end].add_(flat_v[start:end].float() * w)


def _clipped(
    rule: NormClip,
    load: Load,
    n: int,
    weights: Sequence[float],
    spill_dir: str | Path | None,
    spill: bool = True,
) -> torch.Tensor:
    """NormClip: norms in a first pass, then the clip applied as each vector is loaded again."""
    _check_weights(weights)
    if rule.factor == 0:
        return aggregate_lazily(rule.inner, n, load, weights, spill_dir=spill_dir, spill=spill)
    norms = []
    for i in range(n):
        norms.append(l2_norm(load(i)))
        if not math.isfinite(norms[-1]):
            raise ValueError(f"vector {i} has norm {norms[-1]}; values must be finite")
    bounds = clip_bounds(norms, weights, rule.factor)

    def clipped(i: int) -> torch.Tensor:
        v = load(i)
        if norms[i] <= bounds[i]:
            return v
        if bounds[i] == 0:
            return torch.zeros_like(v, dtype=torch.float32)
        return v.float() * (bounds[i] / norms[i])

    return aggregate_lazily(rule.inner, n, clipped, weights, spill_dir=spill_dir, spill=spill)


def _by_blocks(
    rule: Aggregator, load: Load, n: int, weights: Sequence[float], spill_dir: str | Path | None
) -> torch.Tensor:
    """A per-coordinate rule over vectors spilled to disk, a block of coordinates at a time."""
    _check_weights(weights)
    with tempfile.TemporaryDirectory(prefix="covey-aggregate-", dir=spill_dir) as scratch:
        paths, shape, numel, device = [], None, 0, torch.device("cpu")
        for i in range(n):
            v = load(i)
            shape, numel, device = v.shape, v.numel(), v.device
            path = Path(scratch) / f"{i}.f32"
            v.detach().reshape(-1).float().cpu().numpy().tofile(path)
            paths.append(path)
            del v
        assert shape is not None
        out = torch.empty(numel, dtype=torch.float32, device=device)
        block = max(1, _BLOCK_VALUES // n)
        files = [os.open(p, os.O_RDONLY) for p in paths]
        try:
            for start in range(0, numel, block):
                width = min(block, numel - start)
                rows = [_read(fd, start, width).to(device) for fd in files]
                out[start : start + width] = rule(rows, weights)
        finally:
            for fd in files:
                os.close(fd)
    return out.view(shape)


def _read(fd: int, start: int, width: int) -> torch.Tensor:
    """`width` float32 values from offset `start` (in values) of an open spill file."""
    raw = os.pread(fd, 4 * width, 4 * start)
    if len(raw) != 4 * width:
        raise OSError(f"spill file: read {len(raw)} of {4 * width} bytes at value {start}")
    return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy())


def drop_mapped_pages(payload: object) -> None:
    """Let go of the pages a decode touched in a payload mapped from a file (a memoryview
    of an mmap, as BlobStore.view makes): read pages otherwise stay in the process's
    resident set until unmapped, N contributions' worth by the end of a round. The data
    stays on disk (and in the page cache); a later read maps it in again. Anything else
    is left alone."""
    obj = payload.obj if isinstance(payload, memoryview) else None
    if isinstance(obj, mmap.mmap) and hasattr(obj, "madvise"):
        with contextlib.suppress(OSError, ValueError):  # closed, or refused: only memory
            obj.madvise(mmap.MADV_DONTNEED)
