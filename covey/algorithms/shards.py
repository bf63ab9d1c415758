"""Sharded aggregation: one shard of the flat parameter space at a time
(docs/sharded-aggregation.md).

Past a crossover in peers, every peer fetching every contribution costs more than the
model itself. Instead the flat parameter space (the strategy's names in order, as
`flatten` lays them out) is cut into S contiguous shards; an aggregator fetches only its
shard's slice of every accepted contribution, aggregates it with the run's robust rule,
takes the outer step on it and publishes the new shard with its hash. BTARD (Gorbunov et
al., arXiv 2106.11257) splits and checks aggregation the same way.

The contract that makes this verifiable: every function here gives, on a shard, exactly
the bits the unsharded path (`Strategy.aggregate` + `diloco.outer_step`) gives on the same
coordinates. It holds because every rule is element-wise or per coordinate once two
round-wide inputs are fixed: the weights (tokens, in the certificate) and, under NormClip,
each contribution's l2 norm over the WHOLE vector. A norm is not computable from one
shard, so it is an input: `l2_norm` sums float64 squares per `_NORM_BLOCK` block, then the
blocks in order, so the contributor's per-block sums (`block_square_sums`, committed with
its contribution) give the exact norm (`norm_from_block_sums`), and each aggregator checks
the blocks it reads (`check_block_sums`) -- a false sum is as provable as a false shard.

Pure: no network, no files. ValueError (or RoundError from the outer step) names the
value that is wrong.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from covey.algorithms import aggregation as _agg
from covey.algorithms.aggregation import Aggregator, NormClip, check_round, clip_bounds
from covey.algorithms.codec_base import _HEADER, HEADER_BYTES, MAGIC, Codec
from covey.algorithms.codecs import Bf16Codec, Fp16Codec, Fp32Codec, Int4Codec, Int8Codec
from covey.algorithms.optim import nesterov_sgd
from covey.algorithms.state import RoundError, TrainState
from covey.algorithms.tensors import flatten, unflatten


@dataclass(frozen=True)
class ShardPlan:
    """Shard i covers flat coordinates [bounds[i], bounds[i + 1])."""

    numel: int
    bounds: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def span(self, index: int) -> tuple[int, int]:
        """(start, end) of shard `index`; ValueError outside [0, count)."""
        if not 0 <= index < self.count:
            raise ValueError(f"shard {index} does not exist; the plan has {self.count}")
        return self.bounds[index], self.bounds[index + 1]


def plan_shards(numel: int, shards: int, align: int = 1) -> ShardPlan:
    """Cut `numel` coordinates into at most `shards` contiguous shards of near-equal size
    whose inner boundaries are multiples of `align` (a codec's block, so a shard is a byte
    range of every payload). Fewer shards when there are fewer aligned units than shards;
    never an empty shard. Deterministic: a pure function of its arguments."""
    if numel < 1 or shards < 1 or align < 1:
        raise ValueError(f"need numel, shards, align >= 1; got {numel}, {shards}, {align}")
    units = -(-numel // align)
    count = min(shards, units)
    bounds = [min(numel, (units * i // count) * align) for i in range(count)] + [numel]
    return ShardPlan(numel, tuple(bounds))


# -- norms from committed per-block sums ---------------------------------------------------


def norm_block() -> int:
    """Elements per block of `aggregation.l2_norm` (read at call time: tests shrink it)."""
    return _agg._NORM_BLOCK


def block_square_sums(vector: torch.Tensor) -> list[float]:
    """Per `norm_block()` block of the flat float32 `vector`, its sum of squares exactly as
    `aggregation.l2_norm` computes it (float64 squares, pairwise tree inside the block)."""
    flat = vector.detach().reshape(-1)
    block = norm_block()
    out = []
    for start in range(0, flat.numel(), block):
        out.append(_tree(flat, start))
    return out


def _tree(flat: torch.Tensor, start: int) -> float:
    """l2_norm's inner loop for the one block starting at `start`."""
    part = flat[start : start + norm_block()]
    width = 1 << max(part.numel() - 1, 0).bit_length()
    sq = torch.zeros(width, dtype=torch.float64, device=part.device)
    sq[: part.numel()] = part
    sq.mul_(sq)
    while width > 1:
        width //= 2
        sq[:width].add_(sq[width : 2 * width])
    return float(sq[0])


