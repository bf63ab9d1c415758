"""Sharded aggregation gives the unsharded path's bits on every shard."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from covey.algorithms import Contribution, aggregation
from covey.algorithms.aggregation import AGGREGATIONS, build_aggregator, l2_norm
from covey.algorithms.codec_base import CodecError
from covey.algorithms.codecs import get_codec
from covey.algorithms.diloco import DiLoCo
from covey.algorithms.shards import (
    aggregate_shard,
    block_square_sums,
    blocks_touching,
    bytes_per_peer,
    check_block_sums,
    codec_align,
    crossover_peers,
    decode_slice,
    flat_state,
    norm_from_block_sums,
    outer_step_shard,
    payload_ranges,
    plan_shards,
    shard_hash,
    state_from_flat,
)
from covey.config import DiLoCoConfig


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def vectors(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(numel, generator=g) * (1 + i) for i in range(n)]
    out[0][:7] = 0.0  # ties of zeros: the per-coordinate rules' +0.0 rule
    if n > 2:
        out[-1] = out[-1] * 50  # an outlier the clip must cut
    return out


@pytest.fixture
def small_norm_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Many norm blocks in a small vector, the last one ragged."""
    monkeypatch.setattr(aggregation, "_NORM_BLOCK", 256)
    return 256


def test_plan_covers_everything_aligned() -> None:
    rng = random.Random(0)
    for _ in range(300):
        numel, shards, align = rng.randint(1, 5000), rng.randint(1, 40), rng.choice([1, 2, 64])
        plan = plan_shards(numel, shards, align)
        assert plan.bounds[0] == 0 and plan.bounds[-1] == numel
        assert 1 <= plan.count <= shards
        for i in range(plan.count):
            start, end = plan.span(i)
            assert start < end and start % align == 0
        assert plan == plan_shards(numel, shards, align)  # deterministic
    with pytest.raises(ValueError, match="shard 3 does not exist"):
        plan_shards(10, 3).span(3)


def test_block_sums_give_l2_norm_bits(small_norm_blocks: int) -> None:
    for numel in (1, 255, 256, 257, 1000, 2049):
        v = vectors(1, numel, numel)[0]
        sums = block_square_sums(v)
        assert len(sums) == -(-numel // small_norm_blocks)
        assert norm_from_block_sums(sums) == l2_norm(v)  # exact, not approximate
        first, last = blocks_touching(300, 700, numel) if numel > 700 else (0, len(sums))
        piece = v[first * small_norm_blocks : last * small_norm_blocks]
        check_block_sums(piece, first, sums)
        lie = list(sums)
        lie[first] += 1.0
        with pytest.raises(ValueError, match=f"block {first} sums"):
            check_block_sums(piece, first, lie)


@pytest.mark.parametrize("aggregation_name", AGGREGATIONS)
@pytest.mark.parametrize("clip", [0.0, 2.0])
@pytest.mark.parametrize("uniform", [True, False])
def test_every_shard_equals_the_unsharded_rule(
    aggregation_name: str, clip: float, uniform: bool, small_norm_blocks: int
) -> None:
    """Property: random sizes, counts and shard plans; every shard bit-identical."""
    rng = random.Random(f"{aggregation_name}/{clip}/{uniform}")  # str seeds are stable
    for trial in range(4):
        n, numel = rng.randint(1, 7), rng.randint(1, 3000)
        vs = vectors(n, numel, seed=trial)
        weights = [1.0] * n if uniform else [float(rng.randint(1, 9)) for _ in range(n)]
        rule = build_aggregator(aggregation_name, 0.25, clip)
        want = rule(vs, weights)
        norms = [norm_from_block_sums(block_square_sums(v)) for v in vs]
        plan = plan_shards(numel, rng.randint(1, 9), rng.choice([1, 2, 64]))
        for i in range(plan.count):
            start, end = plan.span(i)
            got = aggregate_shard(rule, [v[start:end] for v in vs], weights, norms)
            assert torch.equal(bits(got), bits(want[start:end])), (trial, i)


def test_normclip_refuses_missing_norms() -> None:
    with pytest.raises(ValueError, match="one norm per contribution"):
        aggregate_shard(build_aggregator("mean", 0, 2.0), vectors(2, 5, 0), [1.0, 1.0])


def diloco(codec: str, aggregation_name: str, clip: float) -> DiLoCo:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 17))
    cfg = DiLoCoConfig(outer_lr=0.7, outer_momentum=0.9, nesterov=True, codec=codec)
    rule = build_aggregator(aggregation_name, 0.2, clip)
    return DiLoCo(model, lambda m, b: torch.zeros(()), cfg, get_codec(codec), rule)


