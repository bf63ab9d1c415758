"""One microbatch through a chain of stages, in one process, with a pluggable wire.

The reference driver for what a trainer does over HTTP: forward through stages 0..S-1,
then backward from the last stage (which computes the loss) to stage 0, every tensor that
would cross the network passing through `wire` (identity, or an encode/decode round trip
such as blockwise 8-bit). Used by the convergence test and by benchmarks to count bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from covey.swarm.codecs import decode_int8, encode_int8
from covey.swarm.stage import Stage
from covey.swarm.subspace import SubspaceWire
from covey.swarm.wire import encode_tensor


@dataclass
class Wire:
    """A transport stand-in: `send(tensor) -> tensor as received`; counts payload bytes."""

    send: Callable[[torch.Tensor], tuple[torch.Tensor, int]]
    bytes_sent: int = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y, n = self.send(x)
        self.bytes_sent += n
        return y


def plain_wire() -> Wire:
    """fp32 tensors, unchanged."""
    return Wire(lambda x: (x.detach().to(torch.float32), 4 * x.numel()))


def int8_wire(block: int = 64) -> Wire:
    """Blockwise 8-bit: every tensor is encoded to bytes and decoded back."""

    def send(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        data = encode_int8(x, block)
        return decode_int8(data), len(data)

    return Wire(send)


def train_microbatch(stages: Sequence[Stage], batch: torch.Tensor, wire: Wire) -> float:
    """Forward and backward one (B, T+1) token batch through `stages`; returns the loss.

    Token ids travel to stage 0 and targets to the last stage as they are (small integers);
    activations and gradients between stages go through `wire`. Parameter grads accumulate
    in each stage; stepping is the caller's (Stage.maybe_step). ValueError unless the last
    stage is marked last and the others are not.
    """
    if not stages or not stages[-1].last or any(s.last for s in stages[:-1]):
        raise ValueError(f"{len(stages)} stages: exactly the last must be marked last")
    inputs = [batch[:, :-1]]
    for s in stages[:-1]:
        inputs.append(wire(s.forward(inputs[-1])))
    loss, grad = stages[-1].backward_loss(inputs[-1], batch[:, 1:])
    for k in range(len(stages) - 2, -1, -1):
        assert grad is not None  # only stage 0 takes token ids
        grad = stages[k].backward(inputs[k], wire(grad))
    return loss


def train_microbatch_subspace(
    stages: Sequence[Stage], batch: torch.Tensor, sw: SubspaceWire
) -> tuple[float, int]:
    """`train_microbatch` with codec "subspace" between stages (covey.swarm.subspace):
    stage outputs are cut to e_tok + span(U) and only coefficients (forward, with the
    ids) and gradient coefficients (backward) cross. Returns (loss, payload bytes), the
    bytes being what `subspace.encode_payload` and fp32 coefficients take on the wire."""
    if not stages or not stages[-1].last or any(s.last for s in stages[:-1]):
        raise ValueError(f"{len(stages)} stages: exactly the last must be marked last")
    ids = batch[:, :-1]
    inputs, sent = [ids], 0
    for s in stages[:-1]:
        c = sw.to_coeffs(s.forward(inputs[-1]), ids)
        sent += 16 + 4 * ids.numel() + 4 * c.numel()
        inputs.append(sw.from_coeffs(c, ids))
    loss, grad = stages[-1].backward_loss(inputs[-1], batch[:, 1:])
    for k in range(len(stages) - 2, -1, -1):
        assert grad is not None
        gc = sw.grad_to_coeffs(grad)
        sent += len(encode_tensor(gc, "plain"))
        grad = stages[k].backward(inputs[k], sw.grad_from_coeffs(gc))
    return loss, sent
