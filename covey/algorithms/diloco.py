"""DiLoCo (Douillard et al., arXiv 2311.08105).

Each worker takes H inner AdamW steps from the round's start weights. Its contribution is
the pseudo-gradient start - local, encoded by the codec. The canonical update averages the
pseudo-gradients weighted by tokens and takes one outer Nesterov SGD step (paper defaults:
lr 0.7, momentum 0.9). Inner optimizer states never leave the worker.

With `error_feedback`, what the codec dropped is kept locally and added to the next
round's pseudo-gradient (as DeMo does for its momentum, arXiv 2411.19870): covey's
combination of DiLoCo with DCT top-k / int4 compression.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from covey.algorithms.aggregation import Aggregator
from covey.algorithms.base import (
    Contribution,
    LossFn,
    RoundError,
    Strategy,
    TrainState,
    clip_grad_,
    flatten,
)
from covey.algorithms.codecs import Codec
from covey.algorithms.optim import make_inner_optimizer, nesterov_sgd
from covey.config import DiLoCoConfig


class DiLoCo(Strategy):
    flexible_steps = True

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        cfg: DiLoCoConfig,
        codec: Codec,
        aggregator: Aggregator | None = None,
    ) -> None:
        super().__init__(model, loss_fn, codec, aggregator)
        self.cfg = cfg
        self.steps_per_round = cfg.inner_steps
        self.inner_opt = make_inner_optimizer(model, cfg.optim)
        self._start: torch.Tensor | None = None  # flat start weights of the current round
        self._residual: torch.Tensor | None = None  # error feedback

    def load_state(self, state: TrainState) -> None:
        super().load_state(state)
        self._start = flatten([state.params[n] for n in self.names])

    def inner_step(self, batch: torch.Tensor) -> float:
        loss = self.forward_backward(batch)
        clip_grad_([p.grad for p in self.model.parameters()], self.cfg.optim.grad_clip)
        self.inner_opt.step()
        return loss

    def pseudo_gradient(self) -> torch.Tensor:
        """start - local, flat float32, plus the carried residual under error feedback."""
        if self._start is None:
            raise RuntimeError("load_state must run before the first round")
        delta = self._start - flatten(list(self.model.parameters()))
        if self.cfg.error_feedback and self._residual is not None:
            delta += self._residual
        return delta

    def encode_work(self) -> tuple[bytes, int | None]:
        delta = self.pseudo_gradient()
        payload = self.codec.encode(delta)
        if self.cfg.error_feedback:
            self._residual = delta - self.codec.decode(payload)
        return payload, None

    def apply_round(
        self, start_state: TrainState, contributions: Sequence[Contribution]
    ) -> TrainState:
        return outer_step(start_state, self.aggregate(start_state, contributions), self.cfg)


def outer_step(
    start_state: TrainState, outer_grads: dict[str, torch.Tensor], cfg: DiLoCoConfig
) -> TrainState:
    """Nesterov SGD on the named parameters in outer_grads; the others are carried over."""
    params = dict(start_state.params)
    outer = dict(start_state.outer)
    for name, g in outer_grads.items():
        if not torch.isfinite(g).all():
            raise RoundError(f"aggregated outer gradient for {name} is not finite")
        params[name], buf = nesterov_sgd(
            start_state.params[name],
            g,
            start_state.outer.get(f"momentum/{name}"),
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            nesterov=cfg.nesterov,
        )
        if buf is not None:
            outer[f"momentum/{name}"] = buf
    return TrainState(params, outer, start_state.round + 1)
