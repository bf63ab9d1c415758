"""Move servers between stages so the pipeline's slowest stage gets faster (SWARM sec. 3.3).

A pipeline runs at its minimum stage throughput. Given each stage's cost (requests, or
relative compute, per sample) and each server's speed (cost units per second, i.e. its
samples/s measured per request, `speeds_from_measurements`), `plan_move` proposes
moving one server from the stage with the most spare throughput to the bottleneck
stage, and only when that raises the minimum stage throughput by more than the factor
`hysteresis`. Each accepted move multiplies the minimum by more than `hysteresis` > 1, so
repeated calls on a fixed load cannot cycle: servers do not oscillate between stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Move:
    server: str
    from_stage: int
    to_stage: int
    min_before: float  # pipeline samples/s
    min_after: float


def stage_throughputs(
    stage_costs: Sequence[float], servers: Mapping[str, tuple[int, float]]
) -> list[float]:
    """Samples/s of each stage: the sum of its servers' speeds over its cost. ValueError
    names a stage index out of range or a cost that is not > 0."""
    for k, c in enumerate(stage_costs):
        if not c > 0:
            raise ValueError(f"stage {k} cost {c} must be > 0")
    speed = [0.0] * len(stage_costs)
    for name, (stage, v) in servers.items():
        if not 0 <= stage < len(stage_costs):
            raise ValueError(
                f"server {name} on stage {stage}; stages are 0..{len(stage_costs) - 1}"
            )
        speed[stage] += v
    return [s / c for s, c in zip(speed, stage_costs, strict=True)]


def speeds_from_measurements(
    stage_costs: Sequence[float], measured: Mapping[str, tuple[int, float]]
) -> dict[str, tuple[int, float]]:
    """Server -> (stage, speed) from server -> (stage, samples/s measured per request).

    A stage's cost is the requests one sample makes there (stage servers measure each
    request), so a request on one sample is one cost unit and the per-request rate is
    already the speed in cost units per second. Multiplying it by the cost, as this did
    before, counted a stage-0 server's forward and backward as if each finished a sample:
    stage 0 looked twice as fast as it is, and with servers of 1x-4x the rebalancer moved
    the 3x server off stage 0 (measured "min stage 11.64 -> 15.78 samples/s") while the
    pipeline actually fell from ~13 to 10 samples/s. ValueError names a stage out of range.
    """
    for name, (stage, _) in measured.items():
        if not 0 <= stage < len(stage_costs):
            raise ValueError(
                f"server {name} on stage {stage}; stages are 0..{len(stage_costs) - 1}"
            )
    return {n: (k, float(tp)) for n, (k, tp) in measured.items()}


def plan_move(
    stage_costs: Sequence[float],
    servers: Mapping[str, tuple[int, float]],
    *,
    hysteresis: float = 1.1,
) -> Move | None:
    """The one move worth making now, or None. The donor is the stage other than the
    bottleneck with the most spare throughput that keeps at least one server; the moved
    server is the donor's server whose move gives the highest new minimum (ties: name).
    ValueError when hysteresis <= 1."""
    if not hysteresis > 1:
        raise ValueError(f"hysteresis ({hysteresis}) must be > 1 or moves could oscillate")
    tp = stage_throughputs(stage_costs, servers)
    if len(tp) < 2:
        return None
    low = min(tp)
    bottleneck = min(range(len(tp)), key=lambda k: (tp[k], k))
    count = [0] * len(tp)
    for stage, _ in servers.values():
        count[stage] += 1
    donors = [k for k in range(len(tp)) if k != bottleneck and count[k] >= 2]
    if not donors:
        return None
    donor = max(donors, key=lambda k: (tp[k] - low, -k))
    best: Move | None = None
    for name in sorted(n for n, (k, _) in servers.items() if k == donor):
        moved = dict(servers)
        moved[name] = (bottleneck, servers[name][1])
        after = min(stage_throughputs(stage_costs, moved))
        if best is None or after > best.min_after:
            best = Move(name, donor, bottleneck, low, after)
    if best is None or not best.min_after > hysteresis * low:
        return None
    return best
