"""The count sketch's hashing (covey/trust/sketch.py) in torch, on the device of the vector
being sketched, with the tables kept between commitments.

splitmix64 is computed on int64 with wrapping multiplication; a logical right shift is an
arithmetic shift masked to the bits that were shifted in, so the tables are bit for bit
numpy's uint64 ones (tests/test_sketch_device.py checks them at small and large offsets).

A table for coordinates [start, start + length) is a bucket index (int32) and a sign
(float32 +-1; x * sign is exact in any float dtype): 8 bytes per coordinate. Tables are
cached per (device, start, length, buckets) until `TABLE_BUDGET` bytes per device are
held; coordinates beyond that have their table computed when they are sketched (on a GPU
a dozen element-wise integer passes) and dropped. Filling up and never evicting, rather
than least-recently-used: the sketch walks the same blocks in the same order every time,
which an LRU cache smaller than the walk would miss on every block.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

#: bytes of cached tables per device (134M coordinates); the rest are computed per use
TABLE_BUDGET = 1 << 30
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # the splitmix64 multipliers as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)

_lock = threading.Lock()  # commitments are sketched on a side thread (covey/peer/overlap.py)
_tables: dict[tuple[str, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
_held: dict[str, int] = {}


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns: x >>> k."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer on int64 bit patterns (wrapping), as sketch._splitmix64."""
    x = x ^ _srl(x, 30)
    x = x * _M1
    x = x ^ _srl(x, 27)
    x = x * _M2
    return x ^ _srl(x, 31)


def splitmix64_np(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 (wrapping arithmetic): a bijective integer hash."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def compute_table(
    start: int, length: int, buckets: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket int32, sign float32) of coordinates start..start+length-1 on device: made
    with numpy for the CPU (a few times faster there than torch's int64 kernels), with
    torch on any other device (the same bits)."""
    if device.type == "cpu":
        first = np.uint64((start + seed) % (1 << 64))
        with np.errstate(over="ignore"):
            hn = splitmix64_np(np.arange(length, dtype=np.uint64) + first)
        bucket = ((hn >> np.uint64(1)) % np.uint64(buckets)).astype(np.int32)
        sign = np.float32(1) - np.float32(2) * (hn & np.uint64(1)).astype(np.float32)
        return torch.from_numpy(bucket), torch.from_numpy(sign)
    base = (start + seed) % (1 << 64)  # uint64 wrap, then the same bits as int64
    if base >= 1 << 63:
        base -= 1 << 64
    h = splitmix64(torch.arange(length, dtype=torch.int64, device=device) + base)
    sign = 1.0 - 2.0 * (h & 1).to(torch.float32)
    return (_srl(h, 1) % buckets).to(torch.int32), sign


def table(
    start: int, length: int, buckets: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_table`, cached while the device's budget lasts."""
    key = (str(device), start, length, buckets)
    with _lock:
        hit = _tables.get(key)
    if hit is not None:
        return hit
    made = compute_table(start, length, buckets, seed, device)
    with _lock:
        if _held.get(key[0], 0) + 8 * length <= TABLE_BUDGET and key not in _tables:
            _tables[key] = made
            _held[key[0]] = _held.get(key[0], 0) + 8 * length
    return made


def clear() -> None:
    """Drop every cached table (tests; a process that stops committing)."""
    with _lock:
        _tables.clear()
        _held.clear()


def held_bytes(device: torch.device | str) -> int:
    """Bytes of tables cached on a device."""
    with _lock:
        return _held.get(str(torch.device(device)), 0)
