"""The trainer's HTTP service: the RL mode of covey's coordinator API.

Membership (join, heartbeat, leave), signatures and nonces, the owner's HALT, the
ledger routes, /healthz and /metrics, rate and body-size limits (the spec's [limits]
table) are the coordinator's host parts (covey.coordinator.host_app); the RL routes are
`/v1/rl/*`. Every POST is signed for the path it is sent to (covey.coordinator.auth). Bad
input is a 4xx naming the field (422 for a body that does not parse, with each field's
problem) and changes nothing.

    GET  /                      status page (reward, pass@1, batches accepted/rejected)
    GET  /v1/run                run id, mode, trainer key, spec (`covey halt`, `ledger verify`)
    GET  /v1/rl/spec            the run's rules and model
    GET  /v1/rl/policy          current version, content id, providers
    GET  /v1/rl/status          JSON of the status page;  GET /v1/rl/batches: every batch
    GET  /v1/blobs/{cid}        policy versions and batches by content id
    GET  /v1/ledger[/balances]  the ledger and the book
    GET  /healthz, /metrics     liveness; Prometheus text (RLCollector and the host's)
    POST /v1/halt               the run owner's signed HALT (`covey halt`)
    POST /v1/join, /v1/heartbeat, /v1/leave, /v1/rl/validators/join
    POST /v1/rl/batch           a worker's signed rollout batch
    POST /v1/rl/claim, /v1/rl/report   a validator's assigned check and its verdict
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from covey.coordinator.host_app import handle_errors, host_middleware, host_routes, serve_app
from covey.coordinator.metrics import HostCollector, Metrics, cost_metrics, reason_label
from covey.coordinator.peer_routes import blob_routes, membership_routes, run_route
from covey.protocol import schemas
from covey.rl.intake import ClaimCheck, ReportCheck, SubmitBatch
from covey.rl.status_page import STATUS_HTML
from covey.rl.trainer import Trainer

log = logging.getLogger("covey.rl.service")
# the paths that register a new key (each writes the ledger): a smaller rate per address
JOINS = frozenset({"/v1/join", "/v1/rl/validators/join"})


def create_app(trainer: Trainer) -> FastAPI:
    app = FastAPI(
        title="covey rl trainer",
        version="1",
        description="Rollout batches, validators and policy versions of an RL run.",
    )
    t = trainer

    handle_errors(app, log)
    limits = t.spec.limits  # its max_json_bytes is the spec's max_batch_bytes
    metrics = Metrics(HostCollector(t.db, t.spec.dead_after_s), RLCollector(t))
    host_routes(app, metrics, t.halt, t.accounts)  # /healthz, /metrics, /v1/halt, /v1/ledger

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(STATUS_HTML)

    run_route(
        app,
        lambda: {
            "run_id": t.run_id,
            "mode": "rl",
            "coordinator_key": t.identity.public_key,
            "owner_key": t.halt.owner_key,
            "spec": {"rl": t.spec.model_dump(mode="json"), "model": t.model_cfg},
            "policy0": t.cids[0],  # the first policy's content id, which the id covers
        },
    )

    @app.get("/v1/rl/spec")
    def spec() -> dict[str, Any]:
        return t.describe()

    @app.get("/v1/rl/policy")
    def policy() -> dict[str, Any]:
        return t.policy_info()

    @app.get("/v1/rl/status")
    def status() -> dict[str, Any]:
        return t.status()

    @app.get("/v1/rl/batches")
    def batches() -> list[dict[str, Any]]:
        """Every batch; one not decided yet shows as "pending" without its content id or
        validator (who checks what stays secret until the verdict)."""
        rows = t.db.query(
            "SELECT step, worker_id, cid, samples, tokens, status, validator_id, "
            "problem, detail FROM rl_batches ORDER BY id"
        )
        out = [dict(r) for r in rows]
        for r in out:
            if r["status"] in ("pending", "claimed"):
                r.update(status="pending", cid=None, validator_id=None)
        return out

    membership_routes(app, t.membership.join, t.membership.heartbeat, t.membership.leave)

    @app.post("/v1/rl/validators/join")
    async def validator_join(req: schemas.ValidatorJoin, request: Request) -> dict[str, Any]:
        raw = await request.json()
        return await run_in_threadpool(_validator_join, t, req, raw)

    @app.post("/v1/rl/batch")
    async def submit(req: SubmitBatch, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(t.intake.submit, req, await request.json())

    @app.post("/v1/rl/claim")
    async def claim(req: ClaimCheck, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(t.intake.claim, req, await request.json())

    @app.post("/v1/rl/report")
    async def report(req: ReportCheck, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(t.intake.report, req, await request.json())

    blob_routes(app, t.blobs)  # policy versions and batches by content id

    host_middleware(app, metrics, limits, json_limit=limits.max_json_bytes, joins=JOINS)
    return app


def _validator_join(t: Trainer, req: schemas.ValidatorJoin, raw: dict[str, Any]) -> dict[str, Any]:
    """A validator registers with its stake (at least min_validator_stake) and goes live."""
    t.membership.join_validator(req, raw)  # refused once the run is halted
    return {
        "ok": True,
        "heartbeat_s": t.spec.heartbeat_s,
        "dead_after_s": t.spec.dead_after_s,
        "verify_device": t.spec.verify_device,  # the class its checks must run on
    }


def serve(trainer: Trainer, host: str, port: int) -> None:
    """Run until SIGINT/SIGTERM, then stop the learning loop and close the database."""
    serve_app(create_app(trainer), host, port, trainer.spec.limits, trainer.start, trainer.stop)


class RLCollector(Collector):
    """The RL run as metrics, read at scrape time: the policy version, batches by status
    (accepted ones are consumed by a step or wait for one), rejected batches by problem."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    def collect(self) -> Iterator[Metric]:
        db = self.t.db
        version = GaugeMetricFamily("covey_rl_policy_version", "The latest policy version")
        version.add_metric([], self.t.version)
        yield version
        batches = GaugeMetricFamily(
            "covey_rl_batches", "Rollout batches by status", labels=["status"]
        )
        for r in db.query("SELECT status, COUNT(*) AS n FROM rl_batches GROUP BY status"):
            batches.add_metric([str(r["status"])], r["n"])
        yield batches
        rejected = CounterMetricFamily(
            "covey_rl_batches_rejected", "Rollout batches rejected, by problem", labels=["problem"]
        )
        for r in db.query(
            "SELECT COALESCE(problem, 'unknown') AS p, COUNT(*) AS n FROM rl_batches "
            "WHERE status = 'rejected' GROUP BY p"
        ):
            rejected.add_metric([reason_label(str(r["p"]))], r["n"])
        yield rejected
        samples = CounterMetricFamily(
            "covey_rl_samples_trained", "Samples of verified batches the trainer stepped on"
        )
        row = db.one(
            "SELECT COALESCE(SUM(samples), 0) AS n FROM rl_batches WHERE status = 'consumed'"
        )
        samples.add_metric([], row["n"] if row else 0)
        yield samples
        yield from cost_metrics(self.t.costs())  # the decentralization multiplier
