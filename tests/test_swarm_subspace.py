"""Subspace activations on the wire (codec "subspace", arXiv 2506.01260): the payload
round-trips and refuses malformed bytes; the coefficient backward equals autograd through
the projection; a microbatch through two stage servers over HTTP in subspace mode equals
the projected model in one process and sends r instead of C values a token."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from covey.swarm.codecs import CodecError
from covey.swarm.config import SwarmConfig
from covey.swarm.subspace import SubspaceWire, decode_payload, encode_payload, for_run

CFG = SwarmConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16, stages=2, microbatch=2,
                  codec="subspace", subspace_rank=4, verify_rate=0.0, rebalance_s=3600,
                  target_samples=1000)  # fmt: skip


def test_payload_round_trips_exactly_and_has_the_stated_size() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 5), generator=g)
    c = torch.randn(3, 5, 4, generator=g)
    data = encode_payload(ids, c)
    assert len(data) == 16 + 4 * 15 + 4 * 60
    ids2, c2 = decode_payload(data)
    assert torch.equal(ids2, ids) and torch.equal(c2, c)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d[:10], "shorter"),
        (lambda d: b"XXXX" + d[4:], "magic"),
        (lambda d: d + b"\0", "needs"),
        (lambda d: d[:4] + struct.pack("<III", 1 << 20, 1 << 20, 1) + d[16:], "out of bounds"),
        (lambda d: d[:-4] + struct.pack("<f", float("nan")), "inf or nan"),
    ],
)
def test_malformed_payloads_are_refused(mutate, match) -> None:  # type: ignore[no-untyped-def]
    data = encode_payload(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, 4))
    with pytest.raises(CodecError, match=match):
        decode_payload(mutate(data))


def test_coefficients_rebuild_the_projection_and_the_backward_is_its_chain_rule() -> None:
    """h' = U c + e_tok is exactly e_tok + U U^T (h - e_tok); dL/dh = U (U^T dL/dh')
    equals autograd through that projection."""
    g = torch.Generator().manual_seed(1)
    sw = SubspaceWire(torch.randn(256, 32, generator=g), rank=4, seed=0)
    ids = torch.randint(0, 256, (2, 6), generator=g)
    h = torch.randn(2, 6, 32, generator=g, requires_grad=True)
    proj = sw.codec.project(h, sw.e_tok(ids))
    rebuilt = sw.from_coeffs(sw.to_coeffs(h, ids), ids)
    torch.testing.assert_close(rebuilt, proj.detach(), atol=1e-5, rtol=0)
    w = torch.randn(2, 6, 32, generator=g)
    (proj * w).sum().backward()
    via_wire = sw.grad_from_coeffs(sw.grad_to_coeffs(w))
    torch.testing.assert_close(via_wire, h.grad, atol=1e-5, rtol=0)


def projected_reference(batch: torch.Tensor) -> tuple[float, list[float], list[float]]:
    """One process, one autograd graph: stage 0, the subspace projection, stage 1, loss.
    (loss, stage-0 grad norms, stage-1 grad norms) in each stage's parameter order."""
    from covey.swarm.wire import build_stage

    s0, s1 = build_stage(CFG, 0), build_stage(CFG, 1)
    sw = for_run(CFG)
    ids = batch[:, :-1]
    h = s0.module(ids)
    logits = s1.module(sw.codec.project(h, sw.e_tok(ids)))
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    loss.backward()
    norms = [[float(p.grad.norm()) for p in s.params] for s in (s0, s1)]  # type: ignore[union-attr]
    return float(loss.detach()), norms[0], norms[1]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from covey.swarm.local import LocalSwarm

    s = LocalSwarm(CFG, tmp_path_factory.mktemp("subspace"))
    try:
        s.add_server("p0", 0)
        s.add_server("p1", 1)
        s.ready(["p0", "p1"])
        yield s
    finally:
        s.close()


@pytest.mark.network
def test_a_two_stage_hop_over_http_in_subspace_mode(swarm: object, tmp_path: Path) -> None:
    from covey.swarm import compute
    from covey.swarm.trainer import SwarmTrainer
    from covey.swarm.wire import encode_tensor, pack, unpack

    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(4))
    t = SwarmTrainer(swarm.url, name="sub", inflight=1, progress=lambda _: None,  # type: ignore[attr-defined]
                     tokens=torch.arange(256))  # fmt: skip
    try:
        t.refresh()
        h0 = t.hop(0, "forward", pack(encode_tensor(batch[:, :-1], "plain")), 2)
        out0, _ = unpack(h0.reply, 2)
        h1 = t.hop(1, "backward", pack(out0, encode_tensor(batch[:, 1:], "")), 2)
        grad1, _ = unpack(h1.reply, 2)
        h2 = t.hop(0, "backward", pack(encode_tensor(batch[:, :-1], ""), grad1), 2)
        (_, meta1), (_, meta0) = compute.parse_reply(h1.reply), compute.parse_reply(h2.reply)
    finally:
        t.close()
    tokens, r, c = 2 * 16, CFG.subspace_rank, CFG.n_embd
    assert len(out0) == 16 + 4 * tokens + 4 * tokens * r  # ids + r coefficients a token
    assert tuple(compute.decode_any(grad1).shape) == (2, 16, r)  # r values a token back
    assert len(grad1) < 4 * tokens * c / 4
    loss, want0, want1 = projected_reference(batch)
    assert meta1["loss"] == pytest.approx(loss, rel=1e-5)
    assert meta1["sketch"] == pytest.approx(want1, rel=1e-4, abs=1e-7)
    assert meta0["sketch"] == pytest.approx(want0, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("behavior", ["wrong", "noise"])
def test_an_adversary_in_subspace_mode_sends_a_valid_payload_that_is_caught(behavior: str) -> None:
    """A lying server's forward reply still decodes (ids kept, coefficients changed), and
    the duplicate check's distance puts it beyond tolerance."""
    from covey.swarm import compute
    from covey.swarm.server import misbehave
    from covey.swarm.wire import build_stage, encode_tensor, pack, unpack

    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    honest = compute.forward(CFG, 0, build_stage(CFG, 0), pack(encode_tensor(batch, "plain")))
    bad = misbehave(behavior, "forward", honest, CFG.codec)
    ids, c = decode_payload(unpack(bad, 2)[0])
    assert torch.equal(ids, batch) and c.shape == (2, 16, CFG.subspace_rank)
    assert compute.reply_distance(bad, honest) > CFG.tolerance
    assert compute.reply_distance(honest, honest) == 0.0
