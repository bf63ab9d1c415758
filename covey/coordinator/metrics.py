"""Prometheus metrics of one coordinator, in any mode (rounds, RL, SWARM): `/metrics` (text
format; the route is covey.coordinator.host_app's).

Three sources, one per-app `CollectorRegistry` (never the global one, so a test process can
hold several apps):

- `HttpMetrics`, an ASGI middleware, times every request and counts its bytes in and out,
  labelled by the route *template* (`/v1/rounds/{round}/certificate`), never the raw path:
  a client choosing paths must not be able to grow the label set.
- `HostCollector`, the same in every mode: live and registered peers, ledger height.
- The mode's own collector of its run: `RunCollector` here for rounds (rounds, accepted
  and rejected contributions by reason, verifications, disputes), the RL trainer's and the
  SWARM coordinator's beside their apps. Each reads the run from SQLite at scrape time,
  so the service code needs no counter calls and a restarted coordinator reports the
  same totals it had before. Committed certificates and recorded refusals never change,
  so they are tallied once: a scrape reads only the rounds and refusals it has not seen.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .peers import Peers

if TYPE_CHECKING:
    from .db import Database
    from .service import Coordinator

CONTENT_TYPE = CONTENT_TYPE_LATEST  # text/plain; version=0.0.4; charset=utf-8
# long polls of /v1/rounds/{round}/certificate hold a request up to 30 s
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
MAX_REASONS = 32  # distinct rejection-reason labels; further ones count as "other"
_HEX = re.compile(r"\b[0-9a-f]{8,}\b")
_NUM = re.compile(r"\b\d+(\.\d+)?\b")
_PARENS = re.compile(r"\s*\([^)]*\)")


def reason_label(reason: str) -> str:
    """A rejection reason reduced to its kind: without parentheses, the text before the
    first ": ", with ids and numbers replaced, at most 80 characters ("round 3.0 is not
    open (open round: 4.0): late" -> "round <n> is not open")."""
    head = _PARENS.sub("", reason).split(": ", 1)[0]
    head = _NUM.sub("<n>", _HEX.sub("<id>", head))
    return head[:80] or "unknown"


def route_label(scope: Scope) -> str:
    """The matched route's path template, or "unmatched" (404s, refusals before routing)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class RunCollector(Collector):
    """The rounds mode's run as metrics (rounds, contributions, verifications, disputes),
    read from the coordinator's database at scrape time."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self._lock = threading.Lock()
        self._seen_round = -1  # certificates of rounds <= this are in _accepted
        self._seen_rejection = 0  # rejections with ids <= this are in _rejected
        self._accepted = 0
        self._rejected: Tally[str] = Tally()

    def _fold(self) -> None:
        """Add what was committed or refused since the last scrape to the tallies."""
        db = self.coord.db
        with self._lock:
            rows = db.query(
                "SELECT round, json_array_length(certificate, '$.accepted') AS n FROM rounds "
                "WHERE status = 'committed' AND round > ? ORDER BY round",
                (self._seen_round,),
            )
            if rows:
                self._accepted += sum(r["n"] or 0 for r in rows)
                self._seen_round = rows[-1]["round"]
            for r in db.query(
                "SELECT id, reason FROM rejections WHERE id > ? ORDER BY id",
                (self._seen_rejection,),
            ):
                label = reason_label(str(r["reason"]))
                if label not in self._rejected and len(self._rejected) >= MAX_REASONS:
                    label = "other"
                self._rejected[label] += 1
                self._seen_rejection = r["id"]

    def collect(self) -> Iterator[Metric]:
        coord = self.coord
        db = coord.db
        self._fold()
        rounds = CounterMetricFamily(
            "covey_rounds_committed", "Rounds committed (certificates written)"
        )
        rounds.add_metric([], coord.state.round)
        yield rounds

        open_row = db.one("SELECT round FROM rounds WHERE status IN ('open', 'closing')")
        current = GaugeMetricFamily(
            "covey_round", "The open round, or the next one to open when none is open"
        )
        current.add_metric([], open_row["round"] if open_row else coord.state.round)
        yield current

        totals = db.one(
            "SELECT COALESCE(SUM(bytes), 0) AS b, COALESCE(SUM(tokens), 0) AS t FROM rounds "
            "WHERE status = 'committed'"
        )
        payload = CounterMetricFamily(
            "covey_contribution_bytes",
            "Bytes of the contributions in committed rounds",
        )
        payload.add_metric([], totals["b"] if totals else 0)
        yield payload
        tokens = CounterMetricFamily("covey_tokens", "Tokens of accepted contributions")
        tokens.add_metric([], totals["t"] if totals else 0)
        yield tokens

        accepted = CounterMetricFamily(
            "covey_contributions_accepted", "Contributions accepted in committed rounds"
        )
        accepted.add_metric([], self._accepted)
        yield accepted
        rejected = CounterMetricFamily(
            "covey_contributions_rejected",
            "Contributions refused at intake, by kind of reason",
            labels=["reason"],
        )
        for reason, n in sorted(self._rejected.items()):
            rejected.add_metric([reason], n)
        yield rejected

        checks = GaugeMetricFamily(
            "covey_verifications", "Verification tasks by status", labels=["status"]
        )
        for r in db.query(
            "SELECT status, COUNT(*) AS n FROM verifications GROUP BY status ORDER BY status"
        ):
            checks.add_metric([r["status"]], r["n"])
        yield checks
        open_disputes = GaugeMetricFamily("covey_disputes_open", "Disputes the referee has open")
        row = db.one("SELECT COUNT(*) AS n FROM verifications WHERE status = 'disputed'")
        open_disputes.add_metric([], row["n"] if row else 0)
        yield open_disputes
        settled = CounterMetricFamily(
            "covey_disputes", "Disputes settled by the referee, by outcome", labels=["outcome"]
        )
        for r in db.query(
            "SELECT json_extract(payload, '$.outcome') AS outcome, COUNT(*) AS n FROM ledger "
            "WHERE type = 'dispute' GROUP BY outcome ORDER BY outcome"
        ):
            settled.add_metric([str(r["outcome"])], r["n"])
        yield settled
        yield from cost_metrics(coord.costs())


def cost_metrics(costs: dict[str, Any]) -> Iterator[Metric]:
    """The decentralization multiplier and the peer seconds of each of its parts
    (covey.protocol.multiplier), from a `Costs.as_dict()`."""
    if costs.get("multiplier") is not None:
        m = GaugeMetricFamily(
            "covey_decentralization_multiplier",
            "Peer seconds spent per second a centralized process needs for the same tokens",
        )
        m.add_metric([], costs["multiplier"])
        yield m
    parts = CounterMetricFamily(
        "covey_peer_seconds",
        "Peer seconds by what they bought: useful compute, or a part of the multiplier",
        labels=["part"],
    )
    parts.add_metric(["useful"], costs["useful_s"])
    for part, seconds in costs["parts_s"].items():
        parts.add_metric([part], seconds)
    yield parts


class HostCollector(Collector):
    """What every mode's host has: live and registered peers (Membership's table) and the
    signed ledger's height, read from the mode's database at scrape time."""

    def __init__(
        self,
        db: Database,
        dead_after_s: float,
        live: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """`live()`: live peers by role, for a mode that keeps liveness in memory (SWARM's
        servers); by default the peers table's live members heard from within
        `dead_after_s`."""
        self.db, self.dead_after_s, self.live = db, dead_after_s, live
        self.peers = Peers(db)

    def live_by_role(self) -> dict[str, int]:
        """Live peers by role (also what the status pages' frame shows)."""
        if self.live is not None:
            return self.live()
        by_role = dict.fromkeys(("worker", "validator"), 0)
        by_role.update(self.peers.live_by_role(time.time() - self.dead_after_s))
        return by_role

    def collect(self) -> Iterator[Metric]:
        db = self.db
        live = GaugeMetricFamily(
            "covey_live_peers",
            "Peers that are live and heard from within dead_after_s",
            labels=["role"],
        )
        for role, n in sorted(self.live_by_role().items()):
            live.add_metric([role], n)
        yield live
        peers = GaugeMetricFamily(
            "covey_peers", "Registered peers by role and recorded state", labels=["role", "state"]
        )
        for role, state, n in self.peers.counts():
            peers.add_metric([role, state], n)
        yield peers

        height = GaugeMetricFamily("covey_ledger_height", "Entries in the signed ledger")
        row = db.one("SELECT COALESCE(MAX(idx) + 1, 0) AS n FROM ledger")
        height.add_metric([], row["n"] if row else 0)
        yield height


class Metrics:
    """The registry of one app: HTTP metrics (filled by `HttpMetrics`), the host's
    (`HostCollector`) and the mode's own collector of its run."""

    def __init__(self, host: HostCollector, run: Collector) -> None:
        self.host = host
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency = Histogram(
            "covey_http_request_duration_seconds",
            "Time from a request's start to its last response byte, by route template",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "covey_http_requests",
            "Requests answered, by route template and status code",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.bytes_in = Counter(
            "covey_http_received_bytes",
            "Request body bytes received",
            ["route"],
            registry=self.registry,
        )
        self.bytes_out = Counter(
            "covey_http_sent_bytes",
            "Response body bytes sent",
            ["route"],
            registry=self.registry,
        )
        self.registry.register(host)
        self.registry.register(run)

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge whose value is `read()` at scrape time."""
        Gauge(name, documentation, registry=self.registry).set_function(read)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything in this registry."""
        return generate_latest(self.registry)


class HttpMetrics:
    """ASGI middleware recording each HTTP request in `metrics`. Add it last, so it is the
    outermost layer and also sees refusals that happen before routing (413)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        # the labelled children, looked up once per (method, route, status): `labels()`
        # costs a lock and a tuple's validation per call, a measurable share of a heartbeat
        self._children: dict[tuple[str, str, int], tuple[Any, Any, Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        received = sent = 0
        status = 500  # what the client sees when the app raises before answering

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return message

        async def counting_send(message: Message) -> None:
            nonlocal sent, status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            key = (scope["method"], route_label(scope), status)
            children = self._children.get(key)
            if children is None:
                m, (method, route, _) = self.metrics, key
                children = (
                    m.latency.labels(method, route),
                    m.requests.labels(method, route, str(status)),
                    m.bytes_in.labels(route),
                    m.bytes_out.labels(route),
                )
                if len(self._children) < 10_000:  # bounded: routes x methods x codes
                    self._children[key] = children
            latency, requests, bytes_in, bytes_out = children
            latency.observe(time.perf_counter() - start)
            requests.inc()
            bytes_in.inc(received)
            bytes_out.inc(sent)
