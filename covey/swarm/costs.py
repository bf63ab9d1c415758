"""The SWARM mode's decentralization multiplier (covey.protocol.multiplier): the stage
servers' time in the run, against the compute a centralized process of the same device
class needs for the trained microbatches.

Servers heartbeat their time in the run (`uptime_s`, since they began heartbeating) and
their seconds computing requests (`busy_s`, the emulated slowdown included); each reply
carries that hop's compute (X-Covey-Compute). Each trainer books the compute of every hop
it made by what became of its microbatch, and reports its booking; the coordinator adds
its servers' idle time:

- useful: the compute of the hops of trained microbatches (a centralized process runs
  exactly these forward and backward passes);
- redundant: the compute of each duplicate hop sent to a second server to check the first;
- churn: the compute of hops of microbatches that could not finish (dropped), the wall
  seconds of hops that timed out (a dead or stalled server: its compute is not reported),
  and servers' compute that no trainer booked (replies lost with a connection);
- rejected: invalid replies (the server is banned) and every hop of a microbatch whose
  duplicated replies disagreed (sent to the referee);
- network: servers' time in the run not computing: waiting for activations and gradients,
  their stages' averaging rounds, idle in pipeline bubbles;
- evidence: the agreed checks trainers send the coordinator to be paid on (their bytes, and
  their share of the report's upload seconds);
- verification: the referee's recomputations run on the coordinator and are not booked.

A trainer's own time (it only routes and waits) is not counted, as a coordinator's is not.
Reports and heartbeats are their senders' word, bounded, and only ever shown and summed; a
coordinator that restarts shows only the peers that report again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from covey.protocol.multiplier import Costs, CostsReport

ROLES = ("hop", "check", "failed", "invalid")
UNMEASURED = ("referee recomputation",)
MAX_PEERS = 10_000  # trainers and servers whose reports are kept (a few floats each)


@dataclass
class Spent:
    """One hop attempt: `role` is a hop used by the microbatch, the `check` duplicate of
    one, a `failed` attempt (timed out, rerouted) or an `invalid` reply (banned)."""

    role: str
    wall_s: float
    compute_s: float | None = None


def book_microbatch(costs: Costs, hops: list[Spent], outcome: str) -> None:
    """Book a finished microbatch's hops: `outcome` is "trained", "dropped" (it could not
    finish) or "disputed" (its duplicated replies disagreed)."""
    if outcome not in ("trained", "dropped", "disputed"):
        raise ValueError(f"unknown outcome {outcome!r}: trained, dropped or disputed")
    for h in hops:
        if h.role not in ROLES:
            raise ValueError(f"unknown hop role {h.role!r}: one of {ROLES}")
        wall = max(0.0, h.wall_s)
        if h.compute_s is None and h.role != "failed":  # no compute header: the whole hop
            costs.mark_unmeasured("servers' compute (replies without X-Covey-Compute)")
        # a server's claim is held to the hop's wall time; a failed hop's is its wall time
        compute = wall if h.compute_s is None else min(max(0.0, h.compute_s), wall)
        if h.role == "invalid" or outcome == "disputed":
            costs.rejected_s += compute
        elif h.role == "failed" or outcome == "dropped":
            costs.churn_s += compute
        elif h.role == "check":
            costs.redundant_s += compute
        else:  # a used hop of a trained microbatch
            costs.useful_s += compute


@dataclass
class TrainerCosts:
    """A trainer's running booking: each worker thread collects its microbatch's hops
    (`begin`, `hop`, `end`), booked under one lock."""

    costs: Costs = field(default_factory=Costs)
    lock: threading.Lock = field(default_factory=threading.Lock)
    local: threading.local = field(default_factory=threading.local)

    def begin(self) -> None:
        self.local.hops, self.local.disputed = [], False

    def hop(self, role: str, wall_s: float, compute_s: float | None = None) -> None:
        hops = getattr(self.local, "hops", None)
        if hops is not None:
            hops.append(Spent(role, wall_s, compute_s))

    def disputed(self) -> None:
        """The microbatch's duplicated replies disagreed: it ends rejected."""
        self.local.disputed = True

    def end(self, trained: bool) -> None:
        hops = getattr(self.local, "hops", None) or []
        outcome = "trained" if trained else "dropped"
        if getattr(self.local, "disputed", False):
            outcome = "disputed"
        self.local.hops = None
        with self.lock:
            book_microbatch(self.costs, hops, outcome)

    def evidence(self, seconds: float, nbytes: int) -> None:
        with self.lock:
            self.costs.evidence_s += max(0.0, seconds)
            self.costs.evidence_bytes += max(0, nbytes)

    def as_dict(self) -> dict[str, object]:
        """The multiplier so far, as covey.protocol.multiplier.Costs.as_dict."""
        with self.lock:
            return self.costs.as_dict()

    def report(self) -> dict[str, object]:
        """The cumulative booking, for the trainer's report (covey.protocol.swarm)."""
        with self.lock:
            return CostsReport.of(self.costs)


class RunCosts:
    """The coordinator's sum: its trainers' latest (cumulative) reports, and its servers'
    latest time in the run and compute (from their heartbeats)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reports: dict[str, CostsReport] = {}
        self.servers: dict[str, tuple[float, float]] = {}  # peer -> (uptime_s, busy_s)

    def note(self, trainer: str, report: CostsReport | None) -> None:
        if report is None:
            return
        with self.lock:
            if trainer in self.reports or len(self.reports) < MAX_PEERS:
                self.reports[trainer] = report

    def server(self, peer: str, uptime_s: float, busy_s: float) -> None:
        with self.lock:
            if peer in self.servers or len(self.servers) < MAX_PEERS:
                self.servers[peer] = (uptime_s, min(busy_s, uptime_s))

    def total(self) -> Costs:
        total = Costs(unmeasured=list(UNMEASURED))
        with self.lock:
            reports, servers = list(self.reports.values()), list(self.servers.values())
        for r in reports:
            r.add_to(total)
        uptime, busy = sum(u for u, _ in servers), sum(b for _, b in servers)
        total.network_s += max(0.0, uptime - busy)
        # servers' compute no trainer booked: replies lost with their connections
        booked = total.useful_s + total.redundant_s + total.churn_s + total.rejected_s
        total.churn_s += max(0.0, busy - booked)
        return total
