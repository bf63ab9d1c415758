"""The referee of a dispute: it recomputes one disputed segment alone and judges who is
right (covey.trust.verify bisected the disagreement down to that segment).

After Verde (Gensyn, arXiv 2502.19405): whatever the round's length, the referee's work is
one segment of at most k inner steps, and the prefix before it when no state at the
segment's start can be trusted. The referee trusts neither side. A validator may supply its
state at the segment's start (so the prefix need not be recomputed); it is used only when its
full content hash equals the worker's own commitment there, else the referee recomputes the
prefix from W_r itself. Intermediate commitments carry no hash (covey/trust/sketch.py), so
for a segment past the first the prefix is recomputed: at most the round's steps before the
segment, once, on top of the segment and its probe (docs/trust.md, "Bisection and the referee"). A
sketch is never evidence: its hashing is public, so a state can be crafted in its null space
(sketch-equal, content-different) to frame an honest worker. And since a segment that
amplifies rounding (a loss spike) would make honest parties look far apart, the referee
re-runs the segment from a nudged start and raises its noise floor by what the nudge did.
Pure, like verify: no network, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from covey.algorithms.base import Strategy
from covey.algorithms.codec_base import Codec
from covey.algorithms.state import TrainState
from covey.trust.sketch import (
    NO_HASH,
    Commitment,
    commitment_distance,
    commitment_of,
    distance,
    state_hash,
)
from covey.trust.verify import (
    DEFAULT_TOLERANCE,
    BatchFn,
    require_reexecutable,
    segment_bounds,
    take_step,
)

Outcome = Literal["fraud", "validator wrong", "honest drift", "inconclusive"]
# The referee's nudge at least: relative to the parameters' norm, some float32 ulps.
STABILITY_PROBE = 1e-6
# A disputed end must be this many times farther than the nudge moved it to count as far.
STABILITY_MARGIN = 10.0
# A validator whose claimed end is within this many noise floors of the worker's committed
# end, when the worker is right, drifted honestly (another thread count, another machine's
# rounding just past the tolerance): nobody is penalized. Farther, its report is provably
# wrong. 2x: a rare cross-thread drift past the tolerance was seen at 1.1-1.5x of it.
DRIFT_FACTOR = 2.0


@dataclass(frozen=True)
class RefereeResult:
    """One recomputed segment.

    end: its end commitment, or the decoded payload for the last segment; None when the
        referee refused to compute (see detail).
    start_distance: the sketch distance of the referee's own segment start from the worker's
        commitment there (given `claimed_start`; capped at the tolerance). It only sizes
        the stability probe, which can only make a verdict more lenient to the worker:
        a sketch may decide how hard to look, never a verdict.
    detail: how the segment's start was obtained, when a supplied state was ignored.
    stability: how far the segment's end moves when its start is nudged by the size of the
        disagreement at its start (`STABILITY_PROBE` at least). A segment that amplifies
        the nudge (a loss spike, say) amplifies the honest differences between two
        machines too; `judge` raises its noise floor accordingly.
    """

    segment: int
    end: Commitment | torch.Tensor | None
    start_distance: float = 0.0
    detail: str = ""
    stability: float = 0.0


def _run_segment(
    strategy: Strategy,
    start_state: TrainState,
    batch_fn: BatchFn,
    first: int,
    end: int,
    steps: int,
    codec: Codec,
) -> Commitment | torch.Tensor:
    strategy.steps = first  # a loaded segment start: lr schedule and Streaming's merge step
    for step in range(first, end):  # each step seeded by its own index (take_step)
        take_step(strategy, batch_fn, step)
    if end == steps:
        return codec.decode(strategy.make_contribution().payload)
    return commitment_of(strategy.local_state(copy=False), start_state.params, end)


def _nudge(strategy: Strategy, start_state: TrainState, relative: float) -> None:
    """Perturb the local state with fixed-seed Gaussian noise: the parameters by
    max(relative * ||params - start||, STABILITY_PROBE * ||params||) in l2 norm, every other
    floating local tensor (optimizer moments) elementwise by a relative
    max(relative, STABILITY_PROBE), which keeps signs and zeros (exp_avg_sq stays >= 0)."""
    params = dict(strategy.model.named_parameters())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # drawn on the host (the same numbers on every device), applied where params live
        noise = {n: torch.randn(params[n].shape, generator=g) for n in sorted(params)}
        size = max(
            relative * _norm(params[n].cpu() - start_state.params[n].cpu() for n in params),
            STABILITY_PROBE * _norm(params.values()),
        )
        scale = size / max(_norm(noise.values()), 1e-30)
        for n, z in noise.items():
            params[n].add_(z.to(params[n].device, params[n].dtype) * scale)
        sigma = max(relative, STABILITY_PROBE)
        for name, t in sorted(strategy.local_state(copy=False).items()):
            if not name.startswith("param/") and t.is_floating_point() and t.dim() > 0:
                t.mul_(1 + sigma * torch.randn(t.shape, generator=g).to(t.device, t.dtype))


def _norm(tensors: Iterable[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


def referee(
    strategy: Strategy,
    start_state: TrainState,
    segment: int,
    segment_start: Mapping[str, torch.Tensor] | None,
    batch_fn: BatchFn,
    steps: int,
    commit_every: int,
    codec: Codec | None = None,
    *,
    claimed_start: Commitment | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    probe: bool = True,
    previous_end: dict[str, torch.Tensor] | None = None,
    previous_accepted: bool = True,
) -> RefereeResult:
    """Recompute one segment of a round and return its end.

    Segment 0 starts from `start_state` and the worker's committed previous end state
    (`previous_end`, `previous_accepted`: see `Strategy.begin_round`; None: fresh). A later
    segment may start from `segment_start` (a validator's `Reexecution.states[segment]`), but
    only when its full content hash (`state_hash`) equals `claimed_start.hash`, the worker's
    own commitment at that index: then it is the very state the worker committed to. Any
    other supplied state (a different hash, a sketch within tolerance included, a malformed
    one) is ignored and the referee recomputes the prefix from the round's start, at the
    cost of the segments before this one; `detail` says so. So is one whose commitment
    carries no hash (`NO_HASH`: every intermediate commitment covey makes): the
    prefix is then always recomputed, and the supplied state is not even hashed. A lossy
    sketch never lets a party's state in: one crafted in the sketch's null space would
    frame an honest worker.

    With `probe`, the segment is computed a second time from a nudged start
    (`RefereeResult.stability`), so that `judge` does not convict an honest worker whose
    run diverged from the validator's through amplified rounding (measured by
    covey.bench.trust_calibration: it happens, in loss spikes). The nudge is as large as
    the sketch distance between the referee's start and `claimed_start` (capped at
    `tolerance`), at least STABILITY_PROBE. Costs one more segment.

    ValueError for a strategy that is not re-executable, a segment the round lacks, or a
    segment_start given without claimed_start."""
    require_reexecutable(strategy)
    first, end = segment_bounds(segment, steps, commit_every)
    codec = codec or strategy.codec
    # the local-state chain: the round starts from the worker's committed previous end state
    # (None: fresh)
    strategy.begin_round(start_state, previous_end, previous_accepted)
    start_distance = 0.0
    detail = ""
    use_supplied = False
    if segment_start is not None:
        if claimed_start is None:
            raise ValueError("a supplied segment-start state needs the worker's commitment")
        try:
            use_supplied = (
                claimed_start.step == first
                and claimed_start.hash != NO_HASH
                and state_hash(segment_start) == claimed_start.hash
            )
            if use_supplied:
                strategy.load_local_state(dict(segment_start))
        except (ValueError, TypeError, KeyError, RuntimeError) as e:
            use_supplied, detail = False, f"supplied state at step {first} rejected ({e}); "
            strategy.begin_round(start_state, previous_end, previous_accepted)
        if not use_supplied:
            detail = detail or (
                f"the worker's commitment {segment} carries no hash: the supplied state at "
                f"step {first} is not used; "
                if claimed_start.hash == NO_HASH
                else f"supplied state at step {first} does not hash to the worker's "
                f"commitment {segment}: ignored; "
            )
            detail += f"recomputed steps 0..{first - 1} from the round's start"
    if not use_supplied:
        for step in range(first):  # no usable state supplied: recompute the prefix ourselves
            take_step(strategy, batch_fn, step)
    if claimed_start is not None:  # how far apart the two machines already were here
        try:
            ours = commitment_of(  # sketches only: a hash would not change the distance
                strategy.local_state(copy=False), start_state.params, first, digest=NO_HASH
            )
            start_distance = min(commitment_distance(ours, claimed_start), tolerance)
        except ValueError:
            start_distance = tolerance
    begin = strategy.local_state() if probe else None
    result = _run_segment(strategy, start_state, batch_fn, first, end, steps, codec)
    stability = 0.0
    if begin is not None:
        strategy.load_state(start_state)
        strategy.load_local_state(begin)
        _nudge(strategy, start_state, start_distance)
        nudged = _run_segment(strategy, start_state, batch_fn, first, end, steps, codec)
        stability = _end_distance(result, nudged)
    return RefereeResult(segment, result, start_distance, detail, stability)


def _end_distance(a: Commitment | torch.Tensor, b: Commitment | torch.Tensor) -> float:
    if isinstance(a, Commitment) and isinstance(b, Commitment):
        return commitment_distance(a, b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return distance(a, b) if a.numel() == b.numel() else math.inf
    raise ValueError(f"cannot compare a {type(a).__name__} with a {type(b).__name__}")


@dataclass(frozen=True)
class Judgement:
    outcome: Outcome
    detail: str


def judge(
    result: RefereeResult,
    claimed: Commitment | torch.Tensor,
    validator_claim: Commitment | torch.Tensor,
    tolerance: float,
) -> Judgement:
    """Decide a dispute from the referee's recomputed segment end and what the worker
    (`claimed`) and the validator said it is (`segment_end` of each claim).

    Distances count as "far" beyond the noise floor max(tolerance, STABILITY_MARGIN *
    result.stability): a segment that amplifies a small nudge of its start may amplify the
    honest difference between two machines just as much (more: a random nudge
    underestimated it up to ~3x in covey.bench.trust_calibration's runs, hence the margin).

    "fraud": the worker's end is far from the referee's, the validator's is not.
    "validator wrong": the reverse, and the validator's end is also more than DRIFT_FACTOR
    floors from the worker's committed end: its report is provably wrong (it pays for it).
    "honest drift": the worker is right, and the validator's end, though past the floor
    from the referee's, is within DRIFT_FACTOR floors of the worker's: what honest
    non-determinism (another thread count) does near the tolerance; nobody is penalized.
    "inconclusive" (nobody is paid or slashed): the referee refused (a made-up
    segment-start state), or both or neither are far, which a numerically unstable segment
    (a loss spike) produces for honest parties. ValueError when the ends are of different
    kinds."""
    if result.end is None:
        return Judgement("inconclusive", result.detail)
    floor = max(tolerance, STABILITY_MARGIN * result.stability)
    w = _end_distance(result.end, claimed)
    v = _end_distance(result.end, validator_claim)
    said = (
        f"segment {result.segment}: referee is {w:.3g} from the worker and {v:.3g} from the "
        f"validator"
    ) + (f" ({result.detail})" if result.detail else "")
    if w > floor and v <= floor:
        return Judgement("fraud", said)
    if w <= floor and v > floor:
        apart = _end_distance(validator_claim, claimed)
        if apart <= DRIFT_FACTOR * floor:
            return Judgement(
                "honest drift",
                f"{said}; the validator is {apart:.3g} from the worker, within "
                f"{DRIFT_FACTOR:g} x {floor:.3g}: honest non-determinism",
            )
        return Judgement("validator wrong", said)
    why = (
        f"numerically unstable: a nudged start moves its end by {result.stability:.3g}"
        if floor > tolerance
        else f"tolerance {tolerance}"
    )
    return Judgement("inconclusive", f"{said}; {why}")
