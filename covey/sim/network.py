"""Network cost model for one round of gather-through-a-relay.

Topology (stated in every report): each worker uploads its contribution once to a relay
(the coordinator's blob plane) and downloads every other accepted contribution. The relay
is assumed not to be the bottleneck. Each transfer pays the link's one-way latency once.

A round's wall-clock time:
    compute_i  = worker i's measured (or modelled) inner steps, times its slowdown
    uploaded   = max_i (ready_i + compute_i + latency + sent_i / uplink_i)
    wall       = uploaded + max_i (latency + received_i / downlink_i)
With overlap (Streaming DiLoCo's tau), the next round's first tau inner steps run while the
bytes are in flight, so up to that much communication is hidden.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from covey.config import NetworkConfig


@dataclass(frozen=True)
class Link:
    uplink_bps: float
    downlink_bps: float
    latency_s: float

    def upload_s(self, nbytes: int) -> float:
        return self.latency_s + 8 * nbytes / self.uplink_bps

    def download_s(self, nbytes: int) -> float:
        return self.latency_s + 8 * nbytes / self.downlink_bps


def make_links(cfg: NetworkConfig, n_workers: int, seed: int) -> list[Link]:
    """Per-worker links; a seeded subset of `slow_link_fraction` gets `slow_link_factor` less."""
    n_slow = round(cfg.slow_link_fraction * n_workers)
    slow = set(random.Random(f"covey-links/{seed}").sample(range(n_workers), n_slow))
    links = []
    for i in range(n_workers):
        div = cfg.slow_link_factor if i in slow else 1.0
        links.append(
            Link(cfg.uplink_mbps * 1e6 / div, cfg.downlink_mbps * 1e6 / div, cfg.latency_ms / 1e3)
        )
    return links


@dataclass(frozen=True)
class RoundTiming:
    wall_s: float  # this round's simulated wall-clock time
    compute_s: float  # mean compute time of the live workers
    comm_s: float  # time spent blocked on communication (wall - slowest compute)

    @property
    def utilization(self) -> float:
        return self.compute_s / self.wall_s if self.wall_s > 0 else 1.0


def round_timing(
    ready_s: list[float],
    compute_s: list[float],
    sent: list[int],
    received: list[int],
    links: list[Link],
    hidden_s: float = 0.0,
) -> RoundTiming:
    """Simulated time of one round; lists are indexed by live worker."""
    done = [r + c for r, c in zip(ready_s, compute_s, strict=True)]
    uploaded = max(d + link.upload_s(s) for d, link, s in zip(done, links, sent, strict=True))
    gathered = uploaded + max(link.download_s(n) for link, n in zip(links, received, strict=True))
    comm = max(0.0, gathered - max(done) - hidden_s)
    wall = max(done) + comm
    return RoundTiming(wall, sum(compute_s) / len(compute_s), comm)
