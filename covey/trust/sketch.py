"""Commitments to training states: count sketches, relative distances, hashes.

A validator re-executing a worker's round on another machine does not get bit-identical
tensors (thread counts change summation orders), so states are compared with a tolerance.
Shipping whole states for that would cost as much as the training; a count sketch
(Charikar, Chen & Farach-Colton, 2002) carries the comparison in 64 numbers per group:
coordinate i goes to bucket h(i) with sign s(i), S(x)[b] = sum_{h(i)=b} s(i) x_i. S is
linear, so S(a) - S(b) = S(a - b), and E ||S(x)||^2 = ||x||^2: the relative distance of two
sketches estimates the relative distance of the vectors (to about sqrt(2 / buckets), ~18%
of its value with 64 buckets, for vectors whose mass is spread over many coordinates).

h and s come from splitmix64 of the coordinate index, not from torch's RNG: every machine
and every torch version computes the same sketch (covey/data/batches.py avoids RNG
libraries for batches for the same reason).

A sketch is not a commitment an adversary cannot game: the hashing is public, so a vector
can be crafted in the sketch's null space. Sketches tell honest numerical noise from real
divergence; exact hashes (`state_hash`) are what binds a party to its bytes. A
`Commitment` carries sketches of a worker's local state, and its hash only where a
commitment must be one: at step 0, the round's start state, and at a round's end (the end
state's content id, `covey.trust.evidence.evidence_commitment`). An intermediate commitment
(0 < step < the round's steps) carries none (`NO_HASH`): a hash is SHA-256 on the host over
the whole state, weights and moments, while its sketches are computed on the training device
and only their `buckets` sums cross.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from covey.memory import all_finite
from covey.trust import sketch_hashing

BUCKETS = 64
SEED = 0x636F766579  # "covey": offsets the coordinate index before mixing
TINY = 1e-30  # below any float32 norm that matters; keeps 0 / 0 at 0
HEX64 = re.compile(r"[0-9a-f]{64}")
#: the hash of an intermediate commitment on the wire: none
NO_HASH = ""


#: vectors longer than this are sketched a block of coordinates at a time (a
#: 124M model's index and sign tables alone would be 2 GB, cached, plus 5 GB to build)
_BLOCK = 1 << 20


@functools.lru_cache(maxsize=8)
def _hashing(length: int, buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket index int64, sign float64) for coordinates 0..length-1 (numpy; the
    definition `sketch_hashing` computes in torch, kept as the tests' reference)."""
    return _hashing_at(0, length, buckets)


def _hashing_at(start: int, length: int, buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket index int64, sign float64) for coordinates start..start+length-1."""
    with np.errstate(over="ignore"):
        coordinates = np.arange(start, start + length, dtype=np.uint64)
        h = sketch_hashing.splitmix64_np(coordinates + np.uint64(SEED))
    index = torch.from_numpy(((h >> np.uint64(1)) % np.uint64(buckets)).astype(np.int64))
    sign = torch.from_numpy(1.0 - 2.0 * (h & np.uint64(1)).astype(np.float64))
    return index, sign


def sketch_parts(parts: Iterable[torch.Tensor], buckets: int = BUCKETS) -> torch.Tensor:
    """`sketch(torch.cat(parts))`, the same bits, without concatenating: each flat part is
    added at its offset a block of coordinates at a time, in coordinate order (the order in
    which `index_add_` adds), so memory stays at one block beyond the part in hand. `parts`
    may be a generator: each part can be dropped once added.

    The sums are made on the parts' device (the first part's; the others are moved there)
    with the hash tables cached on it (covey/trust/sketch_hashing.py); only the `buckets`
    sums cross to the host. On the CPU the bits are those of `_hashing_at`'s numpy tables
    added in coordinate order. A CUDA device adds a bucket's terms with atomics, in an order
    of its own: the sums there agree with the host's to float64 rounding (about 1e-16
    relative), which the tolerance sketches are compared with (`distance`) does not see."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    out: torch.Tensor | None = None
    offset = 0
    for part in parts:
        if part.dim() != 1:
            raise ValueError(f"sketch takes flat vectors, got shape {tuple(part.shape)}")
        if out is None:
            out = torch.zeros(buckets, dtype=torch.float64, device=part.device)
        add_piece(out, offset, part)
        offset += part.numel()
    return torch.zeros(buckets, dtype=torch.float64) if out is None else out.cpu()


def add_piece(out: torch.Tensor, offset: int, piece: torch.Tensor) -> None:
    """Add the flat `piece`, coordinates offset..offset+len-1 of a longer vector, into the
    partial sketch `out` (float64, shape (buckets,), on the device it is summed on), a
    block at a time in coordinate order. The count sketch is linear: partial sketches of
    disjoint pieces sum to the sketch of the whole (`sketch_parts` adds every piece into one
    `out`; a sharded state's ranks each sketch their own pieces, covey/peer/fsdp.py)."""
    if piece.dim() != 1:
        raise ValueError(f"sketch takes flat vectors, got shape {tuple(piece.shape)}")
    flat = piece.detach().to(out.device)
    for start in range(0, flat.numel(), _BLOCK):
        block = flat[start : start + _BLOCK]
        index, sign = sketch_hashing.table(
            offset + start, block.numel(), out.numel(), SEED, out.device
        )
        out.index_add_(0, index, (block * sign).to(torch.float64))  # x * (+-1): exact


