"""DeMo: decoupled momentum optimization (Peng et al., arXiv 2411.19870).

Every step each worker folds its gradient into a local momentum buffer (decay beta ~0.999),
sends only the top-k DCT coefficients of each 64-wide chunk of it, and subtracts what it
sent from the buffer (error feedback: what was not sent stays and grows until it is). The
canonical update decodes every worker's coefficients, averages them, applies the sign, and
takes an SGD step. The momentum buffers never leave the workers.

Verification: what was sent waits as "optim/sent" in the local state and leaves the
momentum in `adopt(state, accepted=True)`, once the certificate took it; a rejected
contribution leaves the momentum as it was (nothing of it reached the model). A validator
re-executes a round from (W_r, the worker's committed end state of its previous round):
see `Strategy.begin_round`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from covey.algorithms.aggregation import Aggregator
from covey.algorithms.base import LossFn, Strategy
from covey.algorithms.codec_base import Codec
from covey.algorithms.state import Contribution, TrainState
from covey.algorithms.tensors import flatten
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
        numel = sum(p.numel() for p in model.parameters())
        self.momentum = torch.zeros(numel, device=self.device)  # where the model computes
        self.sent = torch.zeros_like(self.momentum)  # this round's payload, until certified

    @property
    def reexecutable(self) -> bool:
        return True

    @property
    def carries_local_state(self) -> bool:
        """The momentum buffer carries over from round to round."""
        return True

    def _local_extras(self, fresh_device: str | None = None) -> dict[str, torch.Tensor]:
        return {"optim/momentum": self.momentum, "optim/sent": self.sent}

    def _load_local_extras(self, extras: dict[str, torch.Tensor]) -> None:
        self.momentum = extras["optim/momentum"].to(self.device, copy=True)
        self.sent = extras["optim/sent"].to(self.device, copy=True)

    def reset_local(self) -> None:
        self.momentum = torch.zeros_like(self.momentum)
        self.sent = torch.zeros_like(self.sent)

    @property
    def local_params_carried(self) -> bool:
        return False  # `adopt` loads the round's start over the worker's own weights

    def adopt(self, state: TrainState, accepted: bool = True) -> None:
        self.load_state(state)
        if accepted:  # error feedback: only what was sent and taken leaves the buffer
            self.momentum.sub_(self.sent)
        self.sent = torch.zeros_like(self.sent)

    def inner_step(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self.forward_backward(batch)
        grad = flatten([p.grad for p in self.model.parameters()])
        self.momentum.mul_(self.cfg.beta).add_(grad)
        return loss

    def extract(self) -> tuple[bytes, torch.Tensor]:
        """Encode the momentum's fast components; return (payload, what the payload decodes to)."""
        return self.codec.roundtrip(self.momentum)

    def encode_work(self) -> tuple[bytes, int | None]:
        payload, self.sent = self.extract()  # subtracted from the momentum in `adopt`
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
