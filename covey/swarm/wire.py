"""Bytes between SWARM peers: tensors, stage states, signed replies. Never pickle.

Tensors travel as token ids (`b"CVID"`, u32 rows, u32 cols, int32 values), blockwise 8-bit
(covey.swarm.codecs) or plain float32 (safetensors). A stage state (weights, AdamW moments
and the stage's step) is safetensors bytes whose sha256 is its content id, so a server
that fetches a state from a peer checks it by hash. A server signs each reply over (stage,
state id, sha256 of the input, sha256 of the output) so a referee can hold it to it.
"""

from __future__ import annotations

import hashlib
import struct

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from covey.models.gpt import GPT, GPTConfig
from covey.swarm.codecs import CodecError, decode_int8, encode_int8
from covey.swarm.config import SwarmConfig
from covey.swarm.optim import AdamW
from covey.swarm.plan import plan_stages, stage_modules
from covey.swarm.stage import Stage
from covey.trust.swarm_evidence import reply_message as reply_message  # what servers sign

_IDS = struct.Struct("<4sII")


class WireError(ValueError):
    """Bytes from a peer that do not decode; the message says why."""


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_tensor(x: torch.Tensor, codec: str) -> bytes:
    """Token ids as CVID, floats as `codec` ("int8" or "plain")."""
    if not x.is_floating_point():
        if x.dim() != 2:
            raise ValueError(f"token ids must be (B, T), got {tuple(x.shape)}")
        return _IDS.pack(b"CVID", *x.shape) + x.to(torch.int32).cpu().contiguous().numpy().tobytes()
    if codec == "int8":  # quantized on x's device a chunk at a time: codes and scales cross
        return encode_int8(x, 64)
    return st_save({"x": x.detach().to(torch.float32).cpu().contiguous()})


def decode_tensor(data: bytes) -> torch.Tensor:
    """The tensor of an encode_tensor payload; WireError for anything malformed. No
    element cap: every format's exact length check bounds what is allocated by the
    payload's own size (which the server's `max_body_bytes` bounds), and each stage checks
    the shape against its run (`compute.check_input`)."""
    try:
        if data[:4] == b"CVID":
            if len(data) < _IDS.size:
                raise WireError("token ids shorter than their head")
            _, b, t = _IDS.unpack_from(data)
            if len(data) != _IDS.size + 4 * b * t:
                raise WireError(f"token ids ({b}, {t}) do not fit {len(data)} bytes")
            ids = torch.frombuffer(bytearray(data[_IDS.size :]), dtype=torch.int32)
            return ids.reshape(b, t).long()
        if data[:4] == b"CVQ8":
            return decode_int8(data)
        x = st_load(data).get("x")
        if x is None or x.dtype != torch.float32:
            raise WireError("plain payload must hold one float32 tensor 'x'")
        if not bool(torch.isfinite(x).all()):
            raise WireError("plain payload holds inf or nan")
        return x
    except (CodecError, SafetensorError, RuntimeError, struct.error) as e:
        raise WireError(f"undecodable tensor payload: {e}") from None


def pack(*parts: bytes) -> bytes:
    """Several payloads in one body: u32 count, u64 length each, then the bytes."""
    head = struct.pack(f"<I{len(parts)}Q", len(parts), *(len(p) for p in parts))
    return head + b"".join(parts)


def unpack(data: bytes, count: int) -> list[bytes]:
    """The `count` payloads of a `pack` body; WireError unless it holds exactly them."""
    if len(data) < 4 or struct.unpack_from("<I", data)[0] != count:
        raise WireError(f"body must pack {count} payloads")
    lengths = struct.unpack_from(f"<{count}Q", data, 4)
    off = 4 + 8 * count
    if off + sum(lengths) != len(data):
        raise WireError(f"packed lengths {lengths} do not add up to {len(data) - off} bytes")
    out = []
    for n in lengths:
        out.append(data[off : off + n])
        off += n
    return out


# -- the model and its stages ------------------------------------------------------------------


def gpt_config(cfg: SwarmConfig) -> GPTConfig:
    return GPTConfig(
        block_size=cfg.seq_len,
        vocab_size=256,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
    )


def stage_plan(cfg: SwarmConfig) -> list[list[int]]:
    return plan_stages([1.0] * cfg.n_layer, cfg.stages)


def build_stage(cfg: SwarmConfig, k: int, device: torch.device | str = "cpu") -> Stage:
    """Stage `k` at its initial weights (the run's seed), its own copy of every tensor, on
    `device` (weights built on the host from the seed, then moved: the same on every
    device); its optimizer state is created there on the first step."""
    if not 0 <= k < cfg.stages:
        raise ValueError(f"stage {k}; this run has stages 0..{cfg.stages - 1}")
    if cfg.model:  # a Hugging Face decoder: only this stage's weights (covey.swarm.hfmodel)
        from covey.swarm.hfmodel import build_hf_stage

        return build_hf_stage(cfg, k, device)  # type: ignore[no-any-return]
    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config(cfg))
    module = stage_modules(model, stage_plan(cfg))[k]
    # untie wte/lm_head: a stage server trains its own copy (covey.swarm.plan)
    for name, p in list(module.named_parameters()):
        _set_param(module, name, nn.Parameter(p.detach().clone()))
    module.to(device)
    lr = cfg.lr
    return Stage(
        module,
        lambda ps: AdamW(ps, lr=lr),  # type: ignore[arg-type,return-value]
        target_samples=cfg.target_samples,
        last=k == cfg.stages - 1,
    )


def _set_param(module: nn.Module, name: str, p: nn.Parameter) -> None:
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    setattr(module, leaf, p)


def state_bytes(stage: Stage) -> bytes:
    """Weights, AdamW moments and step counts as safetensors bytes (deterministic)."""
    out = {f"w.{n}": p.detach().cpu().contiguous() for n, p in stage.module.named_parameters()}
    for i, p in enumerate(stage.params):
        for key, v in stage.optimizer.state.get(p, {}).items():
            out[f"o.{i}.{key}"] = v.detach().reshape(-1).cpu().contiguous().clone()
    out["meta.steps"] = torch.tensor([stage.steps], dtype=torch.int64)
    return st_save(dict(sorted(out.items())))


def load_state(stage: Stage, data: bytes) -> None:
    """Replace `stage`'s weights and optimizer state by `data`'s. WireError when a name or
    shape does not match this stage."""
    try:
        tensors = st_load(data)
    except SafetensorError as e:
        raise WireError(f"stage state is not safetensors: {e}") from None
    names = dict(stage.module.named_parameters())
    with torch.no_grad():
        for n, p in names.items():
            t = tensors.get(f"w.{n}")
            if t is None or t.shape != p.shape:
                raise WireError(f"stage state lacks {n} of shape {tuple(p.shape)}")
            p.copy_(t)
        for i, p in enumerate(stage.params):
            st = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"o.{i}.")}
            if st:
                stage.optimizer.state[p] = {
                    k: v.reshape(()) if k == "step" else v.reshape(p.shape).to(p.device)
                    for k, v in st.items()
                }
    stage.steps = int(tensors["meta.steps"][0]) if "meta.steps" in tensors else 0
