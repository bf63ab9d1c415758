"""The trainer's HTTP service: the RL mode of covey's coordinator API.

Membership (join, heartbeat, leave), signatures and nonces, the body-size limit and the
blob routes are the coordinator's own components and middleware; the RL routes are
`/v1/rl/*`. Every POST is signed for the path it is sent to (covey.coordinator.auth).
Bad input is a 4xx naming the field (422 for a body that does not parse, with each
field's problem) and changes nothing.

    GET  /                      status page (reward, pass@1, batches accepted/rejected)
    GET  /v1/run                run id and trainer key (for `covey ledger verify URL`)
    GET  /v1/rl/spec            the run's rules and model
    GET  /v1/rl/policy          current version, content id, providers
    GET  /v1/rl/status          JSON of the status page;  GET /v1/rl/batches: every batch
    GET  /v1/blobs/{cid}        policy versions and batches by content id
    GET  /v1/ledger[/balances]  the ledger and the book
    POST /v1/join, /v1/heartbeat, /v1/leave, /v1/rl/validators/join
    POST /v1/rl/batch           a worker's signed rollout batch
    POST /v1/rl/claim, /v1/rl/report   a validator's assigned check and its verdict
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from covey.coordinator.app import BodyLimit
from covey.coordinator.auth import ReceivedAt
from covey.coordinator.rejected import Rejected
from covey.protocol import schemas
from covey.rl.intake import ClaimCheck, ReportCheck, SubmitBatch
from covey.rl.status_page import STATUS_HTML
from covey.rl.trainer import Trainer

log = logging.getLogger("covey.rl.service")


def create_app(trainer: Trainer) -> FastAPI:
    app = FastAPI(
        title="covey rl trainer",
        version="1",
        description="Rollout batches, validators and policy versions of an RL run.",
    )
    t = trainer

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, exc: Rejected) -> JSONResponse:
        level = logging.DEBUG if exc.status == 404 else logging.WARNING
        log.log(level, "%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return JSONResponse({"error": exc.message}, exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()
        ]
        log.warning("%s %s -> 422: %s", request.method, request.url.path, "; ".join(problems[:5]))
        return JSONResponse({"error": "invalid request", "problems": problems[:50]}, 422)

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(STATUS_HTML)

    @app.get("/v1/run")
    def run() -> dict[str, Any]:
        return {"run_id": t.run_id, "coordinator_key": t.identity.public_key, "mode": "rl"}

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
        validator (who checks what, and which real batch a canary copies, stay secret)."""
        rows = t.db.query(
            "SELECT step, worker_id, cid, samples, tokens, status, validator_id, "
            "problem, detail FROM rl_batches ORDER BY id"
        )
        out = [dict(r) for r in rows]
        for r in out:
            if r["status"] in ("pending", "claimed"):
                r.update(status="pending", cid=None, validator_id=None)
        return out

    @app.post("/v1/join")
    async def join(req: schemas.JoinRequest, request: Request) -> schemas.JoinReply:
        return await run_in_threadpool(t.membership.join, req, await request.json())

    @app.post("/v1/rl/validators/join")
    async def validator_join(req: schemas.ValidatorJoin, request: Request) -> dict[str, Any]:
        raw = await request.json()
        return await run_in_threadpool(_validator_join, t, req, raw)

    @app.post("/v1/heartbeat")
    async def heartbeat(req: schemas.HeartbeatRequest, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(t.membership.heartbeat, req, await request.json())

    @app.post("/v1/leave")
    async def leave(req: schemas.LeaveRequest, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(t.membership.leave, req, await request.json())

    @app.post("/v1/rl/batch")
    async def submit(req: SubmitBatch, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(t.intake.submit, req, await request.json())

    @app.post("/v1/rl/claim")
    async def claim(req: ClaimCheck, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(t.intake.claim, req, await request.json())

    @app.post("/v1/rl/report")
    async def report(req: ReportCheck, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(t.intake.report, req, await request.json())

    @app.api_route("/v1/blobs/{cid}", methods=["GET", "HEAD"], response_class=Response)
    def get_blob(cid: str, request: Request) -> Response:
        if not t.blobs.has(cid):
            raise Rejected(404, f"no blob {cid[:80]!r}")
        if request.method == "HEAD":
            return Response(headers={"Content-Length": str(t.blobs.size(cid))})
        return FileResponse(t.blobs.path(cid), media_type="application/octet-stream")

    @app.get("/v1/ledger")
    def ledger_entries(
        start: int = Query(0, ge=0, le=schemas.MAX_INT), limit: int = Query(1000, ge=1, le=5000)
    ) -> list[dict[str, Any]]:
        return t.accounts.entries(start, limit)

    @app.get("/v1/ledger/balances")
    def ledger_balances() -> dict[str, Any]:
        return t.accounts.book.summary()

    app.add_middleware(BodyLimit, json_limit=t.spec.max_batch_bytes, blob_limit=0)
    app.add_middleware(ReceivedAt)  # signatures are checked against the endpoint
    return app


def _validator_join(t: Trainer, req: schemas.ValidatorJoin, raw: dict[str, Any]) -> dict[str, Any]:
    """A validator registers with its stake (at least min_validator_stake) and goes live."""
    t.membership.check_run(req.run_id)
    t.membership.register(req.validator_id, req.public_key, req.name, "validator", req.stake, raw)
    with t.db.transaction() as c:
        c.execute(
            "UPDATE peers SET state = 'live', last_seen = ? WHERE peer_id = ?",
            (time.time(), req.validator_id),
        )
    return {
        "ok": True,
        "heartbeat_s": t.spec.heartbeat_s,
        "dead_after_s": t.spec.dead_after_s,
        "verify_device": t.spec.verify_device,  # the class its checks must run on (issue 12)
    }


def serve(trainer: Trainer, host: str, port: int) -> None:
    """Run until SIGINT/SIGTERM, then stop the learning loop and close the database."""
    import uvicorn

    config = uvicorn.Config(
        create_app(trainer),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    trainer.start()
    try:
        server.run()
    finally:
        trainer.stop()
        signal.signal(signal.SIGTERM, previous)