def sketch_groups(local: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The names of a local state (or its layout: shapes are all that is read) that a
    commitment sketches, group by group, in the order each group's vector concatenates
    them: first the parameters ("param/<name>", sorted), then one group per kind of
    optimizer tensor (kinds sorted; each the kind's names sorted; 0-dim entries left out).
    `commitment_of` sketches these groups; a sharded state sketches the same coordinates
    piece by piece (covey/peer/fsdp.py)."""
    kinds: dict[str, list[str]] = {}
    for name in sorted(local):
        if name.startswith("optim/") and local[name].dim() > 0:
            kinds.setdefault(name.rsplit("/", 1)[-1], []).append(name)
    params = sorted(k for k in local if k.startswith("param/"))
    return [params] + [kinds[kind] for kind in sorted(kinds)]


def commitment_from_sketches(step: int, digest: str, groups: Sequence[torch.Tensor]) -> Commitment:
    """A commitment from its groups' sketches (`sketch_groups`' order: parameters' deltas
    first, then the optimizer kinds')."""
    optim = [g.cpu().to(torch.float64) for g in groups[1:]]
    optim_sketch = torch.cat(optim) if optim else torch.zeros(0, dtype=torch.float64)
    return Commitment(
        step,
        digest,
        {
            "params": tuple(groups[0].cpu().to(torch.float64).tolist()),
            "optim": tuple(optim_sketch.tolist()),
        },
    )


def sketch(vec: torch.Tensor, buckets: int = BUCKETS) -> torch.Tensor:
    """The count sketch of a flat vector: float64, shape (buckets,), accumulated in float64.

    Deterministic for a given input; linear in it. NaN/Inf in `vec` propagate into the
    sketch (a comparison then fails, see `distance`). ValueError for a non-1-D input or
    buckets < 1."""
    if vec.dim() != 1:
        raise ValueError(f"sketch takes a flat vector, got shape {tuple(vec.shape)}")
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    return sketch_parts([vec], buckets)


def distance(a: torch.Tensor | Sequence[float], b: torch.Tensor | Sequence[float]) -> float:
    """||a - b|| / max(||a||, ||b||, TINY): 0 for identical vectors, 1 for zero against
    anything else, 2 for a sign flip, |s - 1| / max(|s|, 1) for a scaling by s.

    inf when either side has NaN or Inf (a non-finite vector never agrees with anything).
    ValueError when the lengths differ."""
    x = torch.as_tensor(a, dtype=torch.float64).reshape(-1)
    y = torch.as_tensor(b, dtype=torch.float64).reshape(-1)
    if x.numel() != y.numel():
        raise ValueError(f"cannot compare vectors of {x.numel()} and {y.numel()} elements")
    if not (all_finite(x) and all_finite(y)):  # in blocks: |x| of a payload is 2 M in float64
        return math.inf
    scale = max(float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y)), TINY)
    return float(torch.linalg.vector_norm(x - y)) / scale


