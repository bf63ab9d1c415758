"""SWARM's blockwise 8-bit activations a chunk at a time: the bytes do not depend on the
chunking, and a tensor above the old 2^26-element cap crosses the wire."""

from __future__ import annotations

import pytest
import torch

from covey.swarm import codecs
from covey.swarm.wire import decode_tensor, encode_tensor


@pytest.mark.parametrize("block", codecs.BLOCKS)
def test_chunked_int8_is_the_whole_tensor_encoding(
    monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 61, generator=g) * torch.logspace(-20, 20, 61)
    x[1, 2] = 0.0
    whole = codecs.encode_int8(x, block)  # one chunk
    monkeypatch.setattr(codecs, "CHUNK", 2 * block)  # many chunks, a ragged last one
    chunked = codecs.encode_int8(x, block)
    assert chunked == whole
    monkeypatch.setattr(codecs, "CHUNK", 1 << 22)
    want = codecs.decode_int8(whole)
    monkeypatch.setattr(codecs, "CHUNK", 2 * block)
    got = codecs.decode_int8(whole)
    assert torch.equal(got, want) and got.shape == x.shape


def test_chunked_decode_still_rejects_a_bad_code_in_a_late_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(codecs, "CHUNK", 128)
    bad = bytearray(codecs.encode_int8(torch.randn(1000), 64))
    bad[-1] = 0x80  # code -128 in the last chunk
    with pytest.raises(codecs.CodecError, match="-128"):
        codecs.decode_int8(bytes(bad))


def test_an_activation_above_the_old_cap_crosses_the_wire() -> None:
    """(1, 2^26 + 5) values, more than the 2^26 the wire refused before: held as bfloat16
    (128 MiB), sent as int8 (64 MiB), decoded to float32 (256 MiB) and checked in place."""
    n = (1 << 26) + 5
    x = torch.zeros(1, n, dtype=torch.bfloat16)
    x[0, -1] = 2.0
    x[0, 0] = -1.0
    payload = encode_tensor(x, "int8")
    del x
    assert len(payload) == codecs.int8_nbytes((1, n), 64)
    out = decode_tensor(payload)
    del payload
    assert out.shape == (1, n) and out.dtype == torch.float32
    assert out[0, -1] == 2.0 and out[0, 0] == -1.0 and int(out[0, 1:-1].count_nonzero()) == 0
