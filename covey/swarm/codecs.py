"""What travels between stages: blockwise 8-bit tensors, and low-rank subspace coefficients.

Blockwise 8-bit (in the style of bitsandbytes' blockwise quantization, used for SWARM's
activations and gradients, arXiv 2301.11913): the flattened tensor is cut into blocks of
64 or 256 values, each sent as int8 codes in [-127, 127] with one float32 scale (its
absmax / 127). Wire format, little-endian:

    b"CVQ8" | version u8 (1) | ndim u8 | block u16 | shape: ndim x u32 |
    scales: ceil(numel / block) x f32 | codes: numel x i8

so a tensor of n values costs exactly `int8_nbytes(shape, block)` bytes. Decoding checks
every field and the total length before it allocates anything: bytes from a peer are
never trusted.

Subspace mode (Pluralis, arXiv 2506.01260): a stage's output h (B, T, C) is constrained to
e_tok + span(U), with U a fixed orthonormal (C, r) basis drawn from a seed every peer
knows and e_tok the (fixed) token embedding of the microbatch's ids. Only the r
coefficients c = U^T (h - e_tok) travel; the receiver, who has the token ids and the
embedding table, rebuilds h = U c + e_tok exactly.
"""

from __future__ import annotations

import math
import struct

import torch

MAGIC = b"CVQ8"
VERSION = 1
BLOCKS = (64, 256)
MAX_NDIM = 8
_HEAD = struct.Struct("<4sBBH")


class CodecError(ValueError):
    """Bytes that are not a well-formed encoding; the message says which field and why."""


def int8_nbytes(shape: tuple[int, ...] | torch.Size, block: int = 64) -> int:
    """Exact encoded size of a tensor of `shape` at `block` values per scale."""
    n = math.prod(shape)
    return _HEAD.size + 4 * len(shape) + 4 * math.ceil(n / block) + n


#: values quantized (or dequantized) at a time, a multiple of every block size: a tensor of
#: any size is encoded on its device a chunk at a time, and only codes and scales cross
CHUNK = 1 << 22


