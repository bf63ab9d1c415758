"""AdamW for stage servers, as plain tensor math.

torch.optim's first optimizer imports torch's compiler stack (torch._dynamo), which costs a
stage server seconds at start on a loaded machine, before its first heartbeat. This is the
same update (Loshchilov & Hutter, arXiv 1711.05101; torch.optim.AdamW's defaults and state
names: step, exp_avg, exp_avg_sq), elementwise and deterministic, so servers of a stage
that apply the same averaged gradient hold bit-identical states.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


class AdamW:
    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0:
            raise ValueError(f"lr ({lr}) > 0, betas ({betas}) in [0, 1), eps ({eps}) > 0")
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        b1, b2 = self.betas
        for p in self.params:
            g = p.grad
            if g is None:
                continue
            st = self.state.get(p)
            if st is None:
                st = self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
            st["step"] += 1
            t = float(st["step"])
            p.mul_(1 - self.lr * self.weight_decay)
            st["exp_avg"].lerp_(g, 1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (st["exp_avg_sq"].sqrt() / math.sqrt(1 - b2**t)).add_(self.eps)
            p.addcdiv_(st["exp_avg"], denom, value=-self.lr / (1 - b1**t))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
