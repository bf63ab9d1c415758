"""A stage server's two requests as pure functions of (stage, request body): what the
server answers and what a referee recomputes are the same code.

forward: body = pack(input) -> pack(output, meta)
backward: body = pack(input, grad_output | targets) -> pack(grad_input | b"", meta), where
meta is JSON {"loss": last stage's loss or null, "sketch": per-parameter grad norms}
(covey.protocol.swarm.ReplyMeta).
With codec "subspace" the hidden states and gradients between stages travel as
coefficients of the run's fixed subspace (covey.swarm.subspace), forward with the ids.
Inputs are checked before use (shape, dtype, token range): bytes from a trainer are not
trusted either. Backward recomputes forward from the input (covey.swarm.stage).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from pydantic import ValidationError

from covey.protocol.swarm import ReplyMeta
from covey.swarm import subspace
from covey.swarm.codecs import CodecError
from covey.swarm.config import SwarmConfig
from covey.swarm.stage import Stage
from covey.swarm.wire import WireError, decode_tensor, encode_tensor, pack, unpack

MAX_ROWS = 1024


def check_input(cfg: SwarmConfig, k: int, x: torch.Tensor, stage: Stage | None = None) -> None:
    """WireError unless `x` is what stage `k` takes: token ids (B, T) in [0, vocab) for
    stage 0, hidden states (B, T, C) otherwise, T <= seq_len. vocab and C are the stage
    module's (covey GPT: 256 and n_embd)."""
    vocab = getattr(getattr(stage, "module", None), "vocab_size", 256)
    hidden = getattr(getattr(stage, "module", None), "hidden_size", cfg.n_embd)
    if k == 0:
        if x.dim() != 2 or x.is_floating_point():
            raise WireError(f"stage 0 takes token ids (B, T), got {tuple(x.shape)} {x.dtype}")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= vocab):
            raise WireError(f"token ids must be in [0, {vocab})")
    elif x.dim() != 3 or x.shape[2] != hidden:
        raise WireError(f"stage {k} takes (B, T, {hidden}), got {tuple(x.shape)}")
    if not 0 < x.shape[0] <= MAX_ROWS or not 0 < x.shape[1] <= cfg.seq_len:
        raise WireError(f"shape {tuple(x.shape)}: rows 1..{MAX_ROWS}, T 1..{cfg.seq_len}")


def decode_any(data: bytes) -> torch.Tensor:
    """The tensor of a payload between stages: token ids, int8, plain, or a subspace
    payload's coefficients. WireError when malformed."""
    if subspace.is_payload(data):
        try:
            return subspace.decode_payload(data)[1]
        except CodecError as e:
            raise WireError(f"undecodable subspace payload: {e}") from None
    return decode_tensor(data)


