"""Optimizer updates as pure functions, so canonical state can be recomputed by anyone.

Each function returns new tensors and never mutates its inputs. Both implement torch.optim's
update formulas (tests compare them with torch.optim.SGD / AdamW, and with torchft's DiLoCo,
to 1e-6); they are not bit-identical to torch's fused kernels, which order some operations
differently (about 1 ulp on some elements). covey is bit-exact with itself, which is what
peers agreeing on a weights hash needs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from covey.config import InnerOptim


def nesterov_sgd(
    param: torch.Tensor,
    grad: torch.Tensor,
    buf: torch.Tensor | None,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One torch.optim.SGD step (dampening 0, no weight decay) -> (new_param, new_buf).

    The first step's buffer is the gradient itself, as in torch; buf is None when momentum
    is 0.
    """
    if momentum == 0:
        return param - lr * grad, None
    new_buf = grad.clone() if buf is None else buf * momentum + grad
    update = grad + momentum * new_buf if nesterov else new_buf
    return param - lr * update, new_buf


def adamw(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One torch.optim.AdamW step; `step` is the 1-based step count after this update.

    Returns (new_param, new_exp_avg, new_exp_avg_sq).
    """
    beta1, beta2 = betas
    p = param * (1 - lr * weight_decay)
    m = exp_avg.lerp(grad, 1 - beta1)
    v = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    denom = v.sqrt() / math.sqrt(bias2) + eps
    return p - (lr / bias1) * m / denom, m, v


def make_inner_optimizer(model: nn.Module, cfg: InnerOptim) -> torch.optim.Optimizer:
    """The worker-local optimizer. Its state never leaves the worker."""
    params = list(model.parameters())
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
