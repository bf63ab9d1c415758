"""The int8/int4 block quantizer in torch, on the tensor's own device: the same wire bytes as
covey.algorithms.codec_base's numpy quantizer (tests/test_codecs_device.py compares them on
random tensors and edge values), with only the payload crossing to the host; and the dense
value formats' (fp32, fp16, bf16) decode there, the same floats as the host's.

Every step is an IEEE float32 operation that rounds the same on any device: max|block| (a
comparison), one division by `levels`, x / scale rounded half-to-even, q * scale. A scale
that comes out as -0.0 (an all-zero block) is written as +0.0 on both paths.

Host <-> device copies go through one contiguous uint8 buffer, page-locked when the device is
CUDA, so that the copy is a single DMA transfer of the wire bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from covey.algorithms.codec_base import CodecError


def _rows(x: Tensor, block: int) -> Tensor:
    """(ceil(n / block), block) rows of x, zero-padding the last one."""
    pad = -x.numel() % block
    return (torch.cat([x, x.new_zeros(pad)]) if pad else x).reshape(-1, block)


def quantize(x: Tensor, block: int, levels: int) -> tuple[Tensor, Tensor]:
    """(scales float32, q int8) on x's device, bit for bit `codec_base._quantize`'s.
    CodecError (one host sync) when x holds NaN or Inf."""
    rows = _rows(x, block)
    peaks = torch.maximum(-rows.amin(dim=1), rows.amax(dim=1))
    if x.numel() and not bool(torch.isfinite(peaks).all()):
        raise CodecError(f"tensor of {x.numel()} elements contains NaN or Inf")
    scales = peaks / levels + 0.0  # + 0.0: a -0.0 scale becomes +0.0
    # near float32's max, levels * scale can round up to inf: step toward zero (as the host)
    overflow = ~torch.isfinite(scales * levels)
    scales = torch.where(overflow, torch.nextafter(scales, torch.zeros_like(scales)), scales)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / divisor[:, None]).clamp_(-levels, levels)
    return scales, q.to(torch.int8).reshape(-1)[: x.numel()]


def dequantize(scales: Tensor, q: Tensor, block: int) -> Tensor:
    """q * scale per block, float32, on q's device: `codec_base._dequantize`'s bits (that
    function also checks the payload; `decode_block` does here)."""
    rows = _rows(q.to(torch.float32), block) * scales[:, None]
    return rows.reshape(-1)[: q.numel()]


def pack_int4(q: Tensor) -> Tensor:
    """Nibbles v + 8, element 2i low and 2i+1 high; an odd tail's high nibble is 8."""
    u = (q + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_full((1,), 8)])
    u = u.reshape(-1, 2)
    return u[:, 0] | (u[:, 1] << 4)


def unpack_int4(packed: Tensor, numel: int) -> Tensor:
    """The nibbles of `pack_int4`, as uint8 in 0..15 (padding included)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)


def to_host(parts: list[Tensor]) -> list[np.ndarray]:
    """The parts' bytes on the host in one copy: concatenated as uint8 on their device, then
    copied into a page-locked host buffer (CUDA) and split; the bytes are little-endian as
    the wire wants (torch devices are)."""
    flat = [p.contiguous().reshape(-1).view(torch.uint8) for p in parts]
    joined = torch.cat(flat)
    pin = joined.device.type == "cuda"
    host = torch.empty(joined.numel(), dtype=torch.uint8, pin_memory=pin)
    host.copy_(joined, non_blocking=pin)
    if pin:
        torch.cuda.current_stream(joined.device).synchronize()
    out, at = [], 0
    arr = host.numpy()
    for p in flat:
        out.append(arr[at : at + p.numel()])
        at += p.numel()
    return out


def to_device(buf: memoryview, offset: int, nbytes: int, device: torch.device) -> Tensor:
    """nbytes of buf at offset as a fresh uint8 tensor on device (page-locked staging on
    CUDA); the tensor starts its own allocation, so float32 views of it are aligned."""
    raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset)
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host.numpy()[:] = raw
        return host.to(device, non_blocking=True)
    return torch.from_numpy(raw.copy()).to(device)


_DENSE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def decode_dense(
    buf: memoryview, offset: int, numel: int, fmt: str, device: torch.device
) -> Tensor:
    """`numel` fp32, fp16 or bf16 values at `offset` decoded on device: the wire bytes cross
    once and are widened to float32 there (exact, as the host's astype is). CodecError as
    the host decoder's when a value is NaN or Inf (one host sync)."""
    dtype = _DENSE[fmt]
    raw = to_device(buf, offset, numel * dtype.itemsize, device)
    out = raw.view(dtype).float()  # fp32: the fresh buffer itself
    if numel and not bool(torch.isfinite(out).all()):
        raise CodecError("values contain NaN or Inf")
    return out


def decode_block(
    buf: memoryview, offset: int, numel: int, block: int, levels: int, device: torch.device
) -> Tensor:
    """An int8 (levels 127) or int4 (levels 7) body decoded on device, with the host
    decoder's checks (one host sync for all of them): scales finite and >= 0, no -128 / no
    nibble 0, int4 padding nibble 8, no overflow when dequantized."""
    n_blocks = -(-numel // block)
    body = 4 * n_blocks + (numel if levels == 127 else -(-numel // 2))
    raw = to_device(buf, offset, body, device)
    scales = raw[: 4 * n_blocks].view(torch.float32)
    if levels == 127:
        q = raw[4 * n_blocks :].view(torch.int8)
        bad_q = (q == -128).any()
        pad_bad = torch.zeros((), dtype=torch.bool, device=device)
    else:
        nibbles = unpack_int4(raw[4 * n_blocks :], numel)
        bad_q = (nibbles == 0).any()
        pad_bad = (nibbles[-1] != 8) if numel % 2 else torch.zeros((), dtype=torch.bool)
        q = nibbles[:numel].to(torch.int8) - 8
    out = dequantize(scales, q, block)
    checks = [
        (torch.isfinite(scales) & (scales >= 0)).all(),
        ~bad_q,
        ~pad_bad.to(device),
        torch.isfinite(out).all(),
    ]
    if bool(torch.stack(checks).all()):  # the one sync of a valid payload
        return out
    if not bool(checks[0]):
        raise CodecError("block scales must be finite and >= 0")
    if not bool(checks[1]):
        if levels == 127:
            raise CodecError("quantized value -128 is outside the symmetric range [-127, 127]")
        raise CodecError("int4 nibble 0 (value -8) is outside the symmetric range [-7, 7]")
    if not bool(checks[2]):
        raise CodecError(f"int4 padding nibble is {int(nibbles[-1])}, expected 8 (zero)")
    raise CodecError("dequantized values overflow float32: a block scale is too large")
