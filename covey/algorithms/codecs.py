"""Tensor codecs: a flat float32 tensor <-> ``bytes`` on the wire.

Contract:

* ``encode(x)`` takes a 1-D float32 tensor without NaN/Inf (anything else raises
  ``CodecError``) and returns ``bytes``.  On another device than the CPU, top-k and DCT
  select (and DCT transforms) on that device and copy only the kept entries to the host;
  the other codecs copy the vector to the host once: bytes for the wire are made there.
  It is stateless and deterministic: the same input gives the same bytes.  Error feedback
  is the caller's job, not the codec's.
* ``decode(payload, numel=None, device=None)`` returns a fresh, writable 1-D float32 tensor
  (on ``device``, default the CPU; top-k and DCT scatter/invert on that device).  It checks the
  magic, the codec id, every parameter (which must equal this codec's), the exact total length,
  ``numel`` when given, index ranges/order, and that scales and values are finite.  Malformed
  payloads raise ``CodecError``; nothing is read past the buffer.
* ``len(payload)`` is the true wire size: everything needed to decode, except the spec itself,
  is in the payload, and ``decode_any`` does not even need the spec.
* ``max_abs_error(x)`` is the stated worst-case per-element error for input ``x``; each class
  docstring gives the formula (plus a tiny float32 round-off slack where one is needed).

Layout (little-endian ``struct``): magic ``b"CVY1"`` (the trailing "1" is the format version),
uint8 codec id, uint64 numel (13 bytes, ``HEADER_BYTES``), the codec's parameters, the body.
The hot paths use numpy on the tensor's memory: it is several times faster than torch's CPU
element-wise kernels for these single-pass operations.

====  ==========================  =========================================================
id    spec                        codec
====  ==========================  =========================================================
1-3   ``fp32``/``fp16``/``bf16``  every element as a float (``Fp32Codec`` ...)
4, 5  ``int8[:b]``/``int4[:b]``   block-wise symmetric quantization (``Int8Codec``, ...)
6     ``topk:<ratio>[:<v>]``      largest |x| with uint32 indices (``TopKCodec``)
7     ``dct:<chunk>:<k>[:<v>]``   top-k of a 1-D DCT per chunk (``DctCodec``, DeMo-style)
8     ``sign``                    1 bit per element plus a mean-|x| scale (``SignCodec``)
9     ``dct2:<side>:<k>[:<v>]``   top-k of a 2-D DCT per side x side block (``Dct2Codec``)
====  ==========================  =========================================================

``<v>`` is the value format of kept entries: ``fp32`` (default), ``fp16`` or ``int8``.
"""

from __future__ import annotations

import math
import struct
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from covey.algorithms.dct import (
    dct2_chunks,
    dct_chunks,
    idct2_chunks,
    idct2_sparse,
    idct_chunks,
    idct_sparse,
    to_chunks,
)

MAGIC = b"CVY1"
_HEADER = struct.Struct("<4sBQ")
HEADER_BYTES = _HEADER.size  # 13
FP16_MAX = 65504.0
BF16_OVERFLOW = (2.0 - 2.0**-8) * 2.0**127  # float32 values this large round to inf in bf16
VALUE_FORMATS = ("fp32", "fp16", "int8")  # kept top-k/DCT values; stored as uint8 0, 1, 2
VALUE_INT8_BLOCK = 64  # block of the int8 quantizer applied to the kept-values vector
# Float32 round-off slack in the quantizer bounds: x / scale and q * scale each err by ~2^-24
# relative (well under 2^-21 of max|x| in total); subnormal scales lose absolute precision.
_REL_SLACK = 2.0**-21
_ABS_SLACK = 2.0**-140
VALID_FORMS = (
    "fp32 | fp16 | bf16 | int8[:<block>] | int4[:<block>] | topk:<ratio>[:<values>] | "
    "dct:<chunk>:<k>[:<values>] | dct2:<side>:<k>[:<values>] | sign   "
    "(values: fp32 (default), fp16, int8)"
)
Body = list[bytes | np.ndarray]


class CodecError(ValueError):
    """A tensor cannot be encoded, or a payload is malformed / does not match the codec."""


