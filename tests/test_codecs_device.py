"""The device int8/int4 quantizer (covey/algorithms/quant_device.py) writes the host numpy
codec's bytes and decodes to its bits. The device path is run here on CPU tensors by calling
it directly (a CPU tensor's `encode` takes the numpy path); on a CUDA device the same torch
operations run, each an IEEE float32 operation that rounds alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from covey.algorithms.codec_base import _HEADER, HEADER_BYTES, CodecError
from covey.algorithms.codecs import get_codec
from covey.algorithms.quant_device import decode_block, dequantize

SPECS = ["int8", "int4", "int8:7", "int4:3", "int4:1", "int8:1"]
TINY = float(np.finfo(np.float32).tiny)
FMAX = float(np.finfo(np.float32).max)


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    signed = [0.0, 1.0, 0.5, 2.5, TINY, 1e-45, FMAX, 3.0e38, 1e-38, 6.5, 7.5, 126.5]
    edge = torch.tensor([v * s for v in signed for s in (1.0, -1.0)])
    half_steps = torch.arange(-20, 21, dtype=torch.float32) / 2  # ties of x / scale
    return [
        torch.randn(1000, generator=g),
        torch.randn(129, generator=g) * 1e-30,
        torch.randn(65, generator=g) * 1e30,
        edge,
        half_steps,
        torch.zeros(130),
        -torch.zeros(64),
        torch.cat([torch.zeros(64), -torch.zeros(64), torch.randn(7, generator=g)]),
        torch.empty(0),
        torch.tensor([3.0]),
        torch.full((127,), FMAX),
    ]


def _device_payload(codec, x: torch.Tensor) -> bytes:
    head = _HEADER.pack(b"CVY1", codec.codec_id, x.numel())
    return b"".join([head, codec.params_struct.pack(*codec._params()), *codec._on_device(x)])


@pytest.mark.parametrize("spec", SPECS)
def test_device_encode_writes_the_host_bytes(spec: str) -> None:
    codec = get_codec(spec)
    for x in _inputs():
        host = codec.encode(x)
        assert _device_payload(codec, x) == host, (spec, x[:8])


@pytest.mark.parametrize("spec", SPECS)
def test_device_decode_and_roundtrip_give_the_host_bits(spec: str) -> None:
    codec = get_codec(spec)
    offset = HEADER_BYTES + codec.params_struct.size
    for x in _inputs():
        payload = codec.encode(x)
        host = codec.decode(payload)
        buf = memoryview(payload)
        dev = decode_block(buf, offset, x.numel(), codec.block, codec.levels, torch.device("cpu"))
        assert torch.equal(dev.view(torch.int32), host.view(torch.int32))
        scales, q, _ = codec._device_parts(x)
        assert torch.equal(
            dequantize(scales, q, codec.block).view(torch.int32), host.view(torch.int32)
        )


@pytest.mark.parametrize("spec", ["int8", "int4:3"])
def test_device_decode_rejects_what_the_host_rejects(spec: str) -> None:
    codec = get_codec(spec)
    offset = HEADER_BYTES + codec.params_struct.size
    x = torch.randn(11)
    payload = bytearray(codec.encode(x))
    bad_values = bytearray(payload)
    bad_values[offset + 4 * -(-11 // codec.block)] = 0x80 if spec == "int8" else 0x00
    bad_scale = bytearray(payload)
    bad_scale[offset : offset + 4] = np.float32(np.nan).tobytes()
    cases = [bad_values, bad_scale]
    if spec != "int8":  # odd numel: the last high nibble must be 8
        bad_pad = bytearray(payload)
        bad_pad[-1] = (bad_pad[-1] & 0x0F) | 0x30
        cases.append(bad_pad)
    for bad in cases:
        with pytest.raises(CodecError) as host_err:
            codec.decode(bytes(bad))
        with pytest.raises(CodecError) as dev_err:
            decode_block(memoryview(bytes(bad)), offset, 11, codec.block, codec.levels,
                         torch.device("cpu"))  # fmt: skip
        assert str(dev_err.value) == str(host_err.value)


def test_device_encode_rejects_non_finite() -> None:
    for spec in ("int8", "int4"):
        with pytest.raises(CodecError, match="NaN or Inf"):
            get_codec(spec)._on_device(torch.tensor([1.0, float("nan")]))
        with pytest.raises(CodecError, match="NaN or Inf"):
            get_codec(spec)._on_device(torch.tensor([float("inf")] + [0.0] * 70))


def test_roundtrip_on_the_host_is_encode_then_decode() -> None:
    x = torch.randn(300)
    for spec in ("int8", "int4", "topk:0.1", "fp16"):
        codec = get_codec(spec)
        payload, decoded = codec.roundtrip(x)
        assert payload == codec.encode(x)
        assert torch.equal(decoded, codec.decode(payload))
