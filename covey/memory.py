"""A peer's memory (docs/memory.md): as the kernel counts it, a heap that gives freed
tensors back, and a template that costs no memory.

torch allocates outside Python's heap, so tracemalloc does not see model tensors; these
read /proc/self/status instead (Linux; elsewhere the figures are 0). `reset_peak` makes
VmHWM restart from the current RSS, so a phase's own peak can be measured.
`weightless_copy` and `borrowed_weights` let a model run on a state's tensors without a
model-sized copy of its own (the coordinator's evaluation model).
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

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


def all_finite(t: torch.Tensor, block: int = 1 << 20) -> bool:
    """`torch.isfinite(t).all()`, a block of elements at a time: isfinite makes |t| and
    two masks, 1.5 times t's size at once (a model size of a 124M model's vector)."""
    flat = t.reshape(-1)
    return all(
        bool(torch.isfinite(flat[i : i + block]).all()) for i in range(0, flat.numel(), block)
    )


def shapes_only(state: TrainState) -> TrainState:
    """`state` with every tensor on the meta device: the names, shapes and dtypes a
    template is checked for (covey.protocol.checkpoint), and no bytes. A peer keeps this
    instead of a model-sized copy of the round-0 weights."""
    meta = lambda d: {k: torch.empty_like(v, device="meta") for k, v in d.items()}  # noqa: E731
    return TrainState(meta(state.params), meta(state.outer), state.round)


def weightless_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters hold no bytes (empty tensors of their dtype;
    tied parameters stay one parameter); buffers are copied. Run it only inside
    `borrowed_weights`: the coordinator's evaluation model is this, not a second model
    size next to the strategy's."""
    memo: dict[int, object] = {
        id(p): nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), p.requires_grad)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


@contextmanager
def borrowed_weights(model: nn.Module, params: Mapping[str, torch.Tensor]) -> Iterator[nn.Module]:
    """Inside, each of `model`'s parameters is `params[name]`'s own tensor, not a copy of
    it (a state's tensors are never changed in place: use the model for forward passes
    under torch.no_grad only); on leaving, empty tensors again, so the model keeps no
    reference to them. KeyError for a parameter `params` lacks, nothing lent then;
    RuntimeError (torch's) for a tensor of another device or dtype."""
    named = list(model.named_parameters())
    lent = [params[name] for name, _ in named]  # every name first: all or nothing
    try:
        for (_, p), t in zip(named, lent, strict=True):
            p.data = t
        yield model
    finally:
        for _, p in named:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
