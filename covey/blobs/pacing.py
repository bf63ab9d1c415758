"""Pacing a blob server's sends: a token bucket shared by every connection it paces.

A worker's blob server serves two kinds of bytes: its round traffic (the payloads the
coordinator and its peers fetch within the round) and its verification evidence (the
private local states its drawn validators fetch after the round). The evidence is paced, so
that however many validators fetch at once, it takes at most the run's `trust.evidence_mbps`
of the worker's uplink, and the round traffic has the rest (docs/trust.md, "Verification off
the critical path").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

PIECE_BYTES = 64 << 10  # a paced send goes in pieces of this size, each waiting its turn
BURST_S = 0.25  # the bucket holds this many seconds of sending (at least one piece)


class TokenBucket:
    """`rate` bytes a second, up to `burst` bytes at once. Reservations may run the bucket
    into debt: `reserve(n, now)` books n bytes and returns how long to wait before sending
    them, so that whoever reserves, the bytes sent by any time t since the first
    reservation at t0 are at most burst + rate x (t - t0). Thread-safe; pure in the clock
    (`now` is given), so the bound is tested without sleeping."""

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"a token bucket needs a positive rate and burst, got {rate}, {burst}")
        self.rate, self.burst = float(rate), float(burst)
        self._tokens = self.burst
        self._at: float | None = None
        self._lock = threading.Lock()

    def reserve(self, n: int, now: float) -> float:
        """Book `n` bytes at time `now` (seconds, monotonic) -> seconds to wait first."""
        with self._lock:
            if self._at is not None and now > self._at:
                self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now if self._at is None else max(self._at, now)
            self._tokens -= n
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class Pacer:
    """A TokenBucket on a clock: `wait(n)` sleeps until n more bytes may go. `clock` and
    `sleep` are the real ones but in tests, which pass a clock that `sleep` advances."""

    def __init__(
        self,
        rate_bytes_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.rate_bytes_s = float(rate_bytes_s)
        self.burst = max(float(PIECE_BYTES), self.rate_bytes_s * BURST_S)
        self.bucket = TokenBucket(self.rate_bytes_s, self.burst)
        self._clock, self._sleep = clock, sleep

    def wait(self, n: int) -> None:
        delay = self.bucket.reserve(n, self._clock())
        if delay > 0:
            self._sleep(delay)


def mbps_to_bytes_s(mbps: float) -> float:
    """Mbit/s (10^6 bits) as bytes a second."""
    return mbps * 1e6 / 8
