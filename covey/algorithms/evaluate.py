"""Held-out loss of a canonical state: what the simulator, the coordinator's evaluator
and the benchmarks report as validation loss. Pure: no network, no clock."""

from __future__ import annotations

import torch
from torch import nn

from covey.algorithms.base import LossFn
from covey.algorithms.state import TrainState
from covey.models.gpt import lm_loss


@torch.no_grad()
def evaluate(
    model: nn.Module, state: TrainState, batches: list[torch.Tensor], loss_fn: LossFn = lm_loss
) -> float:
    """Mean held-out loss of the canonical parameters, computed on the model's device."""
    for name, p in model.named_parameters():
        p.copy_(state.params[name])
    return held_out_loss(model, batches, loss_fn)


@torch.no_grad()
def held_out_loss(
    model: nn.Module, batches: list[torch.Tensor], loss_fn: LossFn = lm_loss
) -> float:
    """Mean loss of `model` as it is (eval mode) on `batches`, on the model's device."""
    model.eval()
    device = next(model.parameters()).device
    return sum(float(loss_fn(model, b.to(device))) for b in batches) / len(batches)
