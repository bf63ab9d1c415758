"""DeMo: decoupled momentum optimization (Peng et al., arXiv 2411.19870).

Every step each worker folds its gradient into a local momentum buffer (decay beta ~0.999),
sends only the top-k DCT coefficients of each 64-wide chunk of it, and subtracts what it
sent from the buffer (error feedback: what was not sent stays and grows until it is). The
canonical update decodes every worker's coefficients, averages them, applies the sign, and
takes an SGD step. The momentum buffers never leave the workers.
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
    flatten,
)
from covey.algorithms.codecs import Codec
from covey.config import DeMoConfig


class DeMo(Strategy):
    steps_per_round = 1

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        cfg: DeMoConfig,
        codec: Codec,
        aggregator: Aggregator | None = None,
    ) -> None:
        super().__init__(model, loss_fn, codec, aggregator)
        self.cfg = cfg
        self.momentum = torch.zeros(sum(p.numel() for p in model.parameters()))

    @property
    def reexecutable(self) -> bool:
        """The momentum buffer carries over from round to round."""
        return False

    def _local_extras(self) -> dict[str, torch.Tensor]:
        return {"optim/momentum": self.momentum}

    def _load_local_extras(self, extras: dict[str, torch.Tensor]) -> None:
        self.momentum = extras["optim/momentum"].clone()

    def inner_step(self, batch: torch.Tensor) -> float:
        loss = self.forward_backward(batch)
        grad = flatten([p.grad for p in self.model.parameters()])
        self.momentum.mul_(self.cfg.beta).add_(grad)
        return loss

    def extract(self) -> tuple[bytes, torch.Tensor]:
        """Encode the momentum's fast components; return (payload, what the payload decodes to)."""
        payload = self.codec.encode(self.momentum)
        return payload, self.codec.decode(payload)

    def encode_work(self) -> tuple[bytes, int | None]:
        payload, transmitted = self.extract()
        self.momentum.sub_(transmitted)  # error feedback: only what was sent leaves the buffer
        return payload, None

    def apply_round(
        self, start_state: TrainState, contributions: Sequence[Contribution]
    ) -> TrainState:
        lr, wd = self.cfg.lr, self.cfg.weight_decay
        new_params = {
            n: start_state.params[n] * (1 - lr * wd) - lr * torch.sign(u)
            for n, u in self.aggregate(start_state, contributions).items()
        }
        return TrainState(new_params, {}, start_state.round + 1)
