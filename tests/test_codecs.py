"""Tests for covey.algorithms.dct and the codecs (covey.algorithms.codec_base, codecs and
sparse_codecs)."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from covey.algorithms.codec_base import HEADER_BYTES, Codec, CodecError, decode_any, peek
from covey.algorithms.codecs import CODEC_SPECS, get_codec
from covey.algorithms.dct import (
    dct2_chunks,
    dct_basis,
    dct_chunks,
    idct2_chunks,
    idct2_sparse,
    idct_chunks,
    idct_sparse,
    to_chunks,
)
from covey.algorithms.sparse_codecs import DctCodec

# Variants beyond the one-per-codec examples: other blocks, value formats, wide DCT chunks,
# small and odd 2-D DCT sides (uint8 indices up to side 16).
EXTRA_SPECS = (
    "int8:32",
    "int4:5",
    "topk:0.1",
    "topk:1.0",
    "topk:0.05:int8",
    "dct:64:8",
    "dct:16:3:int8",
    "dct:300:20",
    "dct2:8:5",
    "dct2:16:100",
    "dct2:17:30:int8",
)
ALL_SPECS = CODEC_SPECS + EXTRA_SPECS
HEADER = 4 + 1 + 8


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"normal{n}": torch.randn(n, generator=g) for n in (1, 63, 1000, 4097)}
    outlier = torch.randn(1000, generator=g) * 0.01
    outlier[123] = 50.0
    out["outlier"] = outlier
    out["zeros"] = torch.zeros(100)
    out["subnormal"] = torch.randn(300, generator=g) * 1e-39  # below float32's min normal
    out["empty"] = torch.zeros(0)
    return out


INPUTS = _inputs()


def _value_bytes(count: int, fmt: str) -> int:
    return {"fp32": 4 * count, "fp16": 2 * count}.get(fmt, 4 * math.ceil(count / 64) + count)


def expected_nbytes(spec: str, n: int) -> int:
    """Payload size computed from the documented layout, independently of the codec code."""
    head, *args = spec.split(":")
    if head == "fp32":
        return HEADER + 4 * n
    if head in ("fp16", "bf16"):
        return HEADER + 2 * n
    if head in ("int8", "int4"):
        b = int(args[0]) if args else 64
        body = n if head == "int8" else math.ceil(n / 2)
        return HEADER + 4 + 4 * math.ceil(n / b) + body
    if head == "topk":
        fmt = args[1] if len(args) > 1 else "fp32"
        k = min(n, max(1, math.ceil(float(args[0]) * n))) if n else 0
        return HEADER + 8 + 1 + 4 * k + _value_bytes(k, fmt)
    if head in ("dct", "dct2"):  # dct2 is dct with chunk = side^2 (parameter: side)
        chunk, k = int(args[0]) ** (1 if head == "dct" else 2), int(args[1])
        fmt = args[2] if len(args) > 2 else "fp32"
        kept = math.ceil(n / chunk) * k
        return HEADER + 4 + 4 + 1 + kept * (1 if chunk <= 256 else 2) + _value_bytes(kept, fmt)
    assert head == "sign"
    return HEADER + 4 + math.ceil(n / 8)


def _max_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).abs().max()) if x.numel() else 0.0


# ---------------------------------------------------------------- DCT


@pytest.mark.parametrize("n", [8, 64, 128])
def test_dct_basis_orthonormal(n: int) -> None:
    c = dct_basis(n)
    assert c.shape == (n, n) and c.dtype == torch.float32
    assert torch.allclose(c @ c.T, torch.eye(n), atol=1e-6)
    assert torch.allclose(c.T @ c, torch.eye(n), atol=1e-6)
    assert dct_basis(n) is c  # cached


def test_dct_basis_matches_definition() -> None:
    n = 8
    c = dct_basis(n, torch.float64)
    for k in (0, 1, 5):
        for j in (0, 3, 7):
            a = math.sqrt((1 if k == 0 else 2) / n)
            want = a * math.cos(math.pi * (2 * j + 1) * k / (2 * n))
            assert c[k, j].item() == pytest.approx(want)
    # A constant chunk has only a DC coefficient, sqrt(n) * value.
    coeffs = dct_chunks(torch.full((n,), 2.0, dtype=torch.float64), n)
    assert coeffs[0, 0].item() == pytest.approx(2.0 * math.sqrt(n))
    assert coeffs[0, 1:].abs().max().item() < 1e-12


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000])
def test_dct_round_trip_and_padding(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    rows = to_chunks(x, 64)
    assert rows.shape == (math.ceil(numel / 64), 64)
    assert torch.equal(rows.reshape(-1)[:numel], x)
    assert not rows.reshape(-1)[numel:].any()
    coeffs = dct_chunks(x, 64)
    assert coeffs.shape == rows.shape
    y = idct_chunks(coeffs, numel)
    assert y.shape == (numel,)
    assert torch.allclose(y, x, atol=1e-5)
    # Orthonormal: energy is preserved chunk by chunk.
    assert torch.allclose(coeffs.norm(dim=1), rows.norm(dim=1), rtol=1e-5)
    with pytest.raises(ValueError, match="numel"):
        idct_chunks(coeffs, coeffs.numel() + 1)


@pytest.mark.parametrize("side", [1, 8, 64])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 4095, 4096, 4097, 10000])
def test_dct2_round_trip_and_padding(side: int, numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    coeffs = dct2_chunks(x, side)
    assert coeffs.shape == (math.ceil(numel / side**2), side**2) and coeffs.dtype == x.dtype
    y = idct2_chunks(coeffs, numel, side)
    assert y.shape == (numel,)
    assert torch.allclose(y, x, atol=1e-5)
    assert torch.allclose(idct2_chunks(coeffs.reshape(-1, side, side), numel, side), y)
    # Orthonormal: energy is preserved block by block (the padding is zeros).
    rows = to_chunks(x, side * side)
    assert torch.allclose(coeffs.norm(dim=1), rows.norm(dim=1), rtol=1e-5)
    with pytest.raises(ValueError, match="numel"):
        idct2_chunks(coeffs, coeffs.numel() + 1, side)
    with pytest.raises(ValueError, match="coefficients"):
        idct2_chunks(coeffs, numel, side + 1)


def test_dct2_is_the_separable_2d_transform_of_each_block() -> None:
    g = torch.Generator().manual_seed(2)
    c = dct_basis(64, torch.float64)
    x = torch.randn(64, 64, generator=g, dtype=torch.float64)
    coeffs = dct2_chunks(x.reshape(-1), 64)
    assert coeffs.shape == (1, 4096)
    assert torch.allclose(coeffs.reshape(64, 64), c @ x @ c.T, atol=1e-12)
    # A constant block has only the (0, 0) coefficient, side * value.
    const = dct2_chunks(torch.full((64,), 3.0, dtype=torch.float64), 8)
    assert const[0, 0].item() == pytest.approx(3.0 * 8)
    assert const[0, 1:].abs().max().item() < 1e-12
    # A tall matrix of width `side` is cut into its side x side sub-blocks, top to bottom.
    tall = torch.randn(3 * 16, 16, generator=g, dtype=torch.float64)
    c16 = dct_basis(16, torch.float64)
    blocks = dct2_chunks(tall.reshape(-1), 16).reshape(3, 16, 16)
    for b in range(3):
        sub = tall[16 * b : 16 * (b + 1)]
        assert torch.allclose(blocks[b], c16 @ sub @ c16.T, atol=1e-12)
    # float32 agrees with the float64 reference up to round-off.
    coeffs32 = dct2_chunks(x.reshape(-1).float(), 64).double()
    assert torch.allclose(coeffs32, coeffs, atol=1e-4)
    with pytest.raises(ValueError, match="floating-point"):
        dct2_chunks(torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="side"):
        dct2_chunks(torch.zeros(4), 0)


# ---------------------------------------------------------------- round trips and sizes


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("name", list(INPUTS))
def test_round_trip_within_bound_and_size(spec: str, name: str) -> None:
    codec = get_codec(spec)
    x = INPUTS[name]
    payload = codec.encode(x)
    assert isinstance(payload, bytes)
    assert len(payload) == expected_nbytes(spec, x.numel()) == codec.nbytes(x.numel())
    y = codec.decode(payload, numel=x.numel())
    assert y.dtype == torch.float32 and y.shape == x.shape and y.is_contiguous()
    y.add_(1.0)  # writable, owns its memory
    y.sub_(1.0)
    y = codec.decode(payload)
    assert torch.equal(decode_any(payload), y)
    assert peek(payload) == (codec, x.numel())
    bound = codec.max_abs_error(x)
    err = _max_err(x, y)
    assert err <= bound, f"{spec} on {name}: error {err} > bound {bound}"
    peak = float(x.abs().max()) if x.numel() else 0.0
    if codec.lossless:
        assert torch.equal(x, y) and bound == 0.0
    if name == "zeros":
        assert not y.any()
    # Tightness: the bound is not vacuous, and is approached on generic inputs.
    if spec.startswith("int8"):
        assert bound <= peak / 100 + 1e-30
    if spec.startswith("int4"):
        assert bound <= peak / 13 + 1e-30
    if spec in ("fp16", "bf16"):
        assert bound <= peak * 2**-7 + 1e-7
    if name in ("normal1000", "normal4097") and not codec.lossless:
        # DCT bounds are per-chunk l2 norms (l_inf <= l2), so they are tight in l2 but, on white
        # noise, exceed the l_inf error by ~sqrt(chunk) / 4 (~16 for dct2:64's 4096-chunks).
        chunk = getattr(codec, "chunk", 1)
        assert err >= bound / max(16, math.sqrt(chunk) / 2), f"{spec}: bound {bound} vs {err}"
        if spec.startswith("dct"):
            worst = float(to_chunks((y - x).double(), chunk).norm(dim=1).max())
            assert worst >= bound / 2, f"{spec}: l2 bound {bound} is loose vs error {worst}"


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_extreme_magnitudes(spec: str) -> None:
    big = torch.finfo(torch.float32).max
    x = torch.tensor([big, -big, 1.0, -0.0, 1e-45, big / 3] * 11)
    codec = get_codec(spec)
    try:
        payload = codec.encode(x)
    except CodecError as exc:  # only formats that cannot represent the range may refuse
        assert spec.split(":")[-1] in ("fp16", "bf16") or spec.startswith("dct"), exc
        return
    y = codec.decode(payload)
    assert bool(torch.isfinite(y).all())
    assert _max_err(x, y) <= codec.max_abs_error(x)


def test_fp32_exact_and_topk_bound_attained() -> None:
    x = INPUTS["normal1000"]
    assert torch.equal(get_codec("fp32").decode(get_codec("fp32").encode(x)), x)
    codec = get_codec("topk:0.1")
    y = codec.decode(codec.encode(x))
    # fp32 values: the error is exactly the largest dropped magnitude.
    assert _max_err(x, y) == codec.max_abs_error(x) == float(x.abs().sort().values[-101])
    kept = y != 0
    assert int(kept.sum()) == 100 and torch.equal(y[kept], x[kept])


def test_dct_codec_exact_on_sparse_spectrum() -> None:
    # Each chunk is a combination of 3 basis vectors, so dct:64:3 loses nothing but round-off.
    g = torch.Generator().manual_seed(1)
    coeffs = torch.zeros(20, 64)
    coeffs.scatter_(1, torch.randint(0, 64, (20, 3), generator=g), torch.randn(20, 3, generator=g))
    x = idct_chunks(coeffs, 20 * 64)
    codec = get_codec("dct:64:3")
    assert _max_err(x, codec.decode(codec.encode(x))) < 1e-5
    # Only the (worst-case) float32 round-off slack remains in the bound.
    assert codec.max_abs_error(x) < 1e-3 * float(x.abs().max())


def test_dct2_codec_exact_on_sparse_spectrum() -> None:
    # Each 16 x 16 block is a combination of 3 2-D basis functions: dct2:16:3 keeps them all.
    g = torch.Generator().manual_seed(4)
    coeffs = torch.zeros(10, 256)
    coeffs.scatter_(1, torch.randint(0, 256, (10, 3), generator=g), torch.randn(10, 3, generator=g))
    x = idct2_chunks(coeffs, 10 * 256, 16)
    codec = get_codec("dct2:16:3")
    assert _max_err(x, codec.decode(codec.encode(x))) < 1e-5
    assert codec.max_abs_error(x) < 1e-3 * float(x.abs().max())


@pytest.mark.parametrize("spec", ["dct:7:7", "dct:64:64", "dct2:3:9", "dct2:7:49", "dct2:64:4096"])
def test_dct_round_off_bound_keeping_everything(spec: str) -> None:
    # k = chunk and fp32 values: the error is pure float32 round-off of the two transforms,
    # relative for normal inputs and absolute (2^-150 per operation) for subnormal ones.
    g = torch.Generator().manual_seed(5)
    codec = get_codec(spec)
    for scale in (1e-42, 1e-39, 1.0, 1e30):
        for _ in range(3):  # subnormal arithmetic is slow: keep this small
            x = torch.randn(1000, generator=g) * torch.exp(2 * torch.randn(1000, generator=g))
            x = (x * scale).float()
            err, bound = _max_err(x, codec.decode(codec.encode(x))), codec.max_abs_error(x)
            assert err <= bound, f"{spec} at scale {scale}: error {err} > bound {bound}"


def test_dct2_beats_topk_on_a_smooth_matrix_at_equal_size() -> None:
    # A smooth (rank-1, slowly varying) 64 x 64 matrix: its 2-D DCT energy sits in a few
    # low-frequency coefficients, so 32 of them reconstruct it far better than 24 raw entries.
    t = torch.linspace(0.0, 1.0, 64, dtype=torch.float64)
    step = 3 * t**2 - 2 * t**3  # smoothstep: flat ends, so its DCT decays fast
    x = torch.outer(1.0 + step, 2.0 - step).float().reshape(-1)
    dct2 = get_codec("dct2:64:32")
    topk = get_codec(f"topk:{24 / 4096!r}")  # 24 * (4 + 4) bytes == 32 * (2 + 4) bytes
    p_dct2, p_topk = dct2.encode(x), topk.encode(x)
    assert len(p_dct2) == len(p_topk) == HEADER + 9 + 192
    err_dct2 = _max_err(x, dct2.decode(p_dct2))
    err_topk = _max_err(x, topk.decode(p_topk))
    assert err_dct2 <= dct2.max_abs_error(x)
    assert err_dct2 < err_topk / 100, (err_dct2, err_topk)
    assert err_topk > 0.5 * float(x.abs().min())  # top-k zeroes almost every entry
    # A 1-D DCT over the rows needs a coefficient per row (more bytes) and is still far worse.
    dct1 = get_codec("dct:64:1")
    assert len(dct1.encode(x)) > len(p_dct2)
    assert err_dct2 < _max_err(x, dct1.decode(dct1.encode(x))) / 100


def test_dct_and_dct2_payloads_do_not_mix() -> None:
    x = INPUTS["normal4097"]
    for enc, dec in (("dct:64:32:fp16", "dct2:64:32:fp16"), ("dct2:8:8", "dct:8:8")):
        payload = get_codec(enc).encode(x)
        with pytest.raises(CodecError, match=repr(enc)):
            get_codec(dec).decode(payload)
        assert peek(payload)[0] == get_codec(enc) != get_codec(dec)
    # The same parameters under the other id: 1-D chunk 300 is not a valid 2-D side.
    p = get_codec("dct:300:32:fp16").encode(x)
    with pytest.raises(CodecError, match="parameters"):
        decode_any(p[:4] + bytes([get_codec("dct2:64:32").codec_id]) + p[5:])
    # dct:64:8 read as dct2:64:8 expects 64x more chunks' worth of body.
    p = get_codec("dct:64:8").encode(x)
    with pytest.raises(CodecError, match="bytes"):
        decode_any(p[:4] + bytes([get_codec("dct2:64:8").codec_id]) + p[5:])


def test_dct2_codec_limits() -> None:
    from covey.algorithms.sparse_codecs import Dct2Codec

    codec = Dct2Codec(256, 65536)  # the largest block: uint16 indices up to 65535
    assert codec.name == "dct2:256:65536" and codec.index_dtype == "<u2"
    assert Dct2Codec(16, 1).index_dtype == "u1" and Dct2Codec(17, 1).index_dtype == "<u2"
    assert Dct2Codec() == get_codec("dct2:64:32")
    for args in ((257, 8), (0, 1), (8, 65), (8, 0), (8.0, 8), (8, 8, "int4")):
        with pytest.raises(ValueError):
            Dct2Codec(*args)  # type: ignore[arg-type]


def test_sign_preserves_signs_and_l1() -> None:
    x = INPUTS["normal4097"].clone()
    x[7] = 0.0
    codec = get_codec("sign")
    y = codec.decode(codec.encode(x))
    nz = x != 0
    assert torch.equal(torch.sign(y[nz]), torch.sign(x[nz]))
    assert y[7] > 0  # zero encodes as +
    assert y.abs().double().sum().item() == pytest.approx(x.abs().double().sum().item(), rel=1e-6)
    assert len(set(y.abs().tolist())) == 1


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_encoding_is_deterministic(spec: str) -> None:
    codec = get_codec(spec)
    x = INPUTS["normal4097"]
    assert codec.encode(x) == codec.encode(x.clone()) == get_codec(spec).encode(x)


# ---------------------------------------------------------------- malformed payloads


def _small_payload(spec: str) -> bytes:
    return get_codec(spec).encode(torch.randn(37, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_truncated_and_extended_payloads(spec: str) -> None:
    codec = get_codec(spec)
    payload = _small_payload(spec)
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            codec.decode(payload[:cut])
        with pytest.raises(CodecError):
            decode_any(payload[:cut])
    for extended in (payload + b"\0", payload * 2):
        with pytest.raises(CodecError, match="bytes"):
            codec.decode(extended)
        with pytest.raises(CodecError):
            decode_any(extended)


def test_header_mismatches() -> None:
    x = INPUTS["normal63"]
    p = get_codec("int8").encode(x)
    with pytest.raises(CodecError, match="magic"):
        get_codec("int8").decode(b"XXXX" + p[4:])
    with pytest.raises(CodecError, match="int8"):
        get_codec("int4").decode(p)
    with pytest.raises(CodecError, match="int8:32"):
        get_codec("int8:32").decode(p)
    with pytest.raises(CodecError, match="'fp16'"):
        get_codec("fp32").decode(get_codec("fp16").encode(x))
    with pytest.raises(CodecError, match="topk"):
        get_codec("topk:0.02").decode(get_codec("topk:0.01").encode(x))
    with pytest.raises(CodecError, match="63 elements, expected 64"):
        get_codec("int8").decode(p, numel=64)
    with pytest.raises(CodecError, match="codec id 99"):
        decode_any(p[:4] + bytes([99]) + p[5:])
    with pytest.raises(CodecError, match="bytes-like"):
        get_codec("int8").decode("not bytes")  # type: ignore[arg-type]


def _patch(payload: bytes, offset: int, data: bytes) -> bytes:
    return payload[:offset] + data + payload[offset + len(data) :]


def test_bad_header_parameters() -> None:
    x = INPUTS["normal63"]
    topk = get_codec("topk:0.1").encode(x)
    dct = get_codec("dct:16:3").encode(x)
    dct2 = get_codec("dct2:4:3").encode(x)
    int8 = get_codec("int8").encode(x)
    bad = [
        _patch(topk, HEADER, struct.pack("<d", 2.0)),  # ratio > 1
        _patch(topk, HEADER, struct.pack("<d", float("nan"))),
        _patch(topk, HEADER + 8, b"\x07"),  # unknown value format
        _patch(dct, HEADER + 4, struct.pack("<I", 17)),  # k > chunk
        _patch(dct, HEADER, struct.pack("<I", 0)),  # chunk 0
        _patch(dct2, HEADER + 4, struct.pack("<I", 17)),  # k > side^2
        _patch(dct2, HEADER, struct.pack("<I", 257)),  # side > 256
        _patch(dct2, HEADER, struct.pack("<I", 0)),  # side 0
        _patch(dct2, HEADER + 8, b"\x03"),  # unknown value format
        _patch(int8, HEADER, struct.pack("<I", 0)),  # block 0
    ]
    for payload in bad:
        with pytest.raises(CodecError, match="parameters"):
            decode_any(payload)


def test_bad_sparse_indices() -> None:
    x = INPUTS["normal63"]
    codec = get_codec("topk:0.1")  # k = 7
    p = codec.encode(x)
    at = HEADER + 9  # indices follow the ratio (float64) and value format (uint8)
    first, second = struct.unpack_from("<II", p, at)
    with pytest.raises(CodecError, match="out of range"):
        codec.decode(_patch(p, at + 4 * 6, struct.pack("<I", 63)))
    with pytest.raises(CodecError, match="ascending"):
        codec.decode(_patch(p, at, struct.pack("<II", second, first)))
    with pytest.raises(CodecError, match="ascending"):  # duplicate
        codec.decode(_patch(p, at, struct.pack("<II", first, first)))

    dct = get_codec("dct:16:3")
    p = dct.encode(x)
    at = HEADER + 9  # indices follow chunk, k (uint32) and value format (uint8)
    with pytest.raises(CodecError, match="out of range"):
        dct.decode(_patch(p, at, bytes([16])))
    with pytest.raises(CodecError, match="ascending"):
        dct.decode(_patch(p, at, bytes([p[at + 1], p[at]])))

    for spec, fmt, block in (("dct2:8:5", "B", 64), ("dct2:64:32", "<H", 4096)):
        dct2 = get_codec(spec)
        p = dct2.encode(x)
        size = struct.calcsize(fmt)
        first, second = struct.unpack_from(f"<{fmt[-1]}{fmt[-1]}", p, at)
        with pytest.raises(CodecError, match="out of range"):
            dct2.decode(_patch(p, at + size, struct.pack(fmt, block)))
        with pytest.raises(CodecError, match="ascending"):
            dct2.decode(_patch(p, at, struct.pack(f"<{fmt[-1]}{fmt[-1]}", second, first)))


def test_bad_scales_and_values() -> None:
    x = INPUTS["normal63"]
    nan, inf = struct.pack("<f", float("nan")), struct.pack("<f", float("inf"))
    for spec in ("int8", "int4", "sign"):
        p = get_codec(spec).encode(x)
        at = HEADER + (0 if spec == "sign" else 4)
        for bad in (nan, inf, struct.pack("<f", -1.0)):
            with pytest.raises(CodecError, match="scale"):
                get_codec(spec).decode(_patch(p, at, bad))
    with pytest.raises(CodecError, match="NaN"):
        get_codec("fp32").decode(_patch(get_codec("fp32").encode(x), HEADER + 8, nan))
    with pytest.raises(CodecError, match="NaN"):
        get_codec("fp16").decode(_patch(get_codec("fp16").encode(x), HEADER, b"\x00\x7c"))
    with pytest.raises(CodecError, match="NaN"):
        get_codec("bf16").decode(_patch(get_codec("bf16").encode(x), HEADER, b"\x80\x7f"))
    p = get_codec("topk:0.1:fp16").encode(x)
    with pytest.raises(CodecError, match="NaN"):
        get_codec("topk:0.1:fp16").decode(_patch(p, HEADER + 9 + 4 * 7, b"\xff\x7f"))
    # Codes the encoder never emits.
    with pytest.raises(CodecError, match="-128"):
        get_codec("int8").decode(_patch(get_codec("int8").encode(x), HEADER + 8, b"\x80"))
    p = get_codec("int4").encode(x)  # 63 elements: odd, last high nibble is padding
    with pytest.raises(CodecError, match="nibble 0"):
        get_codec("int4").decode(_patch(p, HEADER + 8, b"\x00"))
    with pytest.raises(CodecError, match="padding"):
        get_codec("int4").decode(_patch(p, len(p) - 1, bytes([(p[-1] & 0x0F) | 0x90])))
    p = get_codec("sign").encode(x)
    with pytest.raises(CodecError, match="padding"):
        get_codec("sign").decode(_patch(p, len(p) - 1, bytes([p[-1] | 0x80])))


def test_random_garbage_never_escapes_codec_error() -> None:
    rng = random.Random(1234)
    codecs = [get_codec(s) for s in ALL_SPECS]
    for _ in range(300):
        junk = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 80)))
        for codec in codecs:
            with pytest.raises(CodecError):
                codec.decode(junk)
        with pytest.raises(CodecError):
            decode_any(junk)
    # Valid header, random body: decodes to the right shape or raises CodecError, nothing else.
    for codec in codecs:
        p = codec.encode(INPUTS["normal63"])
        head = len(p) - codec.nbytes(63) + codec.nbytes(0)
        for _ in range(50):
            body = bytes(rng.getrandbits(8) for _ in range(len(p) - head))
            try:
                y = codec.decode(p[:head] + body, numel=63)
            except CodecError:
                continue
            assert y.shape == (63,) and bool(torch.isfinite(y).all())


# ---------------------------------------------------------------- encode validation


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_encode_rejects_bad_input(spec: str) -> None:
    codec = get_codec(spec)
    bad = [
        torch.tensor([1.0, float("nan")]),
        torch.tensor([float("inf"), 1.0]),
        torch.tensor([-float("inf")]),
        torch.zeros(4, 4),
        torch.zeros(()),
        torch.zeros(8, dtype=torch.float64),
        torch.zeros(8, dtype=torch.float16),
        torch.zeros(8, dtype=torch.int32),
        [1.0, 2.0],
    ]
    for x in bad:
        with pytest.raises(CodecError):
            codec.encode(x)  # type: ignore[arg-type]
        with pytest.raises(CodecError):
            codec.max_abs_error(x)  # type: ignore[arg-type]


def test_encode_rejects_out_of_range_values() -> None:
    with pytest.raises(CodecError, match="65504"):
        get_codec("fp16").encode(torch.tensor([1.0, 70000.0]))
    assert get_codec("fp16").decode(get_codec("fp16").encode(torch.tensor([65504.0]))) == 65504.0
    with pytest.raises(CodecError, match="65504"):
        get_codec("topk:0.5:fp16").encode(torch.tensor([1.0, -1e5]))
    with pytest.raises(CodecError, match="bfloat16"):
        get_codec("bf16").encode(torch.tensor([3.4e38]))


# ---------------------------------------------------------------- spec parsing


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_spec_round_trip(spec: str) -> None:
    codec = get_codec(spec)
    assert isinstance(codec, Codec)
    again = get_codec(codec.name)
    assert again == codec and again.name == codec.name
    assert codec.lossless == (spec in ("fp32", "topk:1.0"))


def test_spec_canonical_names() -> None:
    assert get_codec("int8:64").name == "int8"
    assert get_codec(" INT4 ").name == "int4"
    assert get_codec("topk:0.01:fp32").name == "topk:0.01"
    assert get_codec("topk:1").name == "topk:1.0"
    assert get_codec("dct:64:8:fp32").name == "dct:64:8"
    assert get_codec("DCT2:64:32:FP32").name == "dct2:64:32"
    assert len(CODEC_SPECS) == 9
    assert {s.split(":")[0] for s in CODEC_SPECS} == {
        "fp32", "fp16", "bf16", "int8", "int4", "topk", "dct", "dct2", "sign"
    }  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "fp64",
        "fp32:1",
        "sign:2",
        "int8:0",
        "int8:abc",
        "int8:64:1",
        "int4:-3",
        "topk",
        "topk:0",
        "topk:1.5",
        "topk:nan",
        "topk:abc",
        "topk:0.1:bf16",
        "dct:64",
        "dct:64:0",
        "dct:64:65",
        "dct:0:1",
        "dct:70000:8",
        "dct:64:8:int4",
        "dct2",
        "dct2:64",
        "dct2:64:0",
        "dct2:0:1",
        "dct2:257:8",
        "dct2:8:65",
        "dct2:64:4097",
        "dct2:64:32:bf16",
        "dct2:64:32:fp16:1",
    ],
)
def test_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="Valid forms") as info:
        get_codec(spec)
    assert repr(spec) in str(info.value)


# -- decode determinism ---------------------------------------------------------------------


def _fixed_order_reference(payload: bytes, codec: Codec, numel: int) -> torch.Tensor:
    """The decode's definition in numpy float32: for each kept coefficient j in ascending
    index order, out += value_j x basis row(s), one IEEE multiply and add at a time. Any
    implementation that sums in another order (a BLAS matmul) differs in the last bits."""
    import numpy as np

    assert isinstance(codec, DctCodec)
    n_chunks = -(-numel // codec.chunk)
    body = payload[HEADER_BYTES + codec.params_struct.size :]
    raw = np.frombuffer(body, dtype=codec.index_dtype, count=n_chunks * codec.k)
    idx = raw.astype(np.int64).reshape(n_chunks, codec.k)
    vals = np.frombuffer(body, dtype="<f4", count=idx.size, offset=raw.nbytes)  # fp32 values
    vals = vals.reshape(n_chunks, codec.k).astype(np.float32)
    out = np.zeros((n_chunks, codec.chunk), dtype=np.float32)
    if codec.dims == 1:
        basis = dct_basis(codec.chunk).numpy()
        for j in range(codec.k):
            out += basis[idx[:, j]] * vals[:, j : j + 1]
    else:
        side = codec.side
        basis = dct_basis(side).numpy()
        for j in range(codec.k):
            rows, cols = basis[idx[:, j] // side], basis[idx[:, j] % side]
            term = (rows[:, :, None] * cols[:, None, :]) * vals[:, j, None, None]
            out += term.reshape(n_chunks, -1)
    return torch.from_numpy(out.reshape(-1)[:numel].copy())


@pytest.mark.parametrize("spec", ["dct:64:8", "dct:300:20", "dct2:16:32", "dct2:8:5"])
def test_dct_decode_is_bit_exact_across_threads_and_cpus(spec: str) -> None:
    """Every peer decodes every contribution, and their weights hashes must agree: decode
    gives the same bytes on 1 and 2 threads and equals the fixed-order definition bit for
    bit (a matmul inverse, as before, sums in BLAS's blocked order and does not)."""
    codec = get_codec(spec)
    numel = 200_003
    x = torch.randn(numel, generator=torch.Generator().manual_seed(8))
    payload = codec.encode(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = codec.decode(payload, numel)
        torch.set_num_threads(2)
        two = codec.decode(payload, numel)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    ref = _fixed_order_reference(payload, codec, numel)
    assert one.numpy().tobytes() == ref.numpy().tobytes()


def test_dense_and_sparse_inverses_agree_bytewise() -> None:
    g = torch.Generator().manual_seed(9)
    idx = torch.sort(torch.randperm(64, generator=g)[:8]).values.expand(50, 8).contiguous()
    vals = torch.randn(50, 8, generator=g)
    dense = torch.zeros(50, 64).scatter_(1, idx, vals)
    assert torch.equal(idct_chunks(dense, 50 * 64 - 3), idct_sparse(idx, vals, 50 * 64 - 3, 64))
    dense2 = torch.zeros(50, 64).scatter_(1, idx, vals)
    assert torch.equal(idct2_chunks(dense2, 50 * 64, 8), idct2_sparse(idx, vals, 50 * 64, 8))
    with pytest.raises(ValueError, match="out of range"):
        idct_sparse(idx + 60, vals, 50 * 64, 64)
    with pytest.raises(ValueError, match="indices and values"):
        idct_sparse(idx, vals[:, :3], 50 * 64, 64)
