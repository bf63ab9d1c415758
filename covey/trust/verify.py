"""Verification of contributed work: commitments, re-execution, bisection.

After Verde (Gensyn, arXiv 2502.19405). A worker training a round commits to
its local state every k inner steps; a validator re-executes the round from the canonical
start W_r on the same batches and compares. When they disagree, the committed list is
bisected to one segment whose start both sides agree on and whose end they do not, and a
referee recomputes only that segment: at most k inner steps, whatever the round's length
(covey/trust/referee.py).

Segments. A round of `steps` inner steps has commitments at steps 0, k, 2k, ... strictly
below `steps` (`commitment_steps`): ceil(steps / k) of them, and as many segments.
Segment i runs from commitment i to commitment i + 1; the last one ends at the payload
itself, which is the round's real output, so no commitment is made at the final step. A
round shorter than k (and DDP's single step) is one segment, from W_r to the payload.

Commitment 0 is the round's start state: `Strategy.begin_round` from W_r and the worker's
committed end state of its previous round (the local-state chain; a fresh optimizer when
there is none), so its hash is known exactly to anyone who holds those. Later commitments
carry no hash (a hash is SHA-256 of the whole state on the host; their sketches are made on
the training device) and are compared by count sketch (covey/trust/sketch.py) within a
tolerance, since an honest re-execution on another machine differs in the last bits. The
round's end is bound by hash: its end state by content id (`Reexecution.end`), its payload
byte for byte;
`covey.bench.trust_calibration` measures honest and dishonest distances so the tolerance
sits between them. The payload is compared in
full: the validator holds it.

Strategies are re-executable (`Strategy.reexecutable`) when a round is a pure function of
(W_r, the previous end state, the accept flag, batches): DDP, DiLoCo (keep or reset, with or
without error feedback), Streaming DiLoCo and DeMo. Everything here is pure: no network, no
clock; the caller moves the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from covey.algorithms.base import Strategy
from covey.algorithms.codec_base import Codec, CodecError
from covey.algorithms.state import TrainState
from covey.config import TrustConfig
from covey.memory import all_finite
from covey.models.randomness import step_rng
from covey.trust.committer import Committer
from covey.trust.evidence import (  # the local state on the wire: re-exported here
    evidence_commitment,
    evidence_of,  # noqa: F401
    local_state_cid,  # noqa: F401
)
from covey.trust.sketch import (
    HEX64,
    NO_HASH,
    Commitment,
    commitment_distance,
    distance,
    start_digest,
)
from covey.trust.state_wire import (  # re-exported: callers import them from here
    local_state_from_bytes,  # noqa: F401
    local_state_from_file,  # noqa: F401
    local_state_nbytes,  # noqa: F401
    local_state_to_bytes,  # noqa: F401
    published_state_nbytes,  # noqa: F401
)

BatchFn = Callable[[int], torch.Tensor]  # inner step (0-based, within the round) -> batch
DEFAULT_TOLERANCE: float = TrustConfig.model_fields["tolerance"].default


def commitment_steps(steps: int, commit_every: int) -> list[int]:
    """The inner steps at which a round of `steps` steps commits: 0, k, 2k, ... < steps.
    ValueError for steps < 1 or commit_every < 1."""
    if steps < 1 or commit_every < 1:
        raise ValueError(f"need steps >= 1 and commit_every >= 1, got {steps} and {commit_every}")
    return list(range(0, steps, commit_every))


def segment_bounds(segment: int, steps: int, commit_every: int) -> tuple[int, int]:
    """(first step, end step) of a segment: it runs inner steps first .. end - 1.
    ValueError for a segment the round does not have."""
    n = len(commitment_steps(steps, commit_every))
    if not 0 <= segment < n:
        raise ValueError(f"segment {segment} out of range: the round has {n} segments")
    return segment * commit_every, min((segment + 1) * commit_every, steps)


# -- re-execution and comparison -------------------------------------------------------


@dataclass
class Reexecution:
    """What a validator computed: the payload, the commitments, and the local states kept
    at the commitment indices asked for (to hand a referee the start of a segment; in
    memory, or `SpilledStates` on disk)."""

    payload: bytes
    commitments: list[Commitment]
    states: Mapping[int, dict[str, torch.Tensor]]
    steps: int
    commit_every: int
    # the local-state chain: the local state after make_contribution (step = steps); None
    # when the strategy carries no local state (no end state is committed)
    end: Commitment | None = None
    # the content id of that end state as a worker publishes it (`evidence_cid`): equal to
    # the end_state_cid a worker named, it ties the named bytes to this re-execution
    # exactly, and nobody fetches them
    end_cid: str | None = None


class SpilledStates(Mapping[int, dict[str, torch.Tensor]]):
    """Local states kept on disk, one raw file each under `root`: the tensors of `like`'s
    names, shapes and dtypes, in sorted name order, written and read one tensor at a time.
    A validator keeps every commitment's state for a dispute that rarely comes; at 124M
    each is weights + AdamW moments, 1.5 GB, so none stays in memory."""

    def __init__(self, root: Path, like: Mapping[str, torch.Tensor]) -> None:
        self.root = root
        self.layout = [(k, tuple(like[k].shape), like[k].dtype) for k in sorted(like)]
        self.kept: set[int] = set()

    def put(self, i: int, state: Mapping[str, torch.Tensor]) -> None:
        with open(self.root / f"state-{i}.bin", "wb") as f:
            for name, _, _ in self.layout:  # as bytes: numpy has no bfloat16
                t = state[name].detach().contiguous().cpu().reshape(-1)
                f.write(t.view(torch.uint8).numpy().tobytes())
        self.kept.add(i)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i not in self.kept:
            raise KeyError(i)
        out = {}
        with open(self.root / f"state-{i}.bin", "rb") as f:
            for name, shape, dtype in self.layout:
                t = torch.empty(shape, dtype=dtype)
                view = t.reshape(-1).view(torch.uint8).numpy()
                if f.readinto(view) != view.nbytes:
                    raise ValueError(f"spilled state {i} is truncated at {name}")
                out[name] = t
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.kept))

    def __len__(self) -> int:
        return len(self.kept)


def take_step(strategy: Strategy, batch_fn: BatchFn, step: int) -> torch.Tensor:
    """Inner step `step` of a round, as the worker took it: `strategy.inner_step` on
    `batch_fn(step)`, its randomness (dropout) drawn under `step_rng` from
    `batch_fn.step_seed(step)` when the batch function has one
    (covey.data.batches.AssignmentBatches: a pure function of the run seed, round, data key
    and step), so any step re-executes alone, mid-round included. A batch function without
    step seeds leaves torch's generators as they are (the simulator's, plain tests')."""
    seeds = getattr(batch_fn, "step_seed", None)
    with step_rng(strategy.device, None if seeds is None else int(seeds(step))):
        return strategy.inner_step(batch_fn(step))


