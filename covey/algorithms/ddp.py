"""Data-parallel baseline: every step, gradients are gathered, averaged and applied.

The optimizer's state (AdamW moments) is part of the canonical TrainState, since every
peer applies the same averaged gradient: that is what makes DDP's replicas identical.
The averaged gradient's clip is canonical too, so its norm is `l2_norm`'s (bit-exact on
every thread count and CPU), never torch's reductions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from covey.algorithms.aggregation import Aggregator, l2_norm
from covey.algorithms.base import LossFn, Strategy
from covey.algorithms.codec_base import Codec
from covey.algorithms.optim import adamw, scheduled_lr
from covey.algorithms.state import Contribution, RoundError, TrainState
from covey.algorithms.tensors import flatten
from covey.config import DDPConfig


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The l2 norm of the tensors taken together, bit-identical on every thread count and
    CPU: each tensor's `l2_norm` (float64), combined in the order given."""
    return math.sqrt(math.fsum(l2_norm(t) ** 2 for t in tensors))


def clip_global_norm_(grads: Sequence[torch.Tensor], max_norm: float) -> float:
    """Scale the gradients in place so their global l2 norm is at most max_norm (0 = off),
    as torch.nn.utils.clip_grad_norm_ does (factor max_norm / (norm + 1e-6)), but with a
    deterministic norm: the canonical step must be the same bytes on every peer. Returns
    the norm before clipping. RoundError (a ValueError) when it is not finite."""
    norm = global_norm(grads)
    if not math.isfinite(norm):
        raise RoundError(f"gradient norm is {norm}; values must be finite")
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm


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

    def inner_step(self, batch: torch.Tensor) -> torch.Tensor:
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
        lr = scheduled_lr(opt, start_state.round)  # one step per round: the round is the step
        clip_global_norm_(grads, opt.grad_clip)
        new_params, outer = {}, {}
        if opt.name == "sgd":
            for n, p, g in zip(self.names, params, grads, strict=True):
                new_params[n] = p * (1 - lr * opt.weight_decay) - lr * g
        else:
            step = int(start_state.outer["step"].item()) + 1 if start_state.outer else 1
            for n, p, g in zip(self.names, params, grads, strict=True):
                m0 = start_state.outer.get(f"exp_avg/{n}", torch.zeros_like(p))
                v0 = start_state.outer.get(f"exp_avg_sq/{n}", torch.zeros_like(p))
                new_params[n], outer[f"exp_avg/{n}"], outer[f"exp_avg_sq/{n}"] = adamw(
                    p, g, m0, v0, step, lr=lr, betas=opt.betas, weight_decay=opt.weight_decay
                )
            outer["step"] = torch.tensor(step, dtype=torch.int64)
        return TrainState(new_params, outer, start_state.round + 1)
