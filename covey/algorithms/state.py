"""The values that cross the seam between algorithms and the network: the canonical state
every peer agrees on at a round boundary (`TrainState`), one worker's output for a round
(`Contribution`), and the error of a round that cannot be applied (`RoundError`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass
class TrainState:
    """What every peer agrees on at a round boundary.

    params: the canonical model parameters, by name.
    outer: global optimizer state (outer momentum, DDP's Adam moments), by name.
    round: how many rounds have been applied to reach this state.
    """

    params: dict[str, torch.Tensor]
    outer: dict[str, torch.Tensor] = field(default_factory=dict)
    round: int = 0

    def digest(self) -> str:
        """sha256 over names, dtypes, shapes and bytes: equal digests = identical state."""
        h = hashlib.sha256(f"round={self.round}".encode())
        for section, tensors in (("params", self.params), ("outer", self.outer)):
            for name in sorted(tensors):
                t = tensors[name].detach().contiguous().cpu()
                h.update(f"|{section}/{name}/{t.dtype}/{tuple(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy())  # no copy: its buffer
        return h.hexdigest()

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (*self.params.values(), *self.outer.values())
        )


@dataclass(frozen=True)
class Contribution:
    """One worker's output for one round.

    payload: the codec's bytes; len(payload) is what crosses the wire.
    tokens: tokens trained on, the contribution's aggregation weight.
    inner_steps: inner steps taken.
    fragment: which parameter fragment the payload covers (Streaming DiLoCo), else None.
    """

    payload: bytes
    tokens: int
    inner_steps: int
    fragment: int | None = None

    @property
    def nbytes(self) -> int:
        return len(self.payload)


class RoundError(ValueError):
    """A round cannot be applied: empty or inconsistent contributions. Nothing changes."""