@pytest.mark.parametrize(
    ("codec", "aggregation_name", "clip"),
    [("fp32", "mean", 0.0), ("int4", "trimmed_mean", 2.0), ("int8:32", "median", 1.5),
     ("fp16", "mean", 2.0), ("bf16", "trimmed_mean", 0.0)],
)  # fmt: skip
def test_sharded_rounds_give_the_certified_weights_hash(
    codec: str, aggregation_name: str, clip: float, small_norm_blocks: int
) -> None:
    """Three DiLoCo rounds (Nesterov momentum from round 1 on): contributions read by
    byte ranges, aggregated and stepped shard by shard, reassembled: the same digest as
    `apply_round` every round, so the momentum shards are right too."""
    strategy = diloco(codec, aggregation_name, 0.0 if clip == 0 else clip)
    names, state = strategy.names, strategy.init_state()
    cfg, codec_ = strategy.cfg, strategy.codec
    numel = sum(state.params[n].numel() for n in names)
    plan = plan_shards(numel, 5, codec_align(codec_) or 1)
    assert plan.count == 5
    for r in range(3):
        g = torch.Generator().manual_seed(r)
        payloads = [codec_.encode(torch.randn(numel, generator=g) * (i + 1)) for i in range(4)]
        tokens = [100, 300, 200, 100]
        contribs = [Contribution(p, t, 5) for p, t in zip(payloads, tokens, strict=True)]
        want = strategy.apply_round(state, contribs)

        norms = [norm_from_block_sums(block_square_sums(codec_.decode(p))) for p in payloads]
        params, momentum = flat_state(state, names)
        assert (momentum is None) == (r == 0)
        new_p, new_m, hashes = [], [], []
        for i in range(plan.count):
            start, end = plan.span(i)
            ranges = payload_ranges(codec_, numel, start, end)
            slices = [
                decode_slice(codec_, numel, start, end, [p[a:b] for a, b in ranges])
                for p in payloads
            ]
            grad = aggregate_shard(strategy.aggregator, slices, [float(t) for t in tokens], norms)
            p_new, m_new = outer_step_shard(
                params[start:end],
                None if momentum is None else momentum[start:end],
                grad,
                lr=cfg.outer_lr,
                momentum_coef=cfg.outer_momentum,
                nesterov=cfg.nesterov,
            )
            assert m_new is not None
            new_p.append(p_new)
            new_m.append(m_new)
            hashes.append(shard_hash(r, i, start, p_new, m_new))
        got = state_from_flat(state, names, torch.cat(new_p), torch.cat(new_m))
        assert got.digest() == want.digest(), f"round {r}"
        assert len(set(hashes)) == plan.count
        state = want


def test_decode_slice_is_a_slice_of_decode_and_checks_bytes() -> None:
    rng = random.Random(3)
    for name in ("fp32", "fp16", "bf16", "int8", "int8:5", "int4", "int4:7"):
        codec = get_codec(name)
        for numel in (1, 63, 64, 65, 1001):
            x = torch.randn(numel)
            payload = codec.encode(x)
            full = codec.decode(payload)
            plan = plan_shards(numel, rng.randint(1, 6), codec_align(codec) or 1)
            for i in range(plan.count):
                start, end = plan.span(i)
                parts = [payload[a:b] for a, b in payload_ranges(codec, numel, start, end)]
                assert torch.equal(bits(decode_slice(codec, numel, start, end, parts)),
                                   bits(full[start:end]))  # fmt: skip
    codec = get_codec("int4")
    payload = bytearray(codec.encode(torch.randn(128)))
    ranges = payload_ranges(codec, 128, 64, 128)
    payload[ranges[-1][0]] = 0  # nibble 0: outside the symmetric range
    with pytest.raises(CodecError, match="nibble 0"):
        decode_slice(codec, 128, 64, 128, [bytes(payload[a:b]) for a, b in ranges])
    assert codec_align(get_codec("topk:0.1")) is None
    with pytest.raises(ValueError, match="not aligned"):
        payload_ranges(codec, 128, 3, 64)


def test_crossover_is_where_a_worker_moves_fewer_bytes_sharded() -> None:
    numel = 120_576
    for name in ("fp32", "int8", "int4", "topk:0.01:fp16"):
        c = get_codec(name).nbytes(numel)
        n = crossover_peers(numel, c)
        below, at = bytes_per_peer(n - 1, numel, c, 4), bytes_per_peer(n, numel, c, 4)
        assert below["gather"] <= below["sharded_worker"] and at["gather"] > at["sharded_worker"]
    assert crossover_peers(numel, get_codec("int4").nbytes(numel)) == 9
    with pytest.raises(ValueError, match="positive"):
        bytes_per_peer(0, numel, 10, 1)
