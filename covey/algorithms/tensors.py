"""Small tensor helpers the strategies share: parameters by name, flat vectors, bitwise
equality, global gradient clipping."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from covey.algorithms.state import RoundError


def param_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached clones of the model's parameters (tied weights appear once)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def unflatten(vec: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(vec[offset : offset + t.numel()].view_as(t).to(t.dtype))
        offset += t.numel()
    if offset != vec.numel():
        raise RoundError(f"vector has {vec.numel()} elements, parameters need {offset}")
    return out


def is_broadcast(t: torch.Tensor) -> bool:
    """Whether `t` is an expanded view (a stride-0 dimension of size > 1): such a tensor
    cannot be written in place, so it never changes and need not be copied."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True))


def same_bits(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether `b` is a tensor with exactly `a`'s dtype, shape, device and bytes (so a hash
    of either is the same; -0.0 and 0.0 differ here, and a NaN equals its own bits)."""
    if b is None or a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if not (a.is_contiguous() and b.is_contiguous()) or a.dtype == torch.bool:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def clip_grad_(grads: Sequence[torch.Tensor], max_norm: float) -> None:
    """Scale gradients in place so their global l2 norm is at most max_norm (0 = off).

    Without a host synchronization: the norm is never read on the host. The factor is
    max_norm / (norm + 1e-6) where norm > max_norm and exactly 1 elsewhere (x * 1.0 is x,
    bit for bit, NaN included), so the gradients are the bytes the branch on the host
    gave. The per-tensor norms are `vector_norm`'s: `torch._foreach_norm` reduces in
    another order on CUDA, which would change the bits."""
    if max_norm <= 0:
        return
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)
    torch._foreach_mul_(list(grads), scale)


def host_sum(losses: Sequence[torch.Tensor | float], start: float = 0.0) -> float:
    """start + the losses, added on the host in order (float64, as Python adds floats):
    the sum `float(loss)` after every step gave, with one device-to-host copy for all."""
    tensors = [x.detach().reshape(()) for x in losses if isinstance(x, torch.Tensor)]
    values = iter(torch.stack(tensors).double().cpu().tolist() if tensors else [])
    total = start
    for x in losses:
        total += next(values) if isinstance(x, torch.Tensor) else x
    return total
