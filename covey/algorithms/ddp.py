"""Data-parallel baseline: every step, gradients are gathered, averaged and applied.

The optimizer's state (AdamW moments) is part of the canonical TrainState, since every
peer applies the same averaged gradient: that is what makes DDP's replicas identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from covey.algorithms.aggregation import Aggregator
from covey.algorithms.base import (
    Contribution,
    LossFn,
    Strategy,
    TrainState,
    clip_grad_,
    flatten,
)
from covey.algorithms.codecs import Codec
from covey.algorithms.optim import adamw
from covey.config import DDPConfig


class DDP(Strategy):
    steps_per_round = 1

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        cfg: DDPConfig,
        codec: Codec,
        aggregator: Aggregator | None = None,
    ) -> None:
        super().__init__(model, loss_fn, codec, aggregator)
        self.cfg = cfg
        self._grad: torch.Tensor | None = None

    @property
    def reexecutable(self) -> bool:
        """One gradient at the canonical weights: nothing local carries over."""
        return True

    def load_state(self, state: TrainState) -> None:
        super().load_state(state)
        self._grad = None  # a step taken from another state is not this round's work

    def _load_local_extras(self, extras: dict[str, torch.Tensor]) -> None:
        self._grad = None

    def inner_step(self, batch: torch.Tensor) -> float:
        if self._grad is not None:
            raise RuntimeError("DDP takes one inner step per round; call make_contribution")
        loss = self.forward_backward(batch)
        self._grad = flatten([p.grad for p in self.model.parameters()])
        return loss

    def encode_work(self) -> tuple[bytes, int | None]:
        assert self._grad is not None  # make_contribution checked that a step was taken
        payload = self.codec.encode(self._grad)
        self._grad = None
        return payload, None

    def apply_round(
        self, start_state: TrainState, contributions: Sequence[Contribution]
    ) -> TrainState:
        params = [start_state.params[n] for n in self.names]
        grads = list(self.aggregate(start_state, contributions).values())
        opt = self.cfg.optim
        clip_grad_(grads, opt.grad_clip)
        new_params, outer = {}, {}
        if opt.name == "sgd":
            for n, p, g in zip(self.names, params, grads, strict=True):
                new_params[n] = p * (1 - opt.lr * opt.weight_decay) - opt.lr * g
        else:
            step = int(start_state.outer["step"].item()) + 1 if start_state.outer else 1
            for n, p, g in zip(self.names, params, grads, strict=True):
                m0 = start_state.outer.get(f"exp_avg/{n}", torch.zeros_like(p))
                v0 = start_state.outer.get(f"exp_avg_sq/{n}", torch.zeros_like(p))
                new_params[n], outer[f"exp_avg/{n}"], outer[f"exp_avg_sq/{n}"] = adamw(
                    p, g, m0, v0, step, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
                )
            outer["step"] = torch.tensor(step, dtype=torch.int64)
        return TrainState(new_params, outer, start_state.round + 1)
