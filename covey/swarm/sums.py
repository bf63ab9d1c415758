"""What the swarm coordinator checks in a server's gradient sum before it enters an averaging
round (covey.swarm.averaging): every member of the round applies every reported sum, so one
malformed sum would stop the whole stage, and one huge sum would poison it.

A sum is safetensors bytes holding `g.0 .. g.{n-1}` (float32, the stage's parameter shapes,
finite) and `samples` (int64, one value: the reported samples). A sum of zero samples must be
all zeros (it carries no weight in the mean, so anything else is an unweighted push). The
per-sample norm it returns, and the samples, let the round leave out a sum far larger, or
far heavier, than the others' (covey.swarm.averaging.outliers): how many samples an honest
server holds depends on the trainers' speed and the coordinator's, so no fixed cap here.
"""

from __future__ import annotations

import math

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

MAX_SAMPLES = 1 << 30


class SumError(ValueError):
    """A gradient sum no round may hold; the message says why."""


def check_sum(data: bytes, shapes: list[tuple[int, ...]] | None, samples: int) -> float:
    """The sum's L2 norm per sample (0.0 for an empty sum) if it is well-formed for a stage
    with parameter `shapes` (None: any shapes, g.0..g.n-1 still); SumError naming what is
    wrong otherwise."""
    if not 0 <= samples <= MAX_SAMPLES:
        raise SumError(f"samples ({samples}) must be in [0, {MAX_SAMPLES}]")
    try:
        tensors = st_load(data)
    except SafetensorError as e:
        raise SumError(f"gradient sum is not safetensors: {e}") from None
    count = len(shapes) if shapes is not None else len(tensors) - 1
    want = {f"g.{i}" for i in range(count)} | {"samples"}
    if set(tensors) != want:
        raise SumError(f"gradient sum must hold exactly g.0..g.{count - 1} and samples")
    n = tensors["samples"]
    if n.dtype != torch.int64 or n.numel() != 1 or int(n[0]) != samples:
        raise SumError(f"the sum's samples tensor does not hold {samples}")
    total = 0.0
    for i in range(count):
        g = tensors[f"g.{i}"]
        shape = tuple(g.shape) if shapes is None else shapes[i]
        if g.dtype != torch.float32 or tuple(g.shape) != shape:
            raise SumError(f"g.{i} is {g.dtype} {tuple(g.shape)}, not float32 {shape}")
        if not bool(torch.isfinite(g).all()):
            raise SumError(f"g.{i} holds inf or nan")
        total += float(g.double().pow(2).sum())
    norm = math.sqrt(total)
    if samples == 0:
        if norm > 0:
            raise SumError("a sum of 0 samples must be all zeros")
        return 0.0
    return norm / samples