def norm_from_block_sums(sums: Sequence[float]) -> float:
    """sqrt of the block sums added in order from 0.0: `l2_norm`'s exact bits."""
    total = 0.0
    for s in sums:
        total += s
    return math.sqrt(total)


def blocks_touching(start: int, end: int, numel: int) -> tuple[int, int]:
    """(first, last + 1) norm blocks that coordinates [start, end) touch, and so the element
    range [first * block, min(numel, (last + 1) * block)) an aggregator reads to check them."""
    if not 0 <= start < end <= numel:
        raise ValueError(f"span [{start}, {end}) is not inside [0, {numel})")
    block = norm_block()
    return start // block, -(-end // block)


def check_block_sums(
    piece: torch.Tensor, first_block: int, sums: Sequence[float], who: str = "contribution"
) -> None:
    """ValueError unless the blocks of `piece` (which starts at block `first_block` and
    covers whole blocks, the last possibly ragged at the vector's end) have the sums the
    contributor declared in `sums` (all blocks of the vector)."""
    got = block_square_sums(piece)
    for k, value in enumerate(got):
        i = first_block + k
        if i >= len(sums) or sums[i] != value:
            have = sums[i] if i < len(sums) else None
            raise ValueError(f"{who}: block {i} sums to {value!r} squared, declared {have!r}")


# -- one shard of the round -----------------------------------------------------------------


def aggregate_shard(
    rule: Aggregator,
    slices: Sequence[torch.Tensor],
    weights: Sequence[float],
    norms: Sequence[float] | None = None,
) -> torch.Tensor:
    """`rule(full vectors, weights)[start:end]`, bit for bit, from the contributions'
    [start:end] slices. NormClip (factor > 0) needs `norms`, each contribution's l2 norm
    over its whole vector (`norm_from_block_sums`); other rules ignore them. ValueError
    as the rule raises it, or for missing or non-finite norms."""
    check_round(slices, weights)
    if isinstance(rule, NormClip) and rule.factor > 0:
        if norms is None or len(norms) != len(slices):
            raise ValueError(f"NormClip needs one norm per contribution; got {norms!r}")
        for i, n in enumerate(norms):
            if not math.isfinite(n):
                raise ValueError(f"vector {i} has norm {n}; values must be finite")
        bounds = clip_bounds(norms, weights, rule.factor)
        clipped = []
        for v, n, bound in zip(slices, norms, bounds, strict=True):
            if n <= bound:
                clipped.append(v)
            elif bound == 0:
                clipped.append(torch.zeros_like(v, dtype=torch.float32))
            else:
                clipped.append(v.float() * (bound / n))
        return rule.inner(clipped, weights)
    if isinstance(rule, NormClip):
        rule = rule.inner
    return rule(slices, weights)


