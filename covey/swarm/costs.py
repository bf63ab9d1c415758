"""The SWARM mode's decentralization multiplier (covey.protocol.multiplier), booked by each
trainer from the hops it makes and summed by the coordinator from the trainers' reports.

A trainer times every hop it sends (request out to signed reply in) and reads the seconds
the server spent computing it (the reply's X-Covey-Compute header, covey.swarm.server).
When a microbatch ends, its hops are booked by what became of it:

- useful: the servers' compute of each hop of a trained microbatch (a centralized process of
  the same device class runs exactly these forward and backward passes);
- network: the rest of those hops' wall seconds (activations and gradients on the wire,
  queueing behind other trainers' work);
- redundant: the duplicate of a hop sent to a second server to check the first (its whole
  wall time: it is only ever done to compare);
- churn: hops that timed out (a dead or stalled server, then rerouted) and every hop of a
  microbatch that could not finish (dropped);
- rejected: hops whose reply was invalid (the server is banned) and every hop of a
  microbatch whose duplicated replies disagreed (sent to the referee);
- evidence: the agreed checks the trainer sends the coordinator to be paid on (their bytes,
  and their share of the report's upload seconds);
- verification: the referee's recomputations happen on the coordinator and are not booked
  here.

What is not measured: servers' time in their stages' averaging rounds, and the referee's
work (listed as unmeasured). A trainer's report is its own word, bounded and only shown
and summed; a coordinator restart keeps only trainers that report again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from covey.protocol.multiplier import Costs, CostsReport

ROLES = ("hop", "check", "failed", "invalid")
UNMEASURED = ("stage averaging (servers' time)", "referee recomputation")
MAX_TRAINERS = 10_000  # trainers whose reports are kept (each is a handful of floats)


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
        wall = max(0.0, h.wall_s)
        if h.role not in ROLES:
            raise ValueError(f"unknown hop role {h.role!r}: one of {ROLES}")
        if h.role == "invalid" or outcome == "disputed":
            costs.rejected_s += wall
        elif h.role == "failed" or outcome == "dropped":
            costs.churn_s += wall
        elif h.role == "check":
            costs.redundant_s += wall
        else:  # a used hop of a trained microbatch
            if h.compute_s is None:  # a server that sent no compute header: all of it
                costs.mark_unmeasured("servers' compute (replies without X-Covey-Compute)")
            compute = wall if h.compute_s is None else min(max(0.0, h.compute_s), wall)
            costs.useful_s += compute
            costs.network_s += wall - compute


@dataclass
class TrainerCosts:
    """A trainer's running booking: each worker thread collects its microbatch's hops
    (`begin`, `hop`, `end`), booked under one lock."""

    costs: Costs = field(default_factory=lambda: Costs(unmeasured=list(UNMEASURED)))
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
    """The coordinator's sum of its trainers' latest (cumulative) reports."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reports: dict[str, CostsReport] = {}

    def note(self, trainer: str, report: CostsReport | None) -> None:
        if report is None:
            return
        with self.lock:
            if trainer in self.reports or len(self.reports) < MAX_TRAINERS:
                self.reports[trainer] = report

    def total(self) -> Costs:
        total = Costs()
        with self.lock:
            reports = list(self.reports.values())
        for r in reports:
            r.add_to(total)
        if not reports:
            total.unmeasured = list(UNMEASURED)
        return total
