"""Pure tensor algorithms: strategies, codecs, aggregation. No I/O, no network."""

from __future__ import annotations

from torch import nn

from covey.algorithms.aggregation import (
    Aggregator,
    CoordinateMedian,
    NormClip,
    TrimmedMean,
    WeightedMean,
    build_aggregator,
)
from covey.algorithms.base import LossFn, Strategy
from covey.algorithms.codecs import get_codec
from covey.algorithms.ddp import DDP
from covey.algorithms.demo import DeMo
from covey.algorithms.diloco import DiLoCo
from covey.algorithms.state import Contribution, RoundError, TrainState
from covey.algorithms.streaming import StreamingDiLoCo
from covey.config import DDPConfig, DeMoConfig, DiLoCoConfig, StreamingDiLoCoConfig

__all__ = [
    "DDP",
    "Aggregator",
    "Contribution",
    "CoordinateMedian",
    "DeMo",
    "DiLoCo",
    "NormClip",
    "RoundError",
    "Strategy",
    "StreamingDiLoCo",
    "TrainState",
    "TrimmedMean",
    "WeightedMean",
    "build_aggregator",
    "build_strategy",
]


def build_strategy(
    cfg: DDPConfig | DiLoCoConfig | StreamingDiLoCoConfig | DeMoConfig,
    model: nn.Module,
    loss_fn: LossFn,
    aggregator: Aggregator | None = None,
) -> Strategy:
    """The strategy named by cfg.method, wrapping `model` (any nn.Module) and `loss_fn`."""
    codec = get_codec(cfg.codec)
    if isinstance(cfg, StreamingDiLoCoConfig):
        return StreamingDiLoCo(model, loss_fn, cfg, codec, aggregator)
    if isinstance(cfg, DiLoCoConfig):
        return DiLoCo(model, loss_fn, cfg, codec, aggregator)
    if isinstance(cfg, DeMoConfig):
        return DeMo(model, loss_fn, cfg, codec, aggregator)
    return DDP(model, loss_fn, cfg, codec, aggregator)
