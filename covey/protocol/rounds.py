"""The round state machine's decisions, as pure functions of (now, state, config).

Nothing here reads a clock or a socket: the coordinator passes `now` in, so liveness,
budgets, deadlines and closing are tested exhaustively without processes (after torchft's
`quorum_compute`). See docs/network.md, "A round".
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from covey.config import RoundsConfig


@dataclass(frozen=True)
class PeerView:
    """What the coordinator knows of a peer when it plans a round."""

    peer_id: str
    step_time_s: float
    bandwidth_mbps: float | None
    last_seen: float
    state: str  # "live" | "left" | "dead"
    excluded_until: float = 0.0  # a repeated no-show sits out rounds until then


@dataclass(frozen=True)
class Assignment:
    peer_id: str
    inner_steps: int
    data_key: str  # names this peer's batches in this round: sample_batch(worker=data_key)


def data_key(run_id: str, round: int, peer_id: str) -> str:
    """Deterministic from (run id, round, peer id): anyone can recompute a peer's data."""
    return hashlib.blake2b(f"{run_id}/{round}/{peer_id}".encode(), digest_size=8).hexdigest()


def is_alive(now: float, peer: PeerView, cfg: RoundsConfig) -> bool:
    return peer.state == "live" and now - peer.last_seen <= cfg.dead_after_s


def is_eligible(now: float, peer: PeerView, cfg: RoundsConfig) -> bool:
    """Alive and not sitting out rounds for repeated no-shows: may be made a member."""
    return is_alive(now, peer, cfg) and now >= peer.excluded_until


def no_show_backoff(consecutive: int, base_s: float, max_s: float) -> float:
    """How long a peer that joined `consecutive` rounds in a row without submitting sits
    out rounds: nothing for the first (a crash or a slow start happens to anyone), then
    base_s, doubling with each further no-show, never more than max_s. A free identity
    therefore stretches at most one round to its deadline before it is left out."""
    if consecutive < 2:
        return 0.0
    return min(max_s, base_s * 2.0 ** min(consecutive - 2, 60))


def inner_step_budget(
    step_time_s: float, steps_per_round: int, flexible: bool, cfg: RoundsConfig
) -> int:
    """A flexible method (DiLoCo family) gives a slow peer fewer steps, so that it finishes
    within the target compute time; its contribution then weighs its tokens. Others must
    do exactly steps_per_round."""
    if not flexible:
        return steps_per_round
    fits = math.floor(cfg.target_compute_s / max(step_time_s, 1e-6))
    return max(1, min(steps_per_round, fits))


def plan_round(
    now: float,
    run_id: str,
    round: int,
    peers: Sequence[PeerView],
    *,
    steps_per_round: int,
    flexible: bool,
    payload_bytes: int,
    cfg: RoundsConfig,
) -> tuple[list[Assignment], float]:
    """Membership (the eligible peers: live, not sitting out for no-shows; fixed from now
    on), each one's assignment, and the round's deadline: slack x the slowest expected
    compute plus the time to upload one payload and download every other, clamped to the
    configured bounds."""
    members = sorted((p for p in peers if is_eligible(now, p, cfg)), key=lambda p: p.peer_id)
    assignments, longest = [], 0.0
    for p in members:
        steps = inner_step_budget(p.step_time_s, steps_per_round, flexible, cfg)
        mbps = p.bandwidth_mbps or cfg.bandwidth_mbps
        transfer_s = payload_bytes * len(members) * 8 / (mbps * 1e6)
        longest = max(longest, steps * p.step_time_s + transfer_s)
        assignments.append(Assignment(p.peer_id, steps, data_key(run_id, round, p.peer_id)))
    budget = min(max(cfg.deadline_slack * longest, cfg.deadline_min_s), cfg.deadline_max_s)
    return assignments, now + budget


def close_reason(
    now: float, deadline: float, waiting_on: Iterable[str], submitted: Iterable[str]
) -> str | None:
    """Why the round closes now, or None to keep it open. `waiting_on` is the members still
    alive: a dead or departed member is never waited for."""
    outstanding = set(waiting_on) - set(submitted)
    if not outstanding:
        return "every live member submitted"
    if now >= deadline:
        return f"deadline passed; {len(outstanding)} live member(s) had not submitted"
    return None
