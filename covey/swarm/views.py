"""The read side of the SWARM coordinator (covey.swarm.service): the server list trainers
route on, the status page's JSON, and the run's Prometheus collector (the host's metrics,
covey.coordinator.metrics, add HTTP, peers and the ledger's height)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from covey.coordinator.metrics import cost_metrics

if TYPE_CHECKING:
    from covey.swarm.service import SwarmCoordinator

PRIVATE = ("url", "blob_url", "public_key")  # ServerInfo fields the status page leaves out


def servers_view(self: SwarmCoordinator) -> dict[str, Any]:
    """Live, synced servers per stage (with the key each signs its replies with) and
    each stage's recent agreed states, for trainers' routing
    (covey.swarm.routing.StateWatch)."""
    with self.lock:
        stages: list[list[dict[str, Any]]] = [[] for _ in range(self.cfg.stages)]
        for s in self.servers.values():
            book = self.averaging.stages[s.stage]
            if not s.moving and s.step >= 0 and s.step >= book.step - 1:
                stages[s.stage].append({"peer_id": s.peer_id, "name": s.name, "url": s.url,
                                        "public_key": s.public_key})  # fmt: skip
        # recent agreed states, oldest first: replies are signed on the last two (a
        # round's switch-over) or on a newer one about to be agreed (routing.StateWatch)
        agreed = [list(states) for states in self.known_states]
        return {"stages": stages, "agreed": agreed}


def status(self: SwarmCoordinator) -> dict[str, Any]:
    with self.lock:
        now = time.time()
        servers = [
            {
                **{k: v for k, v in asdict(s).items() if k not in PRIVATE},
                "measured": self.observed.throughput(s.peer_id, now),  # by trainers
            }
            for s in self.servers.values()
        ]
        per_stage = [
            {
                "stage": k,
                "servers": [s["name"] for s in servers if s["stage"] == k],
                "throughput": round(
                    sum(s["measured"] or 0.0 for s in servers if s["stage"] == k), 3
                ),
            }
            for k in range(self.cfg.stages)
        ]
        book = self.accounts.book
        return {
            "run_id": self.run_id,
            "name": self.cfg.name,
            "halted": self.halt.halted,  # the owner's HALT ({index, round, reason}) or None
            "stages": per_stage,
            "averaging": self.averaging.status(),
            "servers": servers,
            "trainers": dict(self.trainers),
            "reroutes": sum(int(t.get("reroutes", 0)) for t in self.trainers.values()),
            "rebalances": len(self.rebalances),
            "moves": self.rebalances[-20:],
            "disputes": self.disputes[-20:],
            "banned": sorted(p for p, a in book.accounts.items() if a.banned),
            "balances": {p: a.balance for p, a in book.accounts.items() if a.balance},
            "costs": self.run_costs.total().as_dict(),  # the multiplier (covey.swarm.costs)
        }


class SwarmCollector(Collector):
    """The SWARM run as metrics, read at scrape time: servers per stage, live trainers,
    each stage's averaging step, rebalances, the payout epoch and banned peers."""

    def __init__(self, coord: SwarmCoordinator) -> None:
        self.coord = coord

    def collect(self) -> Iterator[Metric]:
        c = self.coord
        with c.lock:
            per_stage = [sum(s.stage == k for s in c.servers.values()) for k in range(c.cfg.stages)]
            steps = [b.step for b in c.averaging.stages]
            trainers, rebalances, epoch = len(c.trainers), len(c.rebalances), c.epoch
        servers = GaugeMetricFamily(
            "covey_swarm_servers", "Live stage servers, by stage", labels=["stage"]
        )
        step = GaugeMetricFamily(
            "covey_swarm_stage_step", "Averaging rounds applied, by stage", labels=["stage"]
        )
        for k, n in enumerate(per_stage):
            servers.add_metric([str(k)], n)
            step.add_metric([str(k)], steps[k])
        yield servers
        yield step
        stages = GaugeMetricFamily("covey_swarm_stages", "Pipeline stages of the run")
        stages.add_metric([], c.cfg.stages)
        yield stages
        known = GaugeMetricFamily("covey_swarm_trainers", "Trainers that joined the run")
        known.add_metric([], trainers)
        yield known
        moves = CounterMetricFamily("covey_swarm_rebalances", "Servers moved to another stage")
        moves.add_metric([], rebalances)
        yield moves
        paid = GaugeMetricFamily("covey_swarm_epoch", "The last payout epoch")
        paid.add_metric([], epoch)
        yield paid
        banned = GaugeMetricFamily("covey_banned_peers", "Peers banned for fraud")
        banned.add_metric([], sum(a.banned for a in c.accounts.book.accounts.values()))
        yield banned
        yield from cost_metrics(c.run_costs.total().as_dict())  # the decentralization multiplier