def state_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names (sorted), dtypes, shapes and bytes: equal hashes = identical state."""
    h = hashlib.sha256(b"covey-local-state")
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"|{name}/{t.dtype}/{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def start_digest(start_hash: str, local_state_cid: str | None, accepted: bool) -> str:
    """Commitment 0's hash in a networked round: the round's start local state named by
    what `Strategy.begin_round` makes it from, W_r's digest (the round's `start_hash`) and
    the worker's committed previous end state (its content id, None for a fresh start) with
    whether the previous round's certificate accepted it. Both are hashed anyway (W_r once
    per state, the end state as it is published), so the start is bound without copying it
    to the host and hashing its bytes again; anyone who holds those names computes it."""
    chained = f"{local_state_cid}|{'accepted' if accepted else 'rejected'}"
    text = f"covey-round-start|{start_hash}|{chained if local_state_cid else 'fresh'}"
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Commitment:
    """A worker's state after `step` inner steps of a round.

    hash: at step 0, the round's start: `start_digest` of what it is made from where the
        round's names are known (a networked worker and its validators), else `state_hash`
        of the full local state (parameters and inner optimizer tensors); for a round's
        end state, its content id (`evidence_commitment`); for an intermediate commitment
        `NO_HASH` (""). Commitments of older runs carry a hash at every step: those are
        still read, and a hash is only ever compared with another one
        (`commitment_distance`), so an extra hash neither helps nor hurts a claim.
    sketch["params"]: count sketch of (parameters now - the round's start parameters).
    sketch["optim"]: one `buckets`-long count sketch per kind of optimizer tensor ("exp_avg",
        "exp_avg_sq", ...; kinds sorted, each over its parameters in sorted order),
        concatenated; empty when the strategy has none. Scalars (AdamW's step count) are
        left out: the commitment's step implies them and the hash covers them. One sketch
        per kind, because the kinds differ in scale by orders of magnitude and a joint
        sketch would only see the largest.
    """

    step: int
    hash: str
    sketch: Mapping[str, tuple[float, ...]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "hash": self.hash,
            "sketch": {k: list(self.sketch[k]) for k in ("params", "optim")},
        }

    @classmethod
    def from_dict(cls, d: Any) -> Commitment:
        """Parse a commitment from JSON-like data. ValueError naming what is wrong: missing
        or extra keys, a step that is not a non-negative int, a hash that is neither 64 hex
        digits nor `NO_HASH` (""), no hash at step 0 (the round's start must be one), a
        sketch that is not two lists of finite numbers. Whether a later commitment must
        carry a hash (a round's end) is for its reader to say: a step alone does not tell."""
        if not isinstance(d, dict) or set(d) != {"step", "hash", "sketch"}:
            keys = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"a commitment has keys step, hash, sketch; got {keys}")
        step, digest, sk = d["step"], d["hash"], d["sketch"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"commitment step {step!r} is not a non-negative integer")
        if not isinstance(digest, str) or not (digest == NO_HASH or HEX64.fullmatch(digest)):
            raise ValueError(f"commitment hash {digest!r} is not 64 lowercase hex digits")
        if step == 0 and digest == NO_HASH:
            raise ValueError("commitment 0 (the round's start state) has no hash")
        if not isinstance(sk, dict) or set(sk) != {"params", "optim"}:
            raise ValueError("commitment sketch must have exactly 'params' and 'optim'")
        groups: dict[str, tuple[float, ...]] = {}
        for key in ("params", "optim"):
            values = sk[key]
            if not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
            ):
                raise ValueError(f"sketch {key!r} must be a list of numbers")
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"sketch {key!r} has NaN or Inf values")
            groups[key] = tuple(float(v) for v in values)
        return cls(step, digest, groups)


def commitment_of(
    local: Mapping[str, torch.Tensor],
    start_params: Mapping[str, torch.Tensor],
    step: int,
    buckets: int = BUCKETS,
    *,
    digest: str | None = None,
) -> Commitment:
    """The commitment to a local state (`Strategy.local_state()`) at `step`, relative to the
    round's start parameters. Its hash is `digest` when given (`NO_HASH`: none; a round's
    end passes its content id, a networked round's start its `start_digest`); else
    `state_hash(local)` at step 0 and none at any other step: nothing but the sketches'
    sums leaves the state's device for an intermediate commitment. ValueError when the
    state's parameters ("param/<name>") are not exactly the start state's, by name and
    shape."""
    names = sorted(start_params)
    have = sorted(k[len("param/") :] for k in local if k.startswith("param/"))
    if have != names:
        raise ValueError(f"local state parameters {have[:3]}... differ from the start state's")
    for n in names:
        now, start = local[f"param/{n}"], start_params[n]
        if now.shape != start.shape:
            raise ValueError(f"param/{n}: shape {tuple(now.shape)}, start {tuple(start.shape)}")
    # one parameter's delta at a time, on the local state's device (a float32
    # subtraction rounds alike everywhere): never a model-sized copy (sketch_parts' bits)
    deltas = (
        (
            local[f"param/{n}"].detach().float()
            - start_params[n].detach().float().to(local[f"param/{n}"].device)
        ).reshape(-1)
        for n in names
    )
    groups = sketch_groups(local)
    sketches = [sketch_parts(deltas, buckets)]
    sketches += [
        sketch_parts((local[n].detach().float().reshape(-1) for n in names), buckets)
        for names in groups[1:]
    ]
    if digest is None:
        digest = state_hash(local) if step == 0 else NO_HASH
    return commitment_from_sketches(step, digest, sketches)


def commitment_distance(a: Commitment, b: Commitment) -> float:
    """0 for equal hashes (both present); else the largest relative distance over the sketch
    groups (parameters, then each optimizer kind); inf when the steps or sketch layouts differ
    or a sketch is not finite. Two commitments without hashes are compared by sketch."""
    if a.hash != NO_HASH and a.hash == b.hash and a.step == b.step:
        return 0.0
    n = len(a.sketch["params"])
    if (
        a.step != b.step
        or n == 0
        or len(b.sketch["params"]) != n
        or len(a.sketch["optim"]) != len(b.sketch["optim"])
        or len(a.sketch["optim"]) % n
    ):
        return math.inf
    worst = distance(a.sketch["params"], b.sketch["params"])
    for i in range(0, len(a.sketch["optim"]), n):
        worst = max(worst, distance(a.sketch["optim"][i : i + n], b.sketch["optim"][i : i + n]))
    return worst
