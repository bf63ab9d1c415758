"""The values a worker's round passes between its parts (covey/peer/worker.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from covey.algorithms import TrainState
from covey.protocol import schemas


class Stopped(Exception):
    """SIGINT/SIGTERM arrived: leave cleanly."""


@dataclass
class LocalStates:
    """The local-state chain: a round's committed local states: the start's content id
    (None: fresh) and the end state (the next round's start, if this contribution is recorded)."""

    start_cid: str | None
    end: dict[str, torch.Tensor] = field(default_factory=dict)
    end_path: Path | None = None  # its blob, written in the worker's store until published
    end_size: int = 0
    end_cid: str | None = None
    round: int = -1
    accepted: bool = False


@dataclass
class Finished:
    """What finishing a trained round brought back: publish, certificate, the applied
    weights (on the transfer thread when overlapping, covey.peer.overlap)."""

    info: schemas.RoundInfo  # the round it finished
    local: LocalStates | None  # that round's local states
    submitted: bool
    certificate: schemas.Certificate | None = None  # None: the round was aborted
    state: TrainState | None = None  # the certified weights, computed or downloaded
    state_hash: str | None = None
    resynced: bool = False  # downloaded: this peer's own result did not match
    next_info: schemas.RoundInfo | None = None  # the next round, when training ahead