def _stage_input(
    cfg: SwarmConfig, k: int, stage: Stage, data: bytes
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stage input, token ids or None). In subspace mode a stage after the first
    receives ids and coefficients and computes on U c + e_tok."""
    if k == 0 or cfg.codec != "subspace":
        x = decode_tensor(data)
        check_input(cfg, k, x, stage)
        return x, (x if k == 0 else None)
    try:
        ids, c = subspace.decode_payload(data)
    except CodecError as e:
        raise WireError(f"stage {k} in subspace mode takes ids and coefficients: {e}") from None
    sw = subspace.for_run(cfg)
    if c.shape[2] != sw.rank:
        raise WireError(f"coefficients {tuple(c.shape)}: rank must be {sw.rank}")
    try:
        x = sw.from_coeffs(c, ids)
    except ValueError as e:
        raise WireError(str(e)) from None
    check_input(cfg, k, x, stage)
    return x, ids


def _encode_grad(cfg: SwarmConfig, g: torch.Tensor) -> bytes:
    if cfg.codec == "subspace":  # g_c = U^T dL/dh: r values a token (covey.swarm.subspace)
        return encode_tensor(subspace.for_run(cfg).grad_to_coeffs(g), "plain")
    return encode_tensor(g, cfg.codec)


def forward(cfg: SwarmConfig, k: int, stage: Stage, body: bytes) -> bytes:
    (data,) = unpack(body, 1)
    x, ids = _stage_input(cfg, k, stage, data)
    # computed on the device; int8 is encoded there a chunk at a time (only codes cross)
    out = stage.forward(x.to(_device(stage)))
    if cfg.codec == "subspace" and not stage.last:
        assert ids is not None
        payload = subspace.encode_payload(ids, subspace.for_run(cfg).to_coeffs(out.cpu(), ids))
    else:
        payload = encode_tensor(out, "plain" if cfg.codec == "subspace" else cfg.codec)
    return pack(payload, json.dumps({"loss": None, "sketch": []}).encode())


def backward(cfg: SwarmConfig, k: int, stage: Stage, body: bytes) -> bytes:
    data, extra = unpack(body, 2)
    x, _ = _stage_input(cfg, k, stage, data)
    g = decode_tensor(extra)
    vocab = getattr(stage.module, "vocab_size", 256)
    loss = None
    if stage.last:
        if g.is_floating_point() or g.shape != x.shape[:2]:
            raise WireError(f"targets must be ids of shape {tuple(x.shape[:2])}")
        if int(g.min()) < 0 or int(g.max()) >= vocab:
            raise WireError(f"targets must be in [0, {vocab})")
        loss, grad = stage.backward_loss(x.to(_device(stage)), g.to(_device(stage)))
    else:
        if cfg.codec == "subspace":
            sw = subspace.for_run(cfg)
            if g.shape != (*x.shape[:2], sw.rank):
                raise WireError(f"grad coefficients {tuple(g.shape)} do not fit {tuple(x.shape)}")
            g = sw.grad_from_coeffs(g)
        if g.shape != (*x.shape[:2], stage_hidden(cfg, stage)):
            raise WireError(f"grad_output {tuple(g.shape)} does not fit input {tuple(x.shape)}")
        grad = stage.backward(x.to(_device(stage)), g.to(_device(stage)))
    meta = {"loss": loss, "sketch": stage.last_sketch}
    out = b"" if grad is None else _encode_grad(cfg, grad)
    return pack(out, json.dumps(meta).encode())


def _device(stage: Stage) -> torch.device:
    """Where the stage computes (its parameters' device): inputs are decoded and checked
    on the host, cross to it, and results come back only to become bytes."""
    return next(stage.module.parameters()).device


def stage_hidden(cfg: SwarmConfig, stage: Stage) -> int:
    """C of the hidden states `stage` outputs."""
    return int(getattr(stage.module, "hidden_size", cfg.n_embd))


def parse_reply(reply: bytes) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """(tensor or None, meta) of a forward/backward reply; WireError when malformed."""
    out, meta_bytes = unpack(reply, 2)
    try:
        meta = json.loads(meta_bytes)
    except ValueError:
        raise WireError("reply meta is not JSON") from None
    try:  # a finite loss or none, a bounded sketch list, nothing else
        checked = ReplyMeta.model_validate(meta).model_dump()
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in p['loc']) or 'meta'}: {p['msg']}" for p in e.errors()[:3]
        )
        raise WireError(f"reply meta: {problems}") from None
    return (decode_any(out) if out else None), checked


def check_reply(cfg: SwarmConfig, k: int, kind: str, reply: bytes, dims: tuple[int, int]) -> None:
    """WireError unless `reply` (stage `k`'s answer to a `kind` request for a microbatch
    of cfg.microbatch x cfg.seq_len tokens) is what a trainer may pass on: forward, the
    next stage's input (finite hidden states, or in subspace mode ids in [0, vocab) and
    coefficients); backward, a finite gradient of the stage input's shape (nothing at
    stage 0), and from the last stage a finite loss. `dims`: the model's (vocab, hidden).
    Checked before use, so a bad reply bans the server that sent it, never the honest
    server of the next stage that would refuse it."""
    rows, T, (vocab, hidden) = cfg.microbatch, cfg.seq_len, dims
    t, meta = parse_reply(reply)  # a dict meta with a sketch list, a finite loss if any
    width = subspace.for_run(cfg).rank if cfg.codec == "subspace" else hidden
    if kind == "backward" and k == cfg.stages - 1 and meta.get("loss") is None:
        raise WireError(f"stage {k} backward: the last stage's reply names no loss")
    if kind == "backward" and k == 0:
        return  # token ids have no gradient: nothing is passed on
    if kind == "forward" and cfg.codec == "subspace":  # ids travel with the coefficients
        try:
            ids, _ = subspace.decode_payload(unpack(reply, 2)[0])
        except CodecError as e:
            raise WireError(f"stage {k} forward: {e}") from None
        if tuple(ids.shape) != (rows, T) or ids.is_floating_point():
            raise WireError(f"stage {k} forward: ids {tuple(ids.shape)}, not ({rows}, {T})")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise WireError(f"stage {k} forward: ids outside [0, {vocab})")
    if t is None or tuple(t.shape) != (rows, T, width) or not t.is_floating_point():
        shape = None if t is None else (tuple(t.shape), t.dtype)
        raise WireError(f"stage {k} {kind}: {shape}, not ({rows}, {T}, {width})")
    if not bool(torch.isfinite(t).all()):
        raise WireError(f"stage {k} {kind}: NaN or Inf")


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
