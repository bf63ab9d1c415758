"""What trainers measured of servers, so that no server's word about itself steers the run.

A server's heartbeat says how fast it is and how many samples it holds; both are claims. The
trainers that send it work measure the first (their router's service-time estimate, covey.
swarm.routing) and count the second (backward hops it answered, reported to the pay desk).
The coordinator keeps each trainer's latest measurement of each server and uses the median of
the fresh ones for rebalancing and stage assignment, and caps a server's pending samples at
what trainers vouch it served since its last averaging report. A minority of lying trainers
cannot move the median; trainers are unstaked, so many sybil trainers could sway where
servers are placed (throughput, never pay or weights), which README.md states.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Observations:
    """Trainers' measurements of servers. `fresh_s`: how long one counts."""

    fresh_s: float = 30.0
    by_server: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    vouched: dict[str, int] = field(default_factory=dict)  # samples since last sum report

    def record(self, trainer: str, measured: dict[str, float], live: set[str], now: float) -> None:
        """Keep `trainer`'s measurements of live servers (others are dropped)."""
        for server, value in measured.items():
            if server in live:
                self.by_server.setdefault(server, {})[trainer] = (value, now)

    def throughput(self, server: str, now: float) -> float | None:
        """Median of the fresh measurements of `server`; None when no trainer measured it."""
        fresh = [v for v, at in self.by_server.get(server, {}).values() if now - at <= self.fresh_s]
        return statistics.median(fresh) if fresh else None

    def vouch(self, server: str, samples: int) -> None:
        """Trainers reported `server` answered backward hops worth `samples` samples."""
        self.vouched[server] = self.vouched.get(server, 0) + samples

    def pending(self, server: str, claimed: int) -> int:
        """A server's pending samples, as claimed, capped at what trainers vouched for."""
        return max(0, min(claimed, self.vouched.get(server, 0)))

    def reported_sum(self, server: str, samples: int) -> None:
        """`server` reported a gradient sum of `samples`: they are no longer pending."""
        self.vouched[server] = max(0, self.vouched.get(server, 0) - samples)

    def forget(self, server: str) -> None:
        """A server moved stage or died: what was measured of it no longer holds."""
        self.by_server.pop(server, None)
        self.vouched.pop(server, None)
