"""A peer's memory (issue 13 section 3): as the kernel counts it, a heap that gives freed
tensors back, and a template that costs no memory.

torch allocates outside Python's heap, so tracemalloc does not see model tensors; these
read /proc/self/status instead (Linux; elsewhere the figures are 0). `reset_peak` makes
VmHWM restart from the current RSS, so a phase's own peak can be measured.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import torch

from covey.algorithms import TrainState

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def rss_mib() -> dict[str, float]:
    """VmRSS, VmHWM (peak), RssAnon and RssFile of this process in MiB; zeros where
    /proc/self/status cannot be read (not Linux)."""
    out = dict.fromkeys(_FIELDS, 0.0)
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in out:
            out[key] = int(rest.split()[0]) / 1024  # kB
    return out


def reset_peak() -> bool:
    """Restart VmHWM from the current RSS (writes 5 to /proc/self/clear_refs); False where
    the kernel does not allow it (the peak then stays the process's lifetime peak)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


#: allocations from this size up get their own mapping, returned to the kernel when freed
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def bound_heap(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes. By default glibc raises it to
    the size of each mapped block freed (up to 32 MiB), after which the per-tensor
    temporaries of a state update (1-10 MiB each for a 124M model) come from the heap
    and stay there once freed: measured 0.5-0.7 model sizes of dead memory held after
    a round's update (scripts/mem_phases.py). False where there is no glibc (nothing
    changes then)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def shapes_only(state: TrainState) -> TrainState:
    """`state` with every tensor on the meta device: the names, shapes and dtypes a
    template is checked for (covey.protocol.checkpoint), and no bytes. A peer keeps this
    instead of a model-sized copy of the round-0 weights."""
    meta = lambda d: {k: torch.empty_like(v, device="meta") for k, v in d.items()}  # noqa: E731
    return TrainState(meta(state.params), meta(state.outer), state.round)