def outer_step_shard(
    params: torch.Tensor,
    momentum: torch.Tensor | None,
    grad: torch.Tensor,
    *,
    lr: float,
    momentum_coef: float,
    nesterov: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DiLoCo's outer Nesterov SGD (`diloco.outer_step`) on one shard of the flat float32
    params and momentum (None before the first round) -> (new params, new momentum).
    Element-wise, so the same bits as the unsharded step. RoundError for a non-finite grad."""
    if not torch.isfinite(grad).all():
        raise RoundError("aggregated outer gradient of the shard is not finite")
    return nesterov_sgd(params, grad, momentum, lr=lr, momentum=momentum_coef, nesterov=nesterov)


def shard_hash(
    round: int, index: int, start: int, params: torch.Tensor, momentum: torch.Tensor | None
) -> str:
    """sha256 of a new state shard: what the aggregator signs and the coordinator
    certifies. Names its round, index and span, so a shard is valid in one place only."""
    h = hashlib.sha256(f"covey-shard/v1\n{round}\n{index}\n{start}\n{params.numel()}\n".encode())
    h.update(params.detach().contiguous().cpu().float().numpy().tobytes())
    if momentum is not None:
        h.update(b"|momentum|")
        h.update(momentum.detach().contiguous().cpu().float().numpy().tobytes())
    return h.hexdigest()


# -- shards of a codec's payload as byte ranges ---------------------------------------------


def codec_align(codec: Codec) -> int | None:
    """The shard alignment under which a shard of `codec`'s payload is a few byte ranges:
    1 for dense floats, the block for int8, an even multiple of it for int4; None for the
    sparse codecs (top-k, DCT, sign), whose slices an aggregator cannot range-read."""
    if isinstance(codec, (Fp32Codec, Fp16Codec, Bf16Codec)):
        return 1
    if isinstance(codec, Int8Codec):
        return codec.block
    if isinstance(codec, Int4Codec):
        return math.lcm(codec.block, 2)
    return None


def _item_bytes(codec: Codec) -> int:
    return 4 if isinstance(codec, Fp32Codec) else 2


def payload_ranges(codec: Codec, numel: int, start: int, end: int) -> list[tuple[int, int]]:
    """Half-open byte ranges of a `numel`-element payload that hold coordinates
    [start, end): the header and parameters, then the body's pieces. ValueError for a
    codec without ranges or a span off its alignment."""
    align = codec_align(codec)
    if align is None:
        raise ValueError(f"codec {codec.name!r} cannot be read by shard; fetch whole payloads")
    if not (0 <= start < end <= numel) or start % align or (end % align and end != numel):
        raise ValueError(f"span [{start}, {end}) of {numel} is not aligned to {align}")
    head = HEADER_BYTES + codec.params_struct.size
    ranges = [(0, head)]
    if isinstance(codec, (Fp32Codec, Fp16Codec, Bf16Codec)):
        size = _item_bytes(codec)
        ranges.append((head + start * size, head + end * size))
        return ranges
    assert isinstance(codec, (Int8Codec, Int4Codec))
    b = codec.block
    n_blocks = -(-numel // b)
    ranges.append((head + 4 * (start // b), head + 4 * -(-end // b)))
    body = head + 4 * n_blocks
    if isinstance(codec, Int8Codec):
        ranges.append((body + start, body + end))
    else:
        ranges.append((body + start // 2, body + -(-end // 2)))
    return ranges


def decode_slice(
    codec: Codec, numel: int, start: int, end: int, parts: Sequence[bytes]
) -> torch.Tensor:
    """Coordinates [start, end) of the payload whose `payload_ranges` are `parts`:
    bit-identical to `codec.decode(payload)[start:end]`. The pieces are checked as a
    payload of their own (codec, parameters, lengths, scales, value ranges): CodecError
    on anything malformed."""
    ranges = payload_ranges(codec, numel, start, end)
    if len(parts) != len(ranges) or any(
        len(p) != b - a for p, (a, b) in zip(parts, ranges, strict=False)
    ):
        raise ValueError(f"need {len(ranges)} pieces of {[b - a for a, b in ranges]} bytes")
    magic, cid, n = _HEADER.unpack_from(parts[0])
    if magic != MAGIC or n != numel or cid != codec.codec_id:
        raise ValueError(f"payload header names codec {cid}, {n} elements; want {codec.name}")
    # the slice as a payload of its own: the codec's own decoder checks every byte
    mini = _HEADER.pack(MAGIC, codec.codec_id, end - start) + parts[0][HEADER_BYTES:]
    return codec.decode(mini + b"".join(parts[1:]), end - start)


# -- the flat state, and back ----------------------------------------------------------------


def flat_state(state: TrainState, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(params, outer momentum) of `state` flattened in `names` order, float32; momentum
    None before the outer step has run. ValueError when only some names have momentum."""
    params = flatten([state.params[n] for n in names])
    keys = [f"momentum/{n}" for n in names]
    have = [k in state.outer for k in keys]
    if not any(have):
        return params, None
    if not all(have):
        missing = [k for k, h in zip(keys, have, strict=True) if not h]
        raise ValueError(f"outer momentum is missing for {missing[:3]} (of {len(missing)})")
    return params, flatten([state.outer[k] for k in keys])


def state_from_flat(
    start: TrainState, names: Sequence[str], params: torch.Tensor, momentum: torch.Tensor | None
) -> TrainState:
    """The round's new state from its assembled flat params and momentum: what
    `diloco.outer_step` returns on the same numbers (round + 1, other outer state carried).
    RoundError when a vector's length does not match the parameters."""
    like = [start.params[n] for n in names]
    new_params = dict(start.params)
    new_params.update(zip(names, unflatten(params, like), strict=True))
    outer = dict(start.outer)
    if momentum is not None:
        outer.update(
            (f"momentum/{n}", t) for n, t in zip(names, unflatten(momentum, like), strict=True)
        )
    return TrainState(new_params, outer, start.round + 1)


# -- one aggregator's work on one shard ------------------------------------------------------


def read_slice(
    codec: Codec, numel: int, start: int, end: int, read: Callable[[int, int], bytes]
) -> torch.Tensor:
    """Coordinates [start, end) of one contribution whose payload bytes [a, b) are
    `read(a, b)`: only the shard's byte ranges for dense and block codecs, the whole
    payload (decoded, then sliced) for sparse ones. CodecError / ValueError on bad bytes."""
    if codec_align(codec) is None or start % (codec_align(codec) or 1):
        return codec.decode(read(0, codec.nbytes(numel)), numel)[start:end].clone()
    ranges = payload_ranges(codec, numel, start, end)
    return decode_slice(codec, numel, start, end, [read(a, b) for a, b in ranges])


def new_shard(
    rule: Aggregator,
    slices: Sequence[torch.Tensor],
    weights: Sequence[float],
    norms: Sequence[float] | None,
    params: torch.Tensor,
    momentum: torch.Tensor | None,
    *,
    lr: float,
    momentum_coef: float,
    nesterov: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The round's new (params, momentum) on one shard: `aggregate_shard`, then
    `outer_step_shard`. Errors as theirs."""
    grad = aggregate_shard(rule, slices, weights, norms)
    return outer_step_shard(
        params, momentum, grad, lr=lr, momentum_coef=momentum_coef, nesterov=nesterov
    )


def shard_to_bytes(params: torch.Tensor, momentum: torch.Tensor | None) -> bytes:
    """A published shard's blob: its float32 params, then its momentum (if any)."""
    parts = [params.detach().contiguous().cpu().float().numpy().tobytes()]
    if momentum is not None:
        parts.append(momentum.detach().contiguous().cpu().float().numpy().tobytes())
    return b"".join(parts)


def shard_from_bytes(
    data: bytes, length: int, with_momentum: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of `shard_to_bytes` for a shard of `length` coordinates. ValueError for a
    blob of another size or with non-finite values."""
    want = 4 * length * (2 if with_momentum else 1)
    if len(data) != want:
        raise ValueError(f"shard blob is {len(data)} bytes; a shard of {length} needs {want}")
    flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
    if not torch.isfinite(flat).all():
        raise ValueError("shard blob holds non-finite values")
    return flat[:length].clone(), flat[length:].clone() if with_momentum else None


# -- what each path costs ----------------------------------------------------------------------


def bytes_per_peer(
    peers: int, numel: int, contribution_bytes: int, aggregators: int
) -> dict[str, float]:
    """Bytes one peer moves per round on each path, from the formulas (the coordinator's
    relay and HTTP overhead left out):

    - gather (today): upload its contribution, download the other N - 1:
      N x C in all;
    - sharded, a worker: upload its contribution, download the new parameters,
      C + 4 x numel (float32; the outer momentum stays with the aggregators);
    - sharded, one of A aggregators on top: its 1/A of every contribution (N x C / A),
      the momentum of its shards from their previous holders (4 x numel / A) and the
      new shards it serves to the N peers (N x 4 x numel / A, spread over the shard's
      sources in practice).
    """
    if min(peers, numel, contribution_bytes, aggregators) < 1:
        raise ValueError(f"need positive sizes, got {peers}, {numel}, {contribution_bytes}, "
                         f"{aggregators}")  # fmt: skip
    state = 4.0 * numel
    return {
        "gather": float(peers * contribution_bytes),
        "sharded_worker": contribution_bytes + state,
        "sharded_aggregator": contribution_bytes
        + state
        + (peers * contribution_bytes + state + peers * state) / aggregators,
    }


def crossover_peers(numel: int, contribution_bytes: int) -> int:
    """The fewest peers for which a worker moves fewer bytes on the sharded path than on
    the gather path: the smallest N with N x C > C + 4 x numel (about the codec's
    compression ratio against float32, plus one)."""
    if numel < 1 or contribution_bytes < 1:
        raise ValueError(f"need positive sizes, got {numel}, {contribution_bytes}")
    return (contribution_bytes + 4 * numel) // contribution_bytes + 1
