"""The HTTP parts of the coordinator's host, the same in every mode (rounds: covey.
coordinator.app; RL: covey.rl.service; SWARM: covey.swarm.app): each mode's app calls
`handle_errors` first, adds its own routes beside `host_routes` (/healthz, /metrics, POST
/v1/halt), then `host_middleware` (rate limits, body limits, the endpoint signatures are
checked against, HTTP metrics) and is served by `serve_app`.

Every refusal is a 4xx with a JSON body {"error": "..."}; a refused request changes
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from covey.protocol import schemas
from covey.trust.halt import HALT_PATH
from covey.trust.treasury import DEPOSIT_PATH

from .apidocs import install as install_docs
from .auth import ReceivedAt
from .limits import JOINS, RateLimit, header_deadline_protocol
from .metrics import CONTENT_TYPE, HttpMetrics, Metrics
from .openapi import errors
from .pg import DatabaseUnavailable
from .rejected import Rejected
from .treasury import Deposits

if TYPE_CHECKING:
    from covey.config import LimitsConfig

    from .accounts import Accounts
    from .halt import Halt

log = logging.getLogger("covey.coordinator")

# the status pages' frame, served by every mode at /frame.js (covey/dashboard/static)
FRAME_JS = (resources.files("covey.dashboard") / "static" / "frame.js").read_bytes()


def handle_errors(app: FastAPI, logger: logging.Logger) -> None:
    """`Rejected` -> its status with {"error"}, logged to `logger` (a 404 at debug: "not
    yet" is a normal answer to polling); HTTP errors and 422s the same way, a 422 naming
    each field's problem; the database server away (`DatabaseUnavailable`) -> 503 with
    Retry-After."""

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, exc: Rejected) -> JSONResponse:
        level = logging.DEBUG if exc.status == 404 else logging.WARNING
        logger.log(
            level, "%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message
        )
        retry = {"Retry-After": "1"} if exc.status == 429 else None  # busy, not refused
        return JSONResponse({"error": exc.message}, exc.status, headers=retry)

    @app.exception_handler(DatabaseUnavailable)
    async def _unavailable(request: Request, exc: DatabaseUnavailable) -> JSONResponse:
        # the database server is away (covey.coordinator.pg): nothing was written; retry
        logger.warning("%s %s -> 503: %s", request.method, request.url.path, exc)
        return JSONResponse(
            {"error": f"the run's database is unavailable now, retry shortly: {exc}"},
            503,
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()
        ]
        logger.warning(
            "%s %s -> 422: %s", request.method, request.url.path, "; ".join(problems[:5])
        )
        return JSONResponse({"error": "invalid request", "problems": problems[:50]}, 422)


def host_routes(app: FastAPI, metrics: Metrics, halt: Halt, accounts: Accounts) -> None:
    """GET /healthz, GET /metrics, POST /v1/halt, POST /v1/ledger/deposit (the owner's
    deposits to keys: covey.coordinator.treasury), the status pages' frame (/frame.js, fed
    by GET /v1/host), the ledger (GET /v1/ledger,
    /v1/ledger/balances: what `covey ledger verify URL` reads; /v1/ledger/head: its signed
    head) and /docs (rendered on the
    server from the app's OpenAPI document, no CDN: covey.coordinator.apidocs) on `app`.
    Each mode answers GET /v1/run itself with at least RUN_KEYS (covey.errors: run id,
    mode, coordinator key, spec), which is how `covey halt` and the peers know a covey
    coordinator."""
    install_docs(app)  # built on the first request, so the mode's later routes are listed

    @app.get("/healthz", tags=["operations"])
    def healthz() -> dict[str, Any]:
        """Liveness: the process answers HTTP. No auth and no database read."""
        return {"ok": True}

    @app.get(
        "/metrics",
        tags=["operations"],
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    def prometheus() -> Response:
        """Prometheus text format: the mode's run (rounds, batches, stages...), live peers,
        ledger height, request latencies by route."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post(HALT_PATH, responses=errors(503), tags=["operations"])
    async def halt_run(req: schemas.HaltRequest, request: Request) -> dict[str, Any]:
        """The run owner stops the run (`covey halt`): a signed HALT goes into the ledger,
        the mode stops (no round opens, no policy step, no payout) and every join and
        heartbeat is answered 410 with the owner's reason. GETs keep being answered."""
        return await run_in_threadpool(halt.request, req, await request.json())

    deposits = Deposits(accounts, halt)

    @app.post(DEPOSIT_PATH, tags=["operations"])
    async def deposit(req: schemas.DepositRequest, request: Request) -> dict[str, Any]:
        """The run owner credits a key from the run's treasury (`covey ledger deposit`): a
        signed "deposit" entry; a key stakes only what it holds (docs/trust.md). The
        reply is the key's held balance and the ledger's signed head."""
        return await run_in_threadpool(deposits.deposit, req, await request.json())

    @app.get("/v1/host", tags=["operations"])
    def host_view() -> dict[str, Any]:
        """What every mode's status page shows in its frame (`/frame.js`): the run id,
        the owner's HALT if there is one, the ledger's length and head, live peers by
        role."""
        return {
            "run_id": halt.run_id,
            "halted": halt.halted,
            "ledger": _head_or_none(accounts),
            "live": metrics.host.live_by_role(),
        }

    @app.get("/frame.js", include_in_schema=False)
    def frame_js() -> Response:
        """The status pages' shared frame: a bar with the run, mode, halt, ledger and live
        peers, and links to /docs, /metrics and the ledger (covey/dashboard/static)."""
        return Response(FRAME_JS, media_type="text/javascript")

    @app.get("/v1/ledger")
    def ledger_entries(
        start: int = Query(0, ge=0, le=schemas.MAX_INT), limit: int = Query(1000, ge=1, le=5000)
    ) -> list[dict[str, Any]]:
        """Ledger entries from `start`, each with its hash and the coordinator's signature."""
        return accounts.entries(start, limit)

    @app.get("/v1/ledger/head")
    def ledger_head() -> schemas.LedgerHead:
        """The ledger's current head (run id, length, last entry's hash), signed by the
        coordinator's key (covey.trust.heads): `covey ledger verify --heads URL` refuses
        a copy of the ledger shorter than it or different at its length."""
        return schemas.LedgerHead(**accounts.head())

    @app.get("/v1/ledger/balances")
    def ledger_balances() -> dict[str, Any]:
        """Balances, stakes, reputation and ownership as the coordinator's book has them
        (`covey ledger verify URL` recomputes them from the entries)."""
        return accounts.book.summary()


def _head_or_none(accounts: Accounts) -> dict[str, Any] | None:
    try:
        head = accounts.head()
    except RuntimeError:  # no entry yet
        return None
    return {"length": head["length"], "hash": head["hash"]}


def host_middleware(
    app: FastAPI,
    metrics: Metrics,
    limits: LimitsConfig,
    *,
    json_limit: int,
    joins: frozenset[str] = JOINS,
) -> None:
    """The host's middleware around whatever the mode added before: per-peer and
    per-address rate limits (`joins`: the paths that register a new key), the body-size
    and body-deadline limit (`json_limit` for JSON, limits.max_blob_bytes for blobs), the
    endpoint a signature is checked against, and HTTP metrics outermost (they also count
    the 413s and 429s)."""
    app.add_middleware(RateLimit, limits=limits, joins=joins)  # inside BodyLimit: bounded
    app.add_middleware(
        BodyLimit,
        json_limit=json_limit,
        blob_limit=limits.max_blob_bytes,
        body_timeout_s=limits.body_timeout_s,
        min_bytes_s=limits.min_upload_bytes_s,
    )
    app.add_middleware(ReceivedAt)  # signatures are checked against the endpoint
    app.add_middleware(HttpMetrics, metrics=metrics)  # last added is outermost


def serve_app(
    app: FastAPI,
    host: str,
    port: int,
    limits: LimitsConfig,
    start: Callable[[], None],
    stop: Callable[[], None],
) -> None:
    """Serve `app` until SIGINT/SIGTERM (uvicorn's graceful shutdown) with the host's
    connection limits: idle connections close after limits.keep_alive_s, slow request
    headers are cut off, past limits.max_connections a 503. `start()` runs just before
    serving (the mode's driver), `stop()` once it is over."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=int(max(1, limits.keep_alive_s)),
        http=header_deadline_protocol(limits.body_timeout_s),
        limit_concurrency=limits.max_connections,
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; with the default
    # SIGTERM action that would kill the process before the driver is stopped below
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    start()
    try:
        server.run()
    finally:
        stop()
        signal.signal(signal.SIGTERM, previous)


class BodyLimit:
    """Refuse request bodies over the configured size with 413 before a handler reads
    them (by Content-Length when given, else by counting the streamed bytes), and cut off
    a slow sender: the whole body must arrive within `body_timeout_s` plus its declared
    length at `min_bytes_s`, else 408 and the connection is closed."""

    def __init__(
        self,
        app: ASGIApp,
        json_limit: int,
        blob_limit: int,
        body_timeout_s: float = 10.0,
        min_bytes_s: int = 64 << 10,
    ) -> None:
        self.app, self.json_limit, self.blob_limit = app, json_limit, blob_limit
        self.body_timeout_s, self.min_bytes_s = body_timeout_s, min_bytes_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        blob = scope["path"].startswith("/v1/blobs/")
        limit = self.blob_limit if blob else self.json_limit
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _too_large(scope, send, limit)
            return
        loop = asyncio.get_running_loop()
        declared = int(length) if length is not None else 0
        deadline = loop.time() + self.body_timeout_s + declared / self.min_bytes_s
        seen, complete = 0, False

        async def counted() -> Message:
            nonlocal seen, complete
            if complete:  # the body is in: later reads wait for a disconnect, unbounded
                return await receive()
            try:
                message = await _within(receive(), deadline)
            except TimeoutError:
                raise _TooSlow(seen) from None
            seen += len(message.get("body", b""))
            complete = message["type"] != "http.request" or not message.get("more_body")
            if seen > limit:
                raise _TooLarge(limit)
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await _too_large(scope, send, limit)
        except _TooSlow as e:
            log.warning("cut off %s %s: %s", scope["method"], scope["path"], e)
            response = JSONResponse({"error": f"request body too slow: {e}"}, 408)
            # if a response had started, the server closes the connection anyway
            with contextlib.suppress(RuntimeError):
                await response(scope, _no_receive, send)


async def _within(awaitable: Any, deadline: float) -> Message:
    """`awaitable`'s result, or TimeoutError at loop time `deadline`. asyncio.timeout_at
    (3.11) arms a timer; wait_for (3.10) makes a task per call, a measurable share of a
    small request's cost at a thousand peers."""
    timeout_at = getattr(asyncio, "timeout_at", None)
    if timeout_at is None:
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(awaitable, max(0.0, deadline - loop.time()))
    async with timeout_at(deadline):
        return await awaitable


class _TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"body over {limit} bytes")


class _TooSlow(Exception):
    def __init__(self, seen: int) -> None:
        super().__init__(f"only {seen} bytes of the body arrived before its deadline")


async def _too_large(scope: Scope, send: Send, limit: int) -> None:
    log.warning("refused %s %s: body over %d bytes", scope["method"], scope["path"], limit)
    response = JSONResponse({"error": f"request body over the limit of {limit} bytes"}, 413)
    await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
