"""Which validator checks a drawn answer: not the first to ask, but the one the answer's
draw ranks first among the live validators. The draw is the coordinator's signature over
the answer (covey.trust.certify.sample), which no worker or validator sees before the
answer is recorded, so no validator can pick the answers of a worker it colludes with, and
no worker can steer its answers to one.

A validator's rank for an answer is sha256(draw, validator id); the worker itself and the
validators that let a claim on it lapse are skipped (while others are live)."""

from __future__ import annotations

import hashlib


def rank(draw: str, validator: str) -> str:
    return hashlib.sha256(f"covey-serve-assign|{draw}|{validator}".encode()).hexdigest()


def assigned(draw: str, worker: str, live: list[str], tried: list[str]) -> str | None:
    """The validator that checks the answer of `worker` with `draw`, or None (nobody live)."""
    eligible = [v for v in live if v != worker]
    fresh = [v for v in eligible if v not in tried] or eligible
    return min(fresh, key=lambda v: rank(draw, v)) if fresh else None
