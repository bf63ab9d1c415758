"""What every tensor codec shares: the contract, the wire header, the checks, the block
quantizer and the value formats, and reading a payload's header (``peek``, ``decode_any``).
The codecs themselves: covey.algorithms.codecs (dense, block-quantized, sign; ``get_codec``)
and covey.algorithms.sparse_codecs (top-k, DCT).

Contract:

* ``encode(x)`` takes a 1-D float32 tensor without NaN/Inf (anything else raises
  ``CodecError``) and returns ``bytes``.  On another device than the CPU, top-k and DCT
  select (and DCT transforms) on that device and copy only the kept entries to the host;
  int8 and int4 quantize on that device (covey.algorithms.quant_device) and copy only the
  payload; the others copy the vector to the host once: bytes for the wire are made there.
  It is stateless and deterministic: the same input gives the same bytes.  Error feedback
  is the caller's job, not the codec's.
* ``decode(payload, numel=None, device=None)`` returns a fresh, writable 1-D float32 tensor
  (on ``device``, default the CPU; top-k and DCT scatter/invert on that device, int8 and
  int4 copy the payload there and check and dequantize it there).  It checks the
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
"""

from __future__ import annotations

import math
import struct
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

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
Body = list[bytes | np.ndarray]
_CODECS_BY_ID: dict[int, type[Codec]] = {}  # every concrete codec, as its class is defined


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
    # + 0: an all-zero block's scale is +0.0 whichever zero the reduction returned (the
    # device quantizer, covey/algorithms/quant_device.py, writes the same bytes)
    scales = np.maximum(-rows.min(axis=1), rows.max(axis=1)) / np.float32(levels) + np.float32(0)
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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "codec_id" in cls.__dict__:  # a concrete codec: a header names it by its id
            known = _CODECS_BY_ID.setdefault(cls.codec_id, cls)
            if known is not cls:
                raise TypeError(f"codec id {cls.codec_id} is {known.__name__}'s already")

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
        *,
        device_kernels: bool = False,
    ) -> Tensor:
        """The payload's vector (see the module docstring), on `device` (default the CPU).
        `device_kernels`: decode with the torch kernels a device decodes with also on the
        CPU (the same floats; what covey.algorithms.device_round runs there, in tests)."""
        target = torch.device("cpu") if device is None else torch.device(device)
        buf, n = self._check_payload(payload, numel)
        offset = HEADER_BYTES + self.params_struct.size
        if target.type == "cpu" and not device_kernels:
            return self._decode_body(buf, offset, n)
        return self._decode_to(buf, offset, n, target)

    def roundtrip(self, x: Tensor) -> tuple[bytes, Tensor]:
        """(encode(x), decode of those bytes on x's device): what error feedback keeps.
        The same bits as encoding and decoding; codecs that quantize on the device take the
        decoded vector from their encoder's values instead of sending the payload back."""
        payload = self.encode(x)
        return payload, self.decode(payload, device=x.device)

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
