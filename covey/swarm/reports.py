"""What a SWARM trainer tells: its periodic report to the coordinator (progress, the
work each server did for it, its measurements of servers and its agreed checks) and the
summary `covey swarm trainer --json` writes."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from covey.peer.client import CoordinatorClient, CoordinatorLost, PeerRejected
from covey.swarm.costs import TrainerCosts
from covey.swarm.routing import Router
from covey.trust.identity import Identity

log = logging.getLogger("covey.swarm.trainer")


@dataclass
class TrainerStats:
    microbatches: int = 0
    samples: int = 0
    dropped: int = 0
    checks: int = 0
    disputes: int = 0
    paid_checks: int = 0  # checks the coordinator accepted as evidence (pay rests on them)
    refused_checks: int = 0
    bytes_between_stages: int = 0
    losses: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.time)


class Reporting(Protocol):
    """What `send_report` reads and updates of a trainer (covey.swarm.trainer.SwarmTrainer)."""

    name: str
    run_id: str
    identity: Identity
    client: CoordinatorClient
    router: Router
    stats: TrainerStats
    spent: TrainerCosts
    lock: threading.Lock
    served: dict[str, int]
    evidence: list[dict[str, Any]]
    halted: str | None
    stop: threading.Event
    progress: Callable[[str], None]
    _next: int
    first: int

    def loss(self, last: int = 10) -> float | None: ...

    def _join(self) -> int: ...


def send_report(self: Reporting) -> None:
    """Report progress and served work. When the coordinator is down (restarting) or
    forgot this trainer, nothing is lost: the work goes in the next report, after a
    join when it was forgotten."""
    from covey.protocol.swarm import MAX_CHECKS_PER_REPORT

    with self.lock:
        served, self.served = self.served, {}
        checks = self.evidence[:MAX_CHECKS_PER_REPORT]
        del self.evidence[:MAX_CHECKS_PER_REPORT]
        st = self.stats
        loss = self.loss()
        body = {
            "run_id": self.run_id,
            "peer_id": self.identity.peer_id,
            "served": served,
            # what this trainer measured of each server (the coordinator rebalances on
            # trainers' measurements, never on a server's own claim)
            "measured": {
                p: round(x.throughput, 4)
                for p, x in self.router.servers.items()
                if x.throughput is not None and x.banned is None
            },
            "samples": st.samples,
            "loss": loss if loss is not None and math.isfinite(loss) else None,
            "reroutes": self.router.reroutes,
            # reasons within the schema's bound (covey.protocol.swarm.SwarmReport)
            "banned": {s: why[:200] for s, why in self.router.banned().items()},
            "next": self._next,
            "checks": checks,
            "costs": self.spent.report(),  # covey.swarm.costs: cumulative
        }
    # the checks are evidence the coordinator pays on: their bytes, and their share of
    # this report's upload seconds (covey.swarm.costs)
    evidence_bytes = len(json.dumps(checks)) if checks else 0
    started = time.perf_counter()
    try:
        try:
            reply = self.client.post("/v1/swarm/report", body)
        except PeerRejected as e:
            if e.status != 403:
                raise
            self._join()  # a restarted coordinator that lost us: join, then report
            reply = self.client.post("/v1/swarm/report", body)
    except (CoordinatorLost, PeerRejected) as e:
        if isinstance(e, PeerRejected) and e.status == 410:  # halted by the run owner
            log.error("[%s] the run was halted by its owner; stopping: %s", self.name, e)
            self.halted = e.message
            self.stop.set()
            return
        log.warning("[%s] report deferred: %s", self.name, e)
        with self.lock:
            for s, n in served.items():
                self.served[s] = self.served.get(s, 0) + n
            self.evidence[:0] = checks
        return
    if evidence_bytes:
        share = evidence_bytes / max(len(json.dumps(body)), 1)
        self.spent.evidence(share * (time.perf_counter() - started), evidence_bytes)
    for outcome in reply.get("checks", []):
        if outcome.startswith("refused"):
            st.refused_checks += 1
            log.warning("[%s] check refused: %s", self.name, outcome)
        else:  # paid, or parked until its state is agreed
            st.paid_checks += 1
    loss = body["loss"]
    self.progress(
        f"[{self.name}] {st.samples} samples, loss {loss if loss is None else round(loss, 4)}, "
        f"{st.samples / max(time.time() - st.started, 1e-9):.1f} samples/s, reroutes "
        f"{self.router.reroutes}, dropped {st.dropped}, disputes {st.disputes}"
    )


def summary(t: Reporting) -> dict[str, Any]:
    st = t.stats
    return {
        "samples": st.samples,
        "first_microbatch": t.first,
        "microbatches": st.microbatches,
        "dropped": st.dropped,
        "loss": t.loss(),
        "reroutes": t.router.reroutes,
        "checks": st.checks,
        "paid_checks": st.paid_checks,
        "refused_checks": st.refused_checks,
        "disputes": st.disputes,
        "bytes_between_stages": st.bytes_between_stages,
        "banned": t.router.banned(),
        "seconds": time.time() - st.started,
    }
