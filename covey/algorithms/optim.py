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


def scheduled_lr(cfg: InnerOptim, step: int) -> float:
    """The learning rate of inner step `step` (0-based, counted per worker from the run's
    start: round x steps per round + step in round; DDP: the round). A pure function of
    its arguments, so a worker, the simulator and a validator re-executing any round all
    take the same steps.

    Linear warmup over `warmup_steps` (step s uses lr x (s + 1) / warmup_steps), then
    constant, or a cosine from lr at the warmup's end to min_lr_ratio x lr at `decay_steps`,
    held there after (Loshchilov & Hutter, arXiv 1608.03983, without restarts).
    ValueError for a negative step."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    assert cfg.decay_steps is not None  # the config refuses cosine without it
    span = cfg.decay_steps - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def has_schedule(cfg: InnerOptim) -> bool:
    """Whether the lr changes over the run (a constant lr is left to the optimizer as set,
    bit for bit as before schedules existed)."""
    return cfg.schedule != "constant" or cfg.warmup_steps > 0


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def make_inner_optimizer(model: nn.Module, cfg: InnerOptim) -> torch.optim.Optimizer:
    """The worker-local optimizer. Its state never leaves the worker."""
    params = list(model.parameters())
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