def _check_tensor(x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1 or x.dtype != torch.float32:
        raise CodecError(
            f"expected a 1-D float32 tensor, got shape {tuple(x.shape)}, {x.dtype}, "
            f"device {x.device}"
        )


def _check_input(x: Tensor) -> np.ndarray:
    """Validate an encoder input; return a numpy view of its memory (never written to),
    copied to the host first when it lives on another device."""
    _check_tensor(x)
    xn = x.detach().contiguous().cpu().numpy()
    if xn.size and not (math.isfinite(xn.min()) and math.isfinite(xn.max())):
        raise CodecError(f"tensor of {xn.size} elements contains NaN or Inf")
    return xn


def _peak(a: np.ndarray) -> float:
    """max|a| (0 for empty) without allocating |a|."""
    return max(-float(a.min()), float(a.max())) if a.size else 0.0


def _np(buf: memoryview, dtype: str, count: int, offset: int) -> np.ndarray:
    """Read-only view of ``count`` items at ``offset``; callers copy before handing out."""
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def _rows(a: np.ndarray, block: int) -> np.ndarray:
    """(ceil(n / block), block) rows of ``a``, zero-padding the last one (copies only if ragged)."""
    pad = -a.size % block
    return (np.concatenate([a, np.zeros(pad, a.dtype)]) if pad else a).reshape(-1, block)


# ---------------------------------------------------------------- block quantizer (int8/int4)


def _quantize(x: np.ndarray, block: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per block: scale = max|block| / levels (float32), q = round(x / scale) (int8)."""
    rows = _rows(x, block)
    scales = np.maximum(-rows.min(axis=1), rows.max(axis=1)) / np.float32(levels)
    # Near float32's max, levels * scale can round up to inf: step such scales toward zero so
    # that every payload we emit dequantizes to finite values.
    with np.errstate(over="ignore"):
        overflow = ~np.isfinite(scales * np.float32(levels))
    scales[overflow] = np.nextafter(scales[overflow], np.float32(0))
    # A zero (or underflowed) scale means an all-zero (or subnormal-dust) block: divide by 1.
    divisor = np.where(scales > 0, scales, np.float32(1))
    q = rows / divisor[:, None]
    np.clip(np.rint(q, out=q), -levels, levels, out=q)
    return scales.astype("<f4", copy=False), q.astype(np.int8).reshape(-1)[: x.size]


def _dequantize(scales: np.ndarray, q: np.ndarray, block: int) -> Tensor:
    """Inverse of ``_quantize``; ``scales`` and ``q`` are read-only views of the payload."""
    if not (np.isfinite(scales) & (scales >= 0)).all():
        raise CodecError("block scales must be finite and >= 0")
    if (q == -128).any():
        raise CodecError("quantized value -128 is outside the symmetric range [-127, 127]")
    rows = _rows(q.astype(np.float32), block)
    with np.errstate(over="ignore"):
        rows *= scales[:, None]
    out = rows.reshape(-1)[: q.size]
    if not np.isfinite(out).all():
        raise CodecError("dequantized values overflow float32: a block scale is too large")
    return torch.from_numpy(out)


def _quant_bound(peak: float, levels: int) -> float:
    return peak / (2 * levels) + peak * _REL_SLACK + _ABS_SLACK


# ---------------------------------------------------------------- value formats
# Dense codecs store every element in one of fp32/fp16/bf16; top-k and DCT store their kept
# values in one of VALUE_FORMATS.


def _values_nbytes(count: int, fmt: str) -> int:
    if fmt == "int8":
        return 4 * -(-count // VALUE_INT8_BLOCK) + count
    return (4 if fmt == "fp32" else 2) * count


def _encode_values(v: np.ndarray, fmt: str) -> Body:
    if fmt == "fp32":
        return [v.astype("<f4", copy=False)]
    if fmt == "int8":
        return list(_quantize(v, VALUE_INT8_BLOCK, 127))
    peak = _peak(v)
    if fmt == "fp16" and peak > FP16_MAX:
        raise CodecError(f"value {peak:g} exceeds the fp16 maximum {FP16_MAX:g}")
    if fmt == "bf16" and peak >= BF16_OVERFLOW:
        raise CodecError(f"value {peak:g} overflows bfloat16 when rounded")
    half = torch.from_numpy(v).to(torch.float16 if fmt == "fp16" else torch.bfloat16)
    return [half.view(torch.int16).numpy()]


def _decode_values(buf: memoryview, offset: int, count: int, fmt: str) -> Tensor:
    """Decode ``count`` values at ``offset``; the caller has checked the total length."""
    if fmt == "int8":
        n_blocks = -(-count // VALUE_INT8_BLOCK)
        q = _np(buf, "i1", count, offset + 4 * n_blocks)
        return _dequantize(_np(buf, "<f4", n_blocks, offset), q, VALUE_INT8_BLOCK)
    if fmt == "bf16":
        raw = _np(buf, "<i2", count, offset)
        if ((raw & 0x7F80) == 0x7F80).any():  # all-ones exponent: Inf or NaN
            raise CodecError("values contain NaN or Inf")
        return torch.from_numpy(raw.astype(np.int16)).view(torch.bfloat16).float()
    out = _np(buf, "<f4" if fmt == "fp32" else "<f2", count, offset).astype(np.float32)
    if not np.isfinite(out).all():
        raise CodecError("values contain NaN or Inf")
    return torch.from_numpy(out)


def _value_bound(peak: float, fmt: str) -> float:
    """Worst-case error of storing one value of magnitude <= peak in ``fmt``."""
    if fmt == "fp32":
        return 0.0
    if fmt == "fp16":  # round to nearest: 2^-11 relative for normals, <= 2^-25 if subnormal
        return peak * 2.0**-11 + 2.0**-24
    if fmt == "bf16":  # 8 significant bits with float32's exponent range
        return peak * 2.0**-8 + 2.0**-133
    return _quant_bound(peak, 127)


def _value_format(value: str | int) -> str:
    """Validate a value format given by name (spec) or by stored id (header)."""
    if isinstance(value, int):
        if not 0 <= value < len(VALUE_FORMATS):
            raise ValueError(f"value format id {value} is not in 0..{len(VALUE_FORMATS) - 1}")
        return VALUE_FORMATS[value]
    if value not in VALUE_FORMATS:
        raise ValueError(f"value format must be one of {VALUE_FORMATS}, got {value!r}")
    return value


# ---------------------------------------------------------------- codec base


class Codec(ABC):
    """Base class.  Subclasses define the id, parameter fields, body layout and error bound."""

    codec_id: ClassVar[int]
    params_struct: ClassVar[struct.Struct] = struct.Struct("<")
    name: str
    lossless: bool = False

    def _params(self) -> tuple:
        return ()

    @classmethod
    def _from_params(cls, params: tuple) -> Codec:
        return cls(*params)

    @abstractmethod
    def _body_nbytes(self, numel: int) -> int: ...

    @abstractmethod
    def _encode_body(self, x: np.ndarray) -> Body: ...

    @abstractmethod
    def _decode_body(self, buf: memoryview, offset: int, numel: int) -> Tensor: ...

    @abstractmethod
    def _bound(self, x: np.ndarray) -> float: ...

    def nbytes(self, numel: int) -> int:
        """Exact ``len(self.encode(x))`` for every valid ``x`` of ``numel`` elements."""
        return HEADER_BYTES + self.params_struct.size + self._body_nbytes(numel)

    def encode(self, x: Tensor) -> bytes:
        if isinstance(x, Tensor) and x.device.type != "cpu" and self._on_device is not None:
            _check_tensor(x)
            body = self._on_device(x.detach())
            numel = x.numel()
        else:
            xn = _check_input(x)
            body, numel = self._encode_body(xn), xn.size
        head = _HEADER.pack(MAGIC, self.codec_id, numel)
        return b"".join([head, self.params_struct.pack(*self._params()), *body])

    #: encodes a non-CPU tensor's body, selecting on its device (None: copy to the host)
    _on_device: ClassVar[Any] = None

    def decode(
        self,
        payload: bytes | bytearray | memoryview,
        numel: int | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """The payload's vector (see the module docstring), on `device` (default the CPU)."""
        target = torch.device("cpu") if device is None else torch.device(device)
        buf, n = self._check_payload(payload, numel)
        offset = HEADER_BYTES + self.params_struct.size
        if target.type == "cpu":
            return self._decode_body(buf, offset, n)
        return self._decode_to(buf, offset, n, target)

    def _decode_to(self, buf: memoryview, offset: int, numel: int, device: torch.device) -> Tensor:
        """Decode onto a device (default: on the host, then one copy)."""
        return self._decode_body(buf, offset, numel).to(device)

    def _check_payload(
        self, payload: bytes | bytearray | memoryview, numel: int | None
    ) -> tuple[memoryview, int]:
        buf = _bytes_view(payload)
        other, n = _read_header(buf)
        if other != self:
            raise CodecError(f"payload was encoded with {other.name!r}, not {self.name!r}")
        if numel is not None and n != numel:
            raise CodecError(f"payload holds {n} elements, expected {numel}")
        if len(buf) != self.nbytes(n):
            raise CodecError(f"payload is {len(buf)} bytes, header says {self.nbytes(n)} ({n} el)")
        return buf, n

    def max_abs_error(self, x: Tensor) -> float:
        """Stated worst-case |decode(encode(x)) - x| over all elements (see class docstring)."""
        xn = _check_input(x)
        return float(self._bound(xn)) if xn.size else 0.0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and type(other) is type(self) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"get_codec({self.name!r})"


def _bytes_view(payload: bytes | bytearray | memoryview) -> memoryview:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes-like, got {type(payload).__name__}")
    return memoryview(payload).cast("B")


def _read_header(buf: memoryview) -> tuple[Codec, int]:
    if len(buf) < HEADER_BYTES:
        raise CodecError(f"payload is {len(buf)} bytes, shorter than the {HEADER_BYTES}B header")
    magic, cid, numel = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    cls = _CODECS_BY_ID.get(cid)
    if cls is None:
        raise CodecError(f"unknown codec id {cid}; known ids are {sorted(_CODECS_BY_ID)}")
    if len(buf) < HEADER_BYTES + cls.params_struct.size:
        raise CodecError(f"payload is {len(buf)} bytes, too short for {cls.__name__} parameters")
    try:
        return cls._from_params(cls.params_struct.unpack_from(buf, HEADER_BYTES)), numel
    except ValueError as exc:  # parameters of a corrupt header
        raise CodecError(f"bad {cls.__name__} parameters in header: {exc}") from exc


def peek(payload: bytes | bytearray | memoryview) -> tuple[Codec, int]:
    """(codec, numel) named by a payload's header, without decoding the body."""
    return _read_header(_bytes_view(payload))


def decode_any(payload: bytes | bytearray | memoryview) -> Tensor:
    """Decode a payload with whatever codec its header names."""
    return peek(payload)[0].decode(payload)


# ---------------------------------------------------------------- dense float codecs


class _DenseCodec(Codec):
    """Every element stored in the value format ``name``; no parameters."""

    def _body_nbytes(self, numel: int) -> int:
        return _values_nbytes(numel, self.name)

    def _encode_body(self, x: np.ndarray) -> Body:
        return _encode_values(x, self.name)

    def _decode_body(self, buf: memoryview, offset: int, numel: int) -> Tensor:
        return _decode_values(buf, offset, numel, self.name)

    def _bound(self, x: np.ndarray) -> float:
        return _value_bound(_peak(x), self.name)


class Fp32Codec(_DenseCodec):
    """Raw float32, 4 B/elem.  Lossless: bound 0."""

    codec_id, name, lossless = 1, "fp32", True


class Fp16Codec(_DenseCodec):
    """IEEE half, 2 B/elem; encode rejects |x| > 65504.
    Bound: max|x| * 2^-11 + 2^-24 (round to nearest; <= 2^-25 absolute among subnormals)."""

    codec_id, name = 2, "fp16"


class Bf16Codec(_DenseCodec):
    """bfloat16 (round to nearest even), 2 B/elem; encode rejects values that round to inf.
    Bound: max|x| * 2^-8 + 2^-133."""

    codec_id, name = 3, "bf16"


# ---------------------------------------------------------------- block-quantized codecs


class _BlockCodec(Codec):
    """Shared int8/int4 logic.  Parameter: uint32 block.  Body: ceil(n / block) float32 scales,
    then the packed values.  An all-zero block has scale 0 and decodes to zeros."""

    levels: ClassVar[int]
    params_struct = struct.Struct("<I")

    def __init__(self, block: int = 64) -> None:
        if not isinstance(block, int) or not 1 <= block < 2**32:
            raise ValueError(f"block must be an int in [1, 2^32), got {block!r}")
        self.block = block
        base = f"int{8 if self.levels == 127 else 4}"
        self.name = base if block == 64 else f"{base}:{block}"

    def _params(self) -> tuple:
        return (self.block,)

    def _bound(self, x: np.ndarray) -> float:
        return _quant_bound(_peak(x), self.levels)


class Int8Codec(_BlockCodec):
    """Symmetric block-wise int8: per block (default 64) a float32 scale max|block| / 127, then
    round(x / scale) in [-127, 127] as int8 (-128 is rejected on decode).
    Bound: scale / 2 per element, i.e. max|x| / 254, plus slack max|x| * 2^-21 + 2^-140."""

    codec_id, levels = 4, 127

    def _body_nbytes(self, numel: int) -> int:
        return 4 * -(-numel // self.block) + numel

    def _encode_body(self, x: np.ndarray) -> Body:
        return list(_quantize(x, self.block, self.levels))

    def _decode_body(self, buf: memoryview, offset: int, numel: int) -> Tensor:
        n_blocks = -(-numel // self.block)
        q = _np(buf, "i1", numel, offset + 4 * n_blocks)
        return _dequantize(_np(buf, "<f4", n_blocks, offset), q, self.block)


class Int4Codec(_BlockCodec):
    """Symmetric block-wise 4-bit, as in Streaming DiLoCo (arXiv 2501.18512): per block a float32
    scale max|block| / 7, values round(x / scale) in [-7, 7] stored as v + 8 in a nibble;
    element 2i is the low nibble of byte i, element 2i+1 the high one; for odd numel the last
    high nibble is 8 (zero).  Nibble 0 (-8) is rejected on decode.
    Bound: scale / 2 per element, i.e. max|x| / 14, plus slack max|x| * 2^-21 + 2^-140."""

    codec_id, levels = 5, 7

    def _body_nbytes(self, numel: int) -> int:
        return 4 * -(-numel // self.block) + -(-numel // 2)

    def _encode_body(self, x: np.ndarray) -> Body:
        scales, q = _quantize(x, self.block, self.levels)
        u = _rows((q + 8).view(np.uint8), 2)  # (q + 8) is in 1..15; the pad is fixed below
        if x.size % 2:
            u[-1, 1] = 8
        return [scales, u[:, 0] | (u[:, 1] << 4)]

    def _decode_body(self, buf: memoryview, offset: int, numel: int) -> Tensor:
        n_blocks = -(-numel // self.block)
        packed = _np(buf, "u1", -(-numel // 2), offset + 4 * n_blocks)
        nibbles = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)
        if (nibbles == 0).any():
            raise CodecError("int4 nibble 0 (value -8) is outside the symmetric range [-7, 7]")
        if numel % 2 and nibbles[-1] != 8:
            raise CodecError(f"int4 padding nibble is {nibbles[-1]}, expected 8 (zero)")
        q = nibbles[:numel].view(np.int8) - np.int8(8)
        return _dequantize(_np(buf, "<f4", n_blocks, offset), q, self.block)


# ---------------------------------------------------------------- sparse codecs


class TopKCodec(Codec):
    """Keep the k = min(numel, max(1, ceil(ratio * numel))) largest |x| (k = 0 if numel = 0).
    Parameters: float64 ratio, uint8 value format (0 fp32, 1 fp16, 2 int8 = the kept-values
    vector block-quantized by the int8 quantizer with block 64).  Body: k uint32 indices,
    strictly ascending, then the k values.  numel must be <= 2^32.
    Bound: max(largest dropped |x|, value-format error of the kept values), the latter being
    0 (fp32), max|x| * 2^-11 + 2^-24 (fp16) or the Int8Codec bound of max|x| (int8)."""

    codec_id = 6
    params_struct = struct.Struct("<dB")

    def __init__(self, ratio: float, values: str | int = "fp32") -> None:
        ratio = float(ratio)
        if not (math.isfinite(ratio) and 0.0 < ratio <= 1.0):
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio!r}")
        self.ratio, self.values = ratio, _value_format(values)
        self.name = f"topk:{ratio!r}" + ("" if self.values == "fp32" else f":{self.values}")
        self.lossless = ratio == 1.0 and self.values == "fp32"

    def _params(self) -> tuple:
        return (self.ratio, VALUE_FORMATS.index(self.values))

    def k(self, numel: int) -> int:
        """Number of entries kept out of ``numel``."""
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    def _body_nbytes(self, numel: int) -> int:
        return 4 * self.k(numel) + _values_nbytes(self.k(numel), self.values)

    def _select(self, x: np.ndarray) -> np.ndarray:
        """Ascending indices of the k largest |x| (argpartition: O(n), deterministic)."""
        n, k = x.size, self.k(x.size)
        if n > 2**32:
            raise CodecError(f"top-k indices are uint32; {n} elements is too many")
        idx = np.argpartition(np.abs(x), n - k)[n - k :] if k < n else np.arange(n)
        return np.sort(idx)

    def _encode_body(self, x: np.ndarray) -> Body:
        idx = self._select(x)
        return [idx.astype("<u4"), *_encode_values(x[idx], self.values)]

    def _on_device(self, x: Tensor) -> Body:
        """Select on x's device (torch.topk; ties may pick other indices than the host's
        argpartition, equally valid); only the k indices and values cross to the host."""
        n, k = x.numel(), self.k(x.numel())
        if n > 2**32:
            raise CodecError(f"top-k indices are uint32; {n} elements is too many")
        if n and not bool(torch.isfinite(x).all()):
            raise CodecError(f"tensor of {n} elements contains NaN or Inf")
        if k < n:
            idx = torch.sort(torch.topk(x.abs(), k, sorted=False).indices).values
        else:
            idx = torch.arange(n, device=x.device)
        vals = x[idx].cpu().numpy()
        return [idx.cpu().numpy().astype("<u4"), *_encode_values(vals, self.values)]

    def _parts(self, buf: memoryview, offset: int, numel: int) -> tuple[Tensor, Tensor]:
        """(checked indices int64, values) of a payload, on the host."""
        if numel > 2**32:
            raise CodecError(f"top-k payload claims {numel} elements; uint32 indices allow 2^32")
        k = self.k(numel)
        idx = _np(buf, "<u4", k, offset).astype(np.int64)
        if k > 1 and not (np.diff(idx) > 0).all():
            raise CodecError("top-k indices are not strictly ascending")
        if k and idx[-1] >= numel:
            raise CodecError(f"top-k index {idx[-1]} out of range for {numel} elements")
        return torch.from_numpy(idx), _decode_values(buf, offset + 4 * k, k, self.values)

    def _decode_body(self, buf: memoryview, offset: int, numel: int) -> Tensor:
        idx, vals = self._parts(buf, offset, numel)
        out = torch.zeros(numel, dtype=torch.float32)
        out[idx] = vals
        return out

    def _decode_to(self, buf: memoryview, offset: int, numel: int, device: torch.device) -> Tensor:
        idx, vals = self._parts(buf, offset, numel)  # k entries cross, not numel
        out = torch.zeros(numel, dtype=torch.float32, device=device)
        out[idx.to(device)] = vals.to(device)
        return out

    def _bound(self, x: np.ndarray) -> float:
        dropped = np.ones(x.size, dtype=bool)
        dropped[self._select(x)] = False
        return max(_peak(x[dropped]), _value_bound(_peak(x), self.values))


class DctCodec(Codec):
    """DeMo-style DCT top-k (arXiv 2411.19870): zero-pad to chunks of ``chunk``, orthonormal
    DCT-II per chunk, keep the k largest |coeff| of every chunk.  Parameters: uint32 chunk
    (1..65536), uint32 k (1..chunk), uint8 value format (as TopKCodec).  Body: n_chunks * k
    indices (uint8 if chunk <= 256, else uint16; strictly ascending within a chunk), then the
    n_chunks * k values, chunk-major.  Inputs whose coefficients overflow float32 raise.
    Bound: the transform is orthonormal, so a chunk's l2 reconstruction error equals the l2 norm
    of its coefficient error, and l_inf <= l2.  Per chunk: sqrt(||dropped||^2 + k * e^2), e the
    value-format error at max|coeff|; the bound is the max over chunks plus the worst-case
    float32 round-off of both transforms, (chunk^1.5 + sqrt(chunk) * (k + 2)) * (2^-24 * max
    chunk l2 norm + sqrt(chunk) * 2^-149) (relative error 2^-24 per operation, or up to
    2^-150 absolute among subnormals; the inverse sums the k kept terms one by one in a fixed
    order, so that decoding is bit-exact on every thread count and CPU).
    Subclasses change only the transform: ``dims`` and ``_transform``/``_inverse``."""

    codec_id = 7
    params_struct = struct.Struct("<IIB")
    head, size_name, max_size, dims = "dct", "chunk", 65536, 1

    def __init__(self, chunk: int = 64, k: int = 8, values: str | int = "fp32") -> None:
        size, what = chunk, f"{self.head.upper()} {self.size_name}"
        if not isinstance(size, int) or not 1 <= size <= self.max_size:
            raise ValueError(f"{what} must be an int in [1, {self.max_size}], got {size!r}")
        self.size, self.chunk = size, size**self.dims  # transform length; elements per chunk
        if not isinstance(k, int) or not 1 <= k <= self.chunk:
            raise ValueError(f"DCT k must be an int in [1, {self.chunk}] for {what} {size}: {k!r}")
        self.k, self.values = k, _value_format(values)
        self.index_dtype = "u1" if self.chunk <= 256 else "<u2"
        fmt = "" if self.values == "fp32" else f":{self.values}"
        self.name = f"{self.head}:{size}:{k}{fmt}"

    def _params(self) -> tuple:
        return (self.size, self.k, VALUE_FORMATS.index(self.values))

    def _transform(self, x: Tensor) -> Tensor:
        return dct_chunks(x, self.chunk)

    def _inverse(self, coeffs: Tensor, numel: int) -> Tensor:
        return idct_chunks(coeffs, numel)

    def _inverse_sparse(self, idx: Tensor, vals: Tensor, numel: int) -> Tensor:
        return idct_sparse(idx, vals, numel, self.chunk)

    def _body_nbytes(self, numel: int) -> int:
        kept = -(-numel // self.chunk) * self.k
        return kept * np.dtype(self.index_dtype).itemsize + _values_nbytes(kept, self.values)

    def _select(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(coefficients, kept indices ascending within each chunk), shared by encode and bound."""
        coeffs = self._transform(torch.from_numpy(x)).numpy()
        if not np.isfinite(coeffs).all():
            raise CodecError("DCT coefficients overflow float32")
        idx = np.argpartition(np.abs(coeffs), self.chunk - self.k, axis=1)[:, self.chunk - self.k :]
        return coeffs, np.sort(idx, axis=1)

    def _encode_body(self, x: np.ndarray) -> Body:
        coeffs, idx = self._select(x)
        vals = np.take_along_axis(coeffs, idx, axis=1).reshape(-1)
        return [idx.astype(self.index_dtype), *_encode_values(vals, self.values)]

    def _on_device(self, x: Tensor) -> Body:
        """Transform and select on x's device; only the kept coefficients cross to the
        host. The device's matmul rounds differently from the host's, so the payload may
        differ from a host encode of the same vector within the stated bound."""
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise CodecError(f"tensor of {x.numel()} elements contains NaN or Inf")
        coeffs = self._transform(x)
        if not bool(torch.isfinite(coeffs).all()):
            raise CodecError("DCT coefficients overflow float32")
        idx = torch.sort(torch.topk(coeffs.abs(), self.k, dim=1, sorted=False).indices).values
        vals = torch.gather(coeffs, 1, idx).reshape(-1).cpu().numpy()
        return [idx.cpu().numpy().astype(self.index_dtype), *_encode_values(vals, self.values)]

    def _decode_to(self, buf: memoryview, offset: int, numel: int, device: torch.device) -> Tensor:
        idx, vals = self._parts(buf, offset, numel)  # the kept coefficients cross, not numel
        out = self._inverse_sparse(idx.to(device), vals.to(device), numel)
        if not bool(torch.isfinite(out).all()):
            raise CodecError("DCT reconstruction overflows float32")
        return out

    def _parts(self, buf: memoryview, offset: int, numel: int) -> tuple[Tensor, Tensor]:
        """(checked indices (n_chunks, k) int64, values (n_chunks, k) float32), on the host."""
        n_chunks = -(-numel // self.chunk)
        kept = n_chunks * self.k
        idx = _np(buf, self.index_dtype, kept, offset).astype(np.int64).reshape(n_chunks, self.k)
        if kept and idx.max() >= self.chunk:
            raise CodecError(f"DCT index {idx.max()} out of range for chunk {self.chunk}")
        if not (np.diff(idx, axis=1) > 0).all():
            raise CodecError("DCT indices are not strictly ascending within a chunk")
        offset += kept * np.dtype(self.index_dtype).itemsize
        vals = _decode_values(buf, offset, kept, self.values).reshape(n_chunks, self.k)
        return torch.from_numpy(idx), vals.float()

    def _decode_body(self, buf: memoryview, offset: int, numel: int) -> Tensor:
        idx, vals = self._parts(buf, offset, numel)
        # from the kept coefficients alone, in a fixed order: bit-exact on every thread
        # count and CPU, which the canonical weights hash needs (covey/algorithms/dct.py)
        out = self._inverse_sparse(idx, vals, numel)
        if not np.isfinite(out.numpy()).all():
            raise CodecError("DCT reconstruction overflows float32")
        return out

    def _bound(self, x: np.ndarray) -> float:
        coeffs, idx = self._select(x)
        dropped = coeffs.astype(np.float64)
        np.put_along_axis(dropped, idx, 0.0, axis=1)
        e = _value_bound(_peak(coeffs), self.values)
        per_chunk = np.sqrt(np.square(dropped).sum(axis=1) + self.k * e * e)
        norms = np.linalg.norm(to_chunks(torch.from_numpy(x).double(), self.chunk).numpy(), axis=1)
        # The forward transform is dims matmul passes with dot products of length ``size``:
        # l2 error per chunk <= dims * size^1.5 * 2^-24 * norm. The inverse (decode, dct.py)
        # adds the k kept terms one after another, each from at most 2 multiplies, and their
        # absolute values sum to at most the chunk's norm (Cauchy-Schwarz on an orthonormal
        # basis): per element <= (k + 2) * 2^-24 * norm, l2 <= sqrt(chunk) times that.
        # Subnormal operands add up to 2^-149 absolute per operation.
        forward = self.dims * self.size**1.5
        inverse = math.sqrt(self.chunk) * (self.k + 2)
        roundoff = (forward + inverse) * 2.0**-24 * float(norms.max())
        subnormal = (forward + inverse) * math.sqrt(self.chunk) * 2.0**-149
        return float(per_chunk.max()) + roundoff + subnormal


class Dct2Codec(DctCodec):
    """2-D block DCT top-k, the transform DeMo (arXiv 2411.19870) applies to weight matrices:
    zero-pad to chunks of side * side elements, view each as a row-major (side, side) matrix X,
    take the separable orthonormal 2-D DCT-II C @ X @ C.T (C = dct_basis(side)) and keep the k
    largest |coeff| of every block.  For a row-major matrix exactly ``side`` columns wide each
    block is a side x side sub-block of the matrix, as in DeMo; otherwise a block is ``side``
    consecutive runs of ``side`` elements, stacked, still transformed orthonormally.
    Parameters: uint32 side (1..256), uint32 k (1..side^2), uint8 value format.  Body as
    DctCodec with chunk = side^2 (so uint8 indices if side <= 16, else uint16); the index of
    coefficient (r, c) of a block is r * side + c.
    Bound: as DctCodec with chunk = side^2, except that the forward transform's round-off is
    2 * side^1.5 (two length-side matmul passes) in place of chunk^1.5; the inverse's, a
    fixed-order sum of the k kept terms, is as DctCodec's."""

    codec_id = 9
    head, size_name, max_size, dims = "dct2", "side", 256, 2

    def __init__(self, side: int = 64, k: int = 32, values: str | int = "fp32") -> None:
        super().__init__(side, k, values)
        self.side = side

    def _transform(self, x: Tensor) -> Tensor:
        return dct2_chunks(x, self.side)

    def _inverse(self, coeffs: Tensor, numel: int) -> Tensor:
        return idct2_chunks(coeffs, numel, self.side)

    def _inverse_sparse(self, idx: Tensor, vals: Tensor, numel: int) -> Tensor:
        return idct2_sparse(idx, vals, numel, self.side)


# ---------------------------------------------------------------- sign


class SignCodec(Codec):
    """1 bit per element plus one float32 scale = mean|x| (summed in float64).  A set bit means
    x >= 0, so 0 and -0.0 encode as +.  Bits are np.packbits(bitorder="little"): element i is
    bit i % 8 of byte i // 8; unused high bits of the last byte must be 0.  Decodes to
    +/- scale: signs of nonzero entries and the l1 norm (numel * scale == sum|x| up to the
    float32 rounding of scale) are preserved.  Bound: max|x| + scale."""

    codec_id, name = 8, "sign"

    def _body_nbytes(self, numel: int) -> int:
        return 4 + -(-numel // 8)

    @staticmethod
    def _scale(x: np.ndarray) -> float:
        return float(np.float32(np.abs(x).sum(dtype=np.float64) / x.size)) if x.size else 0.0

    def _encode_body(self, x: np.ndarray) -> Body:
        return [struct.pack("<f", self._scale(x)), np.packbits(x >= 0, bitorder="little")]

    def _decode_body(self, buf: memoryview, offset: int, numel: int) -> Tensor:
        (scale,) = struct.unpack_from("<f", buf, offset)
        if not (math.isfinite(scale) and scale >= 0.0):
            raise CodecError(f"sign scale is {scale}, expected finite and >= 0")
        bits = _np(buf, "u1", -(-numel // 8), offset + 4)
        if numel % 8 and bits[-1] >> (numel % 8):
            raise CodecError("sign payload has nonzero padding bits")
        positive = np.unpackbits(bits, count=numel, bitorder="little").view(bool)
        return torch.from_numpy(np.where(positive, np.float32(scale), np.float32(-scale)))

    def _bound(self, x: np.ndarray) -> float:
        return _peak(x) + self._scale(x)


# ---------------------------------------------------------------- registry and spec parsing

_CODECS_BY_ID: dict[int, type[Codec]] = {
    c.codec_id: c
    for c in (
        *(Fp32Codec, Fp16Codec, Bf16Codec, Int8Codec, Int4Codec),
        *(TopKCodec, DctCodec, SignCodec, Dct2Codec),
    )
}
CODEC_SPECS = (
    "fp32", "fp16", "bf16", "int8", "int4", "topk:0.01:fp16", "dct:64:8:fp16", "dct2:64:32:fp16",
    "sign",
)  # fmt: skip


def _parse_int(text: str, what: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{what} must be a positive integer, got {text!r}")
    return int(text)


def get_codec(spec: str) -> Codec:
    """Parse a codec spec (see ``VALID_FORMS``); ``get_codec(c.name) == c`` for every codec."""
    if not isinstance(spec, str):
        raise ValueError(f"codec spec must be a str, got {type(spec).__name__}")
    head, *args = spec.strip().lower().split(":")
    plain = {"fp32": Fp32Codec, "fp16": Fp16Codec, "bf16": Bf16Codec, "sign": SignCodec}
    try:
        if head in plain and not args:
            return plain[head]()
        if head in ("int8", "int4") and len(args) <= 1:
            cls = Int8Codec if head == "int8" else Int4Codec
            return cls(_parse_int(args[0], "block")) if args else cls()
        if head == "topk" and len(args) in (1, 2):
            try:
                ratio = float(args[0])
            except ValueError:
                raise ValueError(f"top-k ratio must be a number, got {args[0]!r}") from None
            return TopKCodec(ratio, *args[1:])
        if head in ("dct", "dct2") and len(args) in (2, 3):
            cls = DctCodec if head == "dct" else Dct2Codec
            size = _parse_int(args[0], f"{head.upper()} {cls.size_name}")
            return cls(size, _parse_int(args[1], "DCT k"), *args[2:])
    except ValueError as exc:
        raise ValueError(f"bad codec spec {spec!r}: {exc}. Valid forms: {VALID_FORMS}") from exc
    raise ValueError(f"unknown codec spec {spec!r}. Valid forms: {VALID_FORMS}")
