"""Subspace activations on the wire (codec "subspace"; Pluralis, arXiv 2506.01260).

A stage's output h (B, T, C) is constrained to e_tok + span(U): U a fixed orthonormal
(C, r) basis every peer rebuilds from the run seed (covey.swarm.codecs.SubspaceCodec), and
e_tok the run's *initial* token embedding of the microbatch's ids, a constant every peer
rebuilds too (from the seed, or read by name from an hf: model's safetensors), never
trained. Only the r coefficients c = U^T (h - e_tok) travel forward, with the token ids;
the next stage rebuilds h' = U c + e_tok. Backward is exact for that constraint: the next
stage returns g_c = U^T dL/dh' (r values a token, since dL/dc = U^T dL/dh'), and the
sending stage backpropagates dL/dh = U g_c. Both directions carry r instead of C values a
token; the cost is what the projection removes from the residual stream (measured in
BENCHMARKS, covey bench notes).

Payload (little-endian): b"CVSS" | u32 B | u32 T | u32 r | ids: B*T x i32 | c: B*T*r x f32.
Decoding checks every length and value before use: bytes from a peer are not trusted.
"""

from __future__ import annotations

import struct
import threading

import torch

from covey.swarm.codecs import CodecError, SubspaceCodec

MAGIC = b"CVSS"
_HEAD = struct.Struct("<4sIII")
MAX_NUMEL = 1 << 26


def encode_payload(ids: torch.Tensor, c: torch.Tensor) -> bytes:
    """Token ids (B, T) and coefficients (B, T, r) as one payload. ValueError on shapes
    that do not match or non-finite coefficients."""
    if ids.dim() != 2 or c.dim() != 3 or tuple(c.shape[:2]) != tuple(ids.shape):
        raise ValueError(f"ids {tuple(ids.shape)} and coefficients {tuple(c.shape)} do not fit")
    c32 = c.detach().to(torch.float32).cpu().contiguous()
    if not bool(torch.isfinite(c32).all()):
        raise ValueError("cannot encode coefficients with inf or nan")
    head = _HEAD.pack(MAGIC, ids.shape[0], ids.shape[1], c.shape[2])
    return head + ids.to(torch.int32).cpu().contiguous().numpy().tobytes() + c32.numpy().tobytes()


def is_payload(data: bytes) -> bool:
    return data[:4] == MAGIC


def decode_payload(data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T) int64, c (B, T, r) float32). CodecError for a wrong magic, a length
    other than the exact size, too many values, or non-finite coefficients."""
    if len(data) < _HEAD.size:
        raise CodecError(f"subspace payload of {len(data)} bytes is shorter than its head")
    magic, b, t, r = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise CodecError(f"magic {magic!r}: expected {MAGIC!r}")
    if b * t * max(r, 1) > MAX_NUMEL or r < 1:
        raise CodecError(f"subspace payload ({b}, {t}, {r}) is out of bounds")
    want = _HEAD.size + 4 * b * t + 4 * b * t * r
    if len(data) != want:
        raise CodecError(f"subspace payload of {len(data)} bytes; ({b}, {t}, {r}) needs {want}")
    off = _HEAD.size + 4 * b * t
    ids = torch.frombuffer(bytearray(data[_HEAD.size : off]), dtype=torch.int32)
    c = torch.frombuffer(bytearray(data[off:]), dtype=torch.float32)
    if not bool(torch.isfinite(c).all()):
        raise CodecError("subspace coefficients hold inf or nan")
    return ids.reshape(b, t).long(), c.reshape(b, t, r)


class SubspaceWire:
    """The run's basis and fixed token table: the four maps between hidden states and
    coefficients. ValueError when the table's width is not the basis dimension."""

    def __init__(self, table: torch.Tensor, rank: int, seed: int) -> None:
        if table.dim() != 2:
            raise ValueError(f"token table must be (vocab, C), got {tuple(table.shape)}")
        self.codec = SubspaceCodec(int(table.shape[1]), rank, seed)
        self.table = table.detach().to(torch.float32)
        self.rank = rank

    def e_tok(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.table.shape[0]):
            raise ValueError(f"token ids must be in [0, {self.table.shape[0]})")
        return self.table.to(ids.device)[ids]

    def to_coeffs(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """c = U^T (h - e_tok): what a stage sends forward."""
        return self.codec.encode(h.to(torch.float32), self.e_tok(ids.to(h.device)))

    def from_coeffs(self, c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h' = U c + e_tok: what the next stage computes on."""
        return self.codec.decode(c.to(torch.float32), self.e_tok(ids.to(c.device)))

    def grad_to_coeffs(self, g: torch.Tensor) -> torch.Tensor:
        """g_c = U^T dL/dh': what a stage sends backward."""
        return g.to(torch.float32) @ self.codec.basis.to(g.device)

    def grad_from_coeffs(self, gc: torch.Tensor) -> torch.Tensor:
        """dL/dh = U g_c: what the sending stage backpropagates."""
        if gc.shape[-1] != self.rank:
            raise ValueError(
                f"gradient coefficients {tuple(gc.shape)}: last dim must be {self.rank}"
            )
        return gc.to(torch.float32) @ self.codec.basis.to(gc.device).T


_cache: dict[str, SubspaceWire] = {}
_lock = threading.Lock()


def for_run(cfg: object) -> SubspaceWire:
    """The SubspaceWire of a SwarmConfig (cached by run id): covey GPT's initial `wte`
    from the seed, or an hf: model's initial token embedding."""
    run_id = cfg.run_id  # type: ignore[attr-defined]
    with _lock:
        if run_id in _cache:
            return _cache[run_id]
    seed, rank = cfg.seed, cfg.subspace_rank  # type: ignore[attr-defined]
    if cfg.model:  # type: ignore[attr-defined]
        from covey.swarm.hfmodel import token_embedding

        table = token_embedding(cfg.model[3:], seed)  # type: ignore[attr-defined]
    else:
        from covey.models.gpt import GPT
        from covey.swarm.wire import gpt_config

        torch.manual_seed(seed)
        table = GPT(gpt_config(cfg)).wte.weight.detach().clone()  # type: ignore[arg-type]
    wire = SubspaceWire(table, rank, seed)
    with _lock:
        _cache[run_id] = wire
    return wire