def require_reexecutable(strategy: Strategy) -> None:
    if not strategy.reexecutable:
        raise ValueError(
            f"{type(strategy).__name__} with this config is not re-executable: its rounds "
            f"depend on worker-local state it does not commit"
        )


def reexecute(
    strategy: Strategy,
    start_state: TrainState,
    batch_fn: BatchFn,
    steps: int,
    commit_every: int,
    keep_states: Iterable[int] = (),
    previous_end: dict[str, torch.Tensor] | None = None,
    previous_accepted: bool = True,
    spill_dir: Path | None = None,
    consume_previous_end: bool = False,
    start_names: tuple[str, str | None] | None = None,
) -> Reexecution:
    """Train a round from `start_state` exactly as a worker does (begin_round from
    `previous_end`/`previous_accepted`, the worker's committed end state of its previous
    round (None: a fresh start), `steps` inner steps on batch_fn(0..steps-1),
    make_contribution) and commit every k steps; `end` commits to the state after it
    (None for a strategy that carries no local state: its rounds commit no end state).

    `strategy` is the validator's own instance; its local state is overwritten. The
    states of `keep_states` are kept in memory, or with `spill_dir` on disk there
    (`SpilledStates`, valid while the directory is). `consume_previous_end`: empty the
    `previous_end` dict once it is loaded, so its tensors (weights + moments) are freed
    for the steps; the caller must not read it again. `start_names`: (W_r's digest, the
    content id of `previous_end` or None), the round's names as its worker has them:
    commitment 0's hash is then their `covey.trust.sketch.start_digest` with
    `previous_accepted`, as the worker's (None: the start state's `state_hash`). ValueError for a
    strategy that is not re-executable, a keep_states index the round lacks, or an
    unusable previous_end."""
    require_reexecutable(strategy)
    points = commitment_steps(steps, commit_every)
    keep = set(keep_states)
    if bad := sorted(i for i in keep if not 0 <= i < len(points)):
        raise ValueError(f"keep_states {bad}: the round has commitments 0..{len(points) - 1}")
    strategy.begin_round(start_state, previous_end, previous_accepted)
    if consume_previous_end and previous_end is not None:
        previous_end.clear()  # copied into the strategy (the caller's frame keeps the dict)
    digest = None if start_names is None else start_digest(*start_names, previous_accepted)
    committer = Committer(strategy, start_state, commit_every, start_digest=digest)
    states: dict[int, dict[str, torch.Tensor]] | SpilledStates = {}
    if spill_dir is not None:
        states = SpilledStates(spill_dir, strategy.local_state_layout())

    def kept(i: int) -> None:
        if isinstance(states, SpilledStates):
            states.put(i, strategy.local_state(copy=False))
        else:
            states[i] = strategy.local_state()

    if 0 in keep:
        kept(0)
    for step in range(steps):
        take_step(strategy, batch_fn, step)
        done = step + 1
        committer.after_step(done)
        if done % commit_every == 0 and done < steps and done // commit_every in keep:
            kept(done // commit_every)
    # what encoding does not read is let go first, as a worker does: the
    # gradients, and the inner optimizer of a strategy that carries nothing into its next
    # round, whose end state nobody commits (covey.coordinator.intake refuses one)
    carries = strategy.carries_local_state
    strategy.free_round_memory(optimizer=not carries)
    payload = strategy.make_contribution().payload
    end, end_cid = None, None
    if carries:
        local = strategy.local_state(copy=False)
        end = evidence_commitment(strategy, local, start_state, steps)
        end_cid = end.hash  # the published bytes' content id: hashed once
    return Reexecution(payload, committer.commitments, states, steps, commit_every, end, end_cid)


@dataclass(frozen=True)
class Verdict:
    """The outcome of comparing a claim with a re-execution.

    agree: the claim stands. exact: bit-identical (same hashes and payload bytes).
    distance: the largest distance over the commitments and the payload (inf for a
    structurally wrong claim). segment: where a referee should look (None when agreeing).
    distances: per commitment, then the payload (empty for a structurally wrong claim).
    """

    agree: bool
    exact: bool
    distance: float
    segment: int | None
    detail: str = ""
    distances: tuple[float, ...] = field(default=())


def _structure_fault(
    claimed: Sequence[Any],
    payload: Any,
    mine: Reexecution,
    codec: Codec,
    numel: int,
) -> str | None:
    """What makes a claim malformed, checkable by anyone without re-executing; None if ok."""
    want = commitment_steps(mine.steps, mine.commit_every)
    if not isinstance(claimed, Sequence):
        return f"commitments must be a list, got {type(claimed).__name__}"
    if len(claimed) != len(want):
        return (
            f"{len(claimed)} commitments; a round of {mine.steps} steps committing every "
            f"{mine.commit_every} has {len(want)}"
        )
    n_params = len(mine.commitments[0].sketch["params"])
    n_optim = len(mine.commitments[0].sketch["optim"])
    for i, (c, step) in enumerate(zip(claimed, want, strict=True)):
        if not isinstance(c, Commitment):
            return f"commitment {i} is a {type(c).__name__}"
        if c.step != step:
            return f"commitment {i} is at step {c.step}, expected {step}"
        if not isinstance(c.hash, str) or not (
            HEX64.fullmatch(c.hash) or (i > 0 and c.hash == NO_HASH)
        ):
            return f"commitment {i} hash is not 64 hex digits"
        sk = c.sketch
        if not isinstance(sk, Mapping) or set(sk) != {"params", "optim"}:
            return f"commitment {i} sketch must have exactly 'params' and 'optim'"
        if not all(isinstance(sk[g], (list, tuple)) for g in ("params", "optim")):
            return f"commitment {i} sketch groups must be lists of numbers"
        if len(sk["params"]) != n_params or len(sk["optim"]) != n_optim:
            return (
                f"commitment {i} sketch lengths {len(sk['params'])}/{len(sk['optim'])}, "
                f"expected {n_params}/{n_optim}"
            )
        try:
            finite = all(math.isfinite(v) for v in (*sk["params"], *sk["optim"]))
        except TypeError:
            return f"commitment {i} sketch holds non-numbers"
        if not finite:
            return f"commitment {i} sketch has NaN or Inf values"
    if claimed[0].hash != mine.commitments[0].hash:
        return (
            "commitment 0 is not the round's start state (W_r and the committed local state "
            "of the worker's previous round, or a fresh one)"
        )
    try:
        vector = codec.decode(payload, numel)
    except CodecError as e:
        return f"payload rejected: {e}"
    if not all_finite(vector):
        return "payload decodes to NaN or Inf values"
    return None


def bisect(agrees: Callable[[int], bool], n_points: int) -> int:
    """The segment to dispute, among points 0..n_points-1 (commitments, then the payload):
    one whose start agrees and whose end does not, found with O(log n) calls to `agrees`
    when the last point disagrees. Point 0 must agree. Divergence that persists once it
    starts (any real divergence) yields the first diverging segment; a claim whose later
    points agree again (a lying commitment) yields the segment ending at its first
    disagreement. ValueError when every point agrees."""
    if not agrees(n_points - 1):
        lo, hi = 0, n_points - 1
    else:
        first = next((i for i in range(1, n_points) if not agrees(i)), None)
        if first is None:
            raise ValueError("every point agrees: there is no segment to dispute")
        lo, hi = 0, first
    while hi - lo > 1:  # invariant: agrees(lo), not agrees(hi)
        mid = (lo + hi) // 2
        if agrees(mid):
            lo = mid
        else:
            hi = mid
    return lo


def compare(
    claimed_commitments: Sequence[Commitment],
    claimed_payload: bytes,
    mine: Reexecution,
    codec: Codec,
    numel: int,
    tolerance: float,
    claimed_end: Commitment | None = None,
) -> Verdict:
    """Compare a worker's claim (commitments and payload) with a re-execution.

    The local-state chain: `claimed_end`, the commitment to the end local state the worker
    published (the next round's start is derived from it), is compared with `mine.end` as
    part of the payload point: a forged end state is a disagreement in the last segment.

    Exact when the round's ends are: the payload bytes and the end state's hash (its content
    id) identical, commitment 0's hash too (a malformed claim otherwise), and every
    intermediate commitment within `tolerance` (they carry no hashes; a hash a claim adds
    to one is not looked at). Otherwise the claim agrees when every commitment's sketch
    distance and the decoded payload's distance are within `tolerance`; if not, `segment`
    is the diverging segment found by `bisect`. A malformed
    claim (wrong number or steps of commitments, wrong sketch lengths, NaN/Inf, a
    commitment 0 that is not W_r, a payload that does not decode) is a disagreement at
    segment 0 whose `detail` says what is wrong: anyone can check it without re-executing.
    Never raises on a bad claim."""
    fault = _structure_fault(claimed_commitments, claimed_payload, mine, codec, numel)
    if fault is None and claimed_end is not None and mine.end is not None:
        if claimed_end.step != mine.end.step:
            fault = f"end state is at step {claimed_end.step}, the round has {mine.end.step}"
        elif math.isinf(commitment_distance(claimed_end, mine.end)):
            fault = "end state has another layout than the round's local state"
    if fault is not None:
        return Verdict(False, False, math.inf, 0, fault)
    n = len(mine.commitments)
    # sketches only, 64 numbers a group: cheap next to the payload's decoding
    pairs = zip(claimed_commitments, mine.commitments, strict=True)
    between = [commitment_distance(a, b) for a, b in pairs]
    end_exact = (
        claimed_end is None
        or mine.end is None
        or (claimed_end.hash != NO_HASH and claimed_end.hash == mine.end.hash)
    )
    if end_exact and claimed_payload == mine.payload and max(between) <= tolerance:
        return Verdict(True, True, max(between), None, "bit-identical", (*between, 0.0))
    # each side widened to float64 as `distance` widens it, its float32 decoding let go at
    # once, rather than holding both decodings next to both widenings; the same values
    payload_distance = distance(
        codec.decode(claimed_payload, numel).double(), codec.decode(mine.payload, numel).double()
    )
    if claimed_end is not None and mine.end is not None:
        payload_distance = max(payload_distance, commitment_distance(claimed_end, mine.end))
    distances = (*between, payload_distance)
    worst = max(distances)
    if worst <= tolerance:
        return Verdict(True, False, worst, None, f"within tolerance {tolerance}", distances)
    segment = bisect(lambda i: distances[i] <= tolerance, n + 1)
    first, end = segment_bounds(segment, mine.steps, mine.commit_every)
    where = "the payload" if segment == n - 1 else f"commitment {segment + 1}"
    return Verdict(
        False,
        False,
        worst,
        segment,
        f"segment {segment} (steps {first}..{end - 1}) diverges: distance "
        f"{distances[segment + 1]:.3g} at {where}, tolerance {tolerance}",
        distances,
    )


def segment_end(
    commitments: Sequence[Commitment], payload: bytes, segment: int, codec: Codec, numel: int
) -> Commitment | torch.Tensor:
    """What a claim says a segment ends at: commitment segment + 1, or for the last segment
    the decoded payload. CodecError for an undecodable payload; IndexError for a segment the
    claim lacks."""
    if not 0 <= segment < len(commitments):
        raise IndexError(f"segment {segment}: the claim has {len(commitments)} segments")
    if segment + 1 < len(commitments):
        return commitments[segment + 1]
    return codec.decode(payload, numel)
