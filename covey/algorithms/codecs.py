"""Tensor codecs: a flat float32 tensor <-> ``bytes`` on the wire, and ``get_codec``, which
builds one from its spec. The contract every codec keeps and the wire header are
covey.algorithms.codec_base's; the sparse codecs (top-k, DCT) are in
covey.algorithms.sparse_codecs.

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
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from covey.algorithms import quant_device
from covey.algorithms.codec_base import (
    _HEADER,
    MAGIC,
    Body,
    Codec,
    CodecError,
    _check_tensor,
    _decode_values,
    _dequantize,
    _encode_values,
    _np,
    _peak,
    _quant_bound,
    _quantize,
    _rows,
    _value_bound,
    _values_nbytes,
)
from covey.algorithms.sparse_codecs import Dct2Codec, DctCodec, TopKCodec

# ---------------------------------------------------------------- dense float codecs


class _DenseCodec(Codec):
    """Every element stored in the value format ``name``; no parameters."""

    def _body_nbytes(self, numel: int) -> int:
        return _values_nbytes(numel, self.name)

    def _encode_body(self, x: np.ndarray) -> Body:
        return _encode_values(x, self.name)

    def _decode_body(self, buf: memoryview, offset: int, numel: int) -> Tensor:
        return _decode_values(buf, offset, numel, self.name)

    def _decode_to(self, buf: memoryview, offset: int, numel: int, device: torch.device) -> Tensor:
        if device.type == "meta":  # no values there to check: checked on the host, then moved
            return super()._decode_to(buf, offset, numel, device)
        return quant_device.decode_dense(buf, offset, numel, self.name, device)

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

    def _device_parts(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(scales, q, packed values) of x, computed on x's device."""
        scales, q = quant_device.quantize(x, self.block, self.levels)
        return scales, q, q if self.levels == 127 else quant_device.pack_int4(q)

    def _on_device(self, x: Tensor) -> Body:
        """Quantize on x's device; only the payload's bytes cross to the host (the same
        bytes as a host encode)."""
        scales, _, packed = self._device_parts(x)
        return list(quant_device.to_host([scales, packed]))

    def _decode_to(self, buf: memoryview, offset: int, numel: int, device: torch.device) -> Tensor:
        if device.type == "meta":  # no values there to check: checked on the host, then moved
            return super()._decode_to(buf, offset, numel, device)
        return quant_device.decode_block(buf, offset, numel, self.block, self.levels, device)

    def roundtrip(self, x: Tensor) -> tuple[bytes, Tensor]:
        """On a device: the payload crosses to the host once and the decoded vector is
        q * scale of the encoder's own values, never copied back (the bits of a decode)."""
        if not isinstance(x, Tensor) or x.device.type == "cpu":
            return super().roundtrip(x)
        _check_tensor(x)
        scales, q, packed = self._device_parts(x.detach())
        head = _HEADER.pack(MAGIC, self.codec_id, x.numel())
        body = quant_device.to_host([scales, packed])
        payload = b"".join([head, self.params_struct.pack(*self._params()), *body])
        return payload, quant_device.dequantize(scales, q, self.block)


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

VALID_FORMS = (
    "fp32 | fp16 | bf16 | int8[:<block>] | int4[:<block>] | topk:<ratio>[:<values>] | "
    "dct:<chunk>:<k>[:<values>] | dct2:<side>:<k>[:<values>] | sign   "
    "(values: fp32 (default), fp16, int8)"
)
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
