"""Tensors a strategy keeps on the host beside a device: the round's start weights, error
feedback's residuals. Next to a CUDA device they are page-locked (pinned), so that copies
between them and the device are DMA transfers that need not stall the host; next to any
other device (the CPU itself, the meta device in tests) the same code runs unpinned.

What stays on the device during inner steps is then the model, its gradients and the inner
optimizer's moments (tests/test_device_memory.py counts it).
"""

from __future__ import annotations

import torch

#: elements moved at a time by `add_from_host` (64 MiB of float32)
CHUNK = 1 << 24


def _pin(device: torch.device) -> bool:
    return device.type == "cuda"


def home_of(start: list[torch.Tensor], device: torch.device) -> torch.device:
    """Where error feedback's residuals live beside a round's start weights: on `device`
    when the start weights are there already (the simulator on a GPU keeps every state on
    it: nothing goes to the host), else on the host."""
    if start and all(t.device == device for t in start):
        return device
    return torch.device("cpu")


def zeros_at(numel: int, home: torch.device, device: torch.device) -> torch.Tensor:
    """float32 zeros at `home`, pinned when that is the host beside a CUDA `device`."""
    if home.type != "cpu":
        return torch.zeros(numel, device=home)
    return torch.zeros(numel, pin_memory=_pin(device))


def moved_to(
    t: torch.Tensor, home: torch.device, device: torch.device, copy: bool = False
) -> torch.Tensor:
    """`t` at `home` (pinned when that is the host beside a CUDA `device`): `t` itself when
    it is there already and not `copy`, else a copy in its own memory."""
    if t.device == home and not copy:
        return t
    if home.type != "cpu":
        return t.detach().to(home, copy=True)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=_pin(device))
    out.copy_(t.detach())
    return out


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` itself when it is on `device`, or on the host and either pinned already or
    `device` is not CUDA; else a pinned host copy of it."""
    if t.device == device or t.device.type != "cpu" or not _pin(device) or t.is_pinned():
        return t
    return t.pin_memory()


def add_from_host(dst: torch.Tensor, src: torch.Tensor, chunk: int = CHUNK) -> None:
    """dst += src for a flat `dst` on its device and a flat `src` anywhere, moving `chunk`
    elements at a time: the same bits as `dst += src.to(dst.device)` without a second
    dst-sized tensor on the device."""
    if src.device == dst.device:
        dst += src
        return
    for at in range(0, dst.numel(), chunk):
        dst[at : at + chunk] += src[at : at + chunk].to(dst.device, non_blocking=True)
