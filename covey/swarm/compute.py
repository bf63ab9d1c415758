"""A stage server's two requests as pure functions of (stage, request body): what the
server answers and what a referee recomputes are the same code.

forward: body = pack(input) -> pack(output, meta)
backward: body = pack(input, grad_output | targets) -> pack(grad_input | b"", meta), where
meta is JSON {"loss": last stage's loss or null, "sketch": per-parameter grad norms}.
Inputs are checked before use (shape, dtype, token range): bytes from a trainer are not
trusted either. Backward recomputes forward from the input (covey.swarm.stage).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from covey.swarm.config import SwarmConfig
from covey.swarm.stage import Stage
from covey.swarm.wire import WireError, decode_tensor, encode_tensor, pack, unpack

MAX_ROWS = 1024


def check_input(cfg: SwarmConfig, k: int, x: torch.Tensor) -> None:
    """WireError unless `x` is what stage `k` takes: token ids (B, T) in [0, 256) for stage
    0, hidden states (B, T, n_embd) otherwise, T <= seq_len."""
    if k == 0:
        if x.dim() != 2 or x.is_floating_point():
            raise WireError(f"stage 0 takes token ids (B, T), got {tuple(x.shape)} {x.dtype}")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= 256):
            raise WireError("token ids must be in [0, 256)")
    elif x.dim() != 3 or x.shape[2] != cfg.n_embd:
        raise WireError(f"stage {k} takes (B, T, {cfg.n_embd}), got {tuple(x.shape)}")
    if not 0 < x.shape[0] <= MAX_ROWS or not 0 < x.shape[1] <= cfg.seq_len:
        raise WireError(f"shape {tuple(x.shape)}: rows 1..{MAX_ROWS}, T 1..{cfg.seq_len}")


def forward(cfg: SwarmConfig, k: int, stage: Stage, body: bytes) -> bytes:
    (data,) = unpack(body, 1)
    x = decode_tensor(data)
    check_input(cfg, k, x)
    out = stage.forward(x)
    return pack(encode_tensor(out, cfg.codec), json.dumps({"loss": None, "sketch": []}).encode())


def backward(cfg: SwarmConfig, k: int, stage: Stage, body: bytes) -> bytes:
    data, extra = unpack(body, 2)
    x, g = decode_tensor(data), decode_tensor(extra)
    check_input(cfg, k, x)
    loss = None
    if stage.last:
        if g.is_floating_point() or g.shape != x.shape[:2]:
            raise WireError(f"targets must be ids of shape {tuple(x.shape[:2])}")
        if int(g.min()) < 0 or int(g.max()) >= 256:
            raise WireError("targets must be in [0, 256)")
        loss, grad = stage.backward_loss(x, g)
    else:
        if g.shape != (*x.shape[:2], cfg.n_embd):
            raise WireError(f"grad_output {tuple(g.shape)} does not fit input {tuple(x.shape)}")
        grad = stage.backward(x, g)
    meta = {"loss": loss, "sketch": stage.last_sketch}
    out = b"" if grad is None else encode_tensor(grad, cfg.codec)
    return pack(out, json.dumps(meta).encode())


def parse_reply(reply: bytes) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """(tensor or None, meta) of a forward/backward reply; WireError when malformed."""
    out, meta_bytes = unpack(reply, 2)
    try:
        meta = json.loads(meta_bytes)
    except ValueError:
        raise WireError("reply meta is not JSON") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("sketch"), list):
        raise WireError("reply meta must hold a sketch list")
    loss = meta.get("loss")
    if loss is not None and (not isinstance(loss, (int, float)) or not math.isfinite(loss)):
        raise WireError(f"reply loss {loss!r} is not a finite number")
    return (decode_tensor(out) if out else None), meta


def distance(a: torch.Tensor | list[float] | None, b: torch.Tensor | list[float] | None) -> float:
    """Relative L2 distance ||a - b|| / ||b||; inf when one is missing or shapes differ."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    ta, tb = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    if ta.shape != tb.shape:
        return math.inf
    return float((ta - tb).norm() / (tb.norm() + 1e-8))


def reply_distance(a: bytes, b: bytes) -> float:
    """How far two replies to one request are apart: the largest of the tensor, sketch
    and loss distances. inf for a malformed reply."""
    try:
        (ta, ma), (tb, mb) = parse_reply(a), parse_reply(b)
    except WireError:
        return math.inf
    d = max(distance(ta, tb), distance(ma["sketch"], mb["sketch"]))
    if ma.get("loss") is not None or mb.get("loss") is not None:
        d = max(d, distance([ma.get("loss") or 0.0], [mb.get("loss") or 0.0]))
    return d