def encode_int8(x: torch.Tensor, block: int = 64) -> bytes:
    """Blockwise 8-bit encoding of a float tensor, quantized on its own device `CHUNK`
    values at a time (the bytes do not depend on the chunking: chunks hold whole blocks).
    ValueError for a block size not in BLOCKS, more than MAX_NDIM dimensions, or
    non-finite values."""
    if block not in BLOCKS:
        raise ValueError(f"block size {block} must be one of {BLOCKS}")
    if x.dim() > MAX_NDIM:
        raise ValueError(f"tensor of {x.dim()} dims exceeds {MAX_NDIM}")
    flat = x.detach().reshape(-1)
    n = flat.numel()
    step = max(CHUNK // block, 1) * block
    scale_parts, code_parts = [], []
    for at in range(0, n, step):
        chunk = flat[at : at + step].to(torch.float32)
        if not bool(torch.isfinite(chunk).all()):
            raise ValueError("cannot encode a tensor with inf or nan")
        scales, codes = _quantize_chunk(chunk, block)
        scale_parts.append(scales.cpu().numpy().tobytes())
        code_parts.append(codes.cpu().numpy().tobytes())
    head = _HEAD.pack(MAGIC, VERSION, x.dim(), block)
    shape = struct.pack(f"<{x.dim()}I", *x.shape)
    return b"".join([head, shape, *scale_parts, *code_parts])


def _quantize_chunk(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, int8 codes) of a flat float32 chunk, on its device."""
    n = flat.numel()
    nb = math.ceil(n / block)
    pad = nb * block - n
    blocks = (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(nb, block)
    scales = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
    return scales, codes


def decode_int8(data: bytes, *, max_numel: int | None = None) -> torch.Tensor:
    """The float32 tensor of an encode_int8 payload, dequantized `CHUNK` values at a time.
    CodecError on a wrong magic or version, a block size not in BLOCKS, too many dims, more
    than `max_numel` values (no bound but the payload's own length when None: each value
    is one byte of it), a length other than the exact size, non-finite or negative scales,
    or code -128."""
    if len(data) < _HEAD.size:
        raise CodecError(f"payload of {len(data)} bytes is shorter than the {_HEAD.size}-byte head")
    magic, version, ndim, block = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise CodecError(f"magic {magic!r} version {version}: expected {MAGIC!r} {VERSION}")
    if block not in BLOCKS:
        raise CodecError(f"block size {block} must be one of {BLOCKS}")
    if ndim > MAX_NDIM:
        raise CodecError(f"ndim {ndim} exceeds {MAX_NDIM}")
    if len(data) < _HEAD.size + 4 * ndim:
        raise CodecError(f"payload of {len(data)} bytes ends inside the shape")
    shape = struct.unpack_from(f"<{ndim}I", data, _HEAD.size)
    n = math.prod(shape)
    if max_numel is not None and n > max_numel:
        raise CodecError(f"shape {shape} has {n} values, more than max_numel {max_numel}")
    want = int8_nbytes(shape, block)
    if len(data) != want:
        raise CodecError(f"payload of {len(data)} bytes; shape {shape} block {block} needs {want}")
    nb = math.ceil(n / block)
    off = _HEAD.size + 4 * ndim
    view = memoryview(data)
    scales = torch.frombuffer(bytearray(view[off : off + 4 * nb]), dtype=torch.float32)
    if nb and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise CodecError("scales must be finite and >= 0")
    out = torch.empty(n, dtype=torch.float32)
    step = max(CHUNK // block, 1) * block
    for at in range(0, n, step):
        m = min(step, n - at)
        first = off + 4 * nb + at
        codes = torch.frombuffer(bytearray(view[first : first + m]), dtype=torch.int8)
        if bool((codes == -128).any()):
            raise CodecError("code -128 is never produced by the encoder")
        mb = math.ceil(m / block)
        padded = torch.zeros(mb * block, dtype=torch.float32)
        padded[:m] = codes
        chunk_scales = scales[at // block : at // block + mb]
        out[at : at + m] = (padded.view(mb, block) * chunk_scales[:, None]).reshape(-1)[:m]
    return out.reshape(shape)


class SubspaceCodec:
    """The Pluralis subspace projection for hidden size `dim` at rank `rank`.

    The basis is a deterministic function of (dim, rank, seed): every stage and trainer
    rebuilds the same U without sending it. ValueError unless 1 <= rank <= dim.
    """

    def __init__(self, dim: int, rank: int, seed: int = 0) -> None:
        if not 1 <= rank <= dim:
            raise ValueError(f"rank ({rank}) must be between 1 and dim ({dim})")
        g = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(dim, rank, generator=g, dtype=torch.float64))
        self.dim, self.rank = dim, rank
        self.basis = q.to(torch.float32)  # (C, r), orthonormal columns

    def _check(self, h: torch.Tensor, e_tok: torch.Tensor) -> None:
        if h.shape[-1] != self.dim or e_tok.shape != h.shape:
            raise ValueError(
                f"h {tuple(h.shape)} and e_tok {tuple(e_tok.shape)} must match, last dim {self.dim}"
            )

    def encode(self, h: torch.Tensor, e_tok: torch.Tensor) -> torch.Tensor:
        """Coefficients c = U^T (h - e_tok), shape (..., rank)."""
        self._check(h, e_tok)
        return (h - e_tok) @ self.basis.to(device=h.device, dtype=h.dtype)

    def decode(self, c: torch.Tensor, e_tok: torch.Tensor) -> torch.Tensor:
        """h = U c + e_tok. ValueError when c's last dim is not `rank`."""
        if c.shape[-1] != self.rank or c.shape[:-1] != e_tok.shape[:-1]:
            raise ValueError(f"coefficients {tuple(c.shape)} do not fit e_tok {tuple(e_tok.shape)}")
        return c @ self.basis.to(device=c.device, dtype=c.dtype).T + e_tok

    def project(self, h: torch.Tensor, e_tok: torch.Tensor) -> torch.Tensor:
        """The constraint a stage applies to its output: e_tok + U U^T (h - e_tok).
        Differentiable; its output round-trips through encode/decode exactly (to rounding)."""
        return self.decode(self.encode(h, e_tok), e_tok)


def bytes_per_token(dim: int, rank: int, block: int = 64) -> dict[str, float]:
    """Payload bytes per token of a hidden state of size `dim` (heads excluded, scales
    amortized): plain fp32, blockwise 8-bit, subspace fp32 coefficients, subspace 8-bit."""
    return {
        "fp32": 4.0 * dim,
        "int8": dim * (1 + 4 / block),
        "subspace": 4.0 * rank,
        "subspace_int8": rank * (1 + 4 / block),
    }
