"""The two requests every peer sends every few seconds, answered without FastAPI's routing.

At 1000 peers a coordinator answers about 500 heartbeats and 500 `/v1/round` polls a
second. Through FastAPI each costs its dependency solving, its response-model validation
and serialization and a few exception-handling layers: most of a request's CPU, measured
(BENCHMARKS: `covey bench coordinator`; /work/notes/s2/bench/T1.md). `FastPaths` is a raw
ASGI layer just inside the app's own middlewares (rate limits, body limits and deadlines,
the endpoint tag signatures are checked against, metrics: all still apply) that answers
exactly `POST /v1/heartbeat` and `GET /v1/round` itself and passes everything else on.

It does what the FastAPI routes would, in the same words: the body is validated by the
same pydantic model (a refusal is the same 422 with the same `problems`), the query by
the same pattern, and the same service methods answer; the routes stay declared in the
app, so /openapi.json is unchanged. The service call runs on the event loop when the
database is free, in the thread pool when a writer holds it (as `_inline_or_thread`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from covey.protocol import schemas

from .views import Rejected

if TYPE_CHECKING:
    from .service import Coordinator

log = logging.getLogger("covey.coordinator")
_PEER_ID = re.compile(schemas.PEER_ID_PATTERN)
_JSON = [(b"content-type", b"application/json")]


class _Route:
    """What covey.coordinator.metrics.route_label reads of a matched route."""

    def __init__(self, path: str) -> None:
        self.path = path


_HEARTBEAT, _ROUND = _Route("/v1/heartbeat"), _Route("/v1/round")


class FastPaths:
    """ASGI middleware: heartbeats and round polls answered directly (see the module)."""

    def __init__(self, app: ASGIApp, coord: Coordinator) -> None:
        self.app, self.coord = app, coord

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            if method == "POST" and path == "/v1/heartbeat":
                scope["route"] = _HEARTBEAT  # the metrics' route label, as routing sets it
                await self._heartbeat(scope, receive, send)
                return
            if method == "GET" and path == "/v1/round":
                scope["route"] = _ROUND
                await self._round(scope, send)
                return
        await self.app(scope, receive, send)

    async def _heartbeat(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        parsed = scope.get("covey.json")  # RateLimit parsed it to find the peer: reuse
        try:
            raw = parsed[1] if parsed is not None and parsed[0] == body else json.loads(body)
        except json.JSONDecodeError as e:  # FastAPI's words for a body that is not JSON
            await _invalid(send, [f"body.{e.pos}: JSON decode error"])
            return
        except (ValueError, RecursionError):  # not UTF-8, or nested too deep: as FastAPI
            await _send_json(send, 400, {"error": "There was an error parsing the body"})
            return
        try:
            req = schemas.HeartbeatRequest.model_validate(raw)
        except ValidationError as e:
            await _invalid(send, _problems(e, "body"))
            return
        await self._answer(send, self.coord.heartbeat, req, raw)

    async def _round(self, scope: Scope, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        peer_id = query.get("peer_id", [None])[-1]
        if peer_id is not None and not _PEER_ID.match(peer_id):
            await _invalid(
                send, [f"query.peer_id: String should match pattern '{schemas.PEER_ID_PATTERN}'"]
            )
            return
        await self._answer(send, self.coord.round_info, peer_id)

    async def _answer(self, send: Send, fn: Callable[..., Any], *args: Any) -> None:
        """Call the service (inline when the database is free) and send its answer, or
        the refusal it raised, as the app's exception handlers would."""
        lock = self.coord.db.lock
        try:
            if lock.acquire(blocking=False):
                try:
                    result = fn(*args)
                finally:
                    lock.release()
            else:
                result = await run_in_threadpool(fn, *args)
        except Rejected as e:
            level = logging.DEBUG if e.status == 404 else logging.WARNING
            log.log(level, "fast path -> %d: %s", e.status, e.message)
            retry = [(b"retry-after", b"1")] if e.status == 429 else []
            await _send_json(send, e.status, {"error": e.message}, retry)
            return
        if isinstance(result, BaseModel):
            await _send(send, 200, result.model_dump_json().encode())
        else:
            await _send_json(send, 200, result)


async def _read_body(receive: Receive) -> bytes:
    """The whole request body (bounded and deadlined by BodyLimit outside this layer)."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _problems(e: ValidationError, where: str) -> list[str]:
    """The app's 422 `problems`, as FastAPI's RequestValidationError handler words them."""
    out = []
    for err in e.errors():
        loc = ".".join(str(x) for x in (where, *err.get("loc", ())))
        out.append(f"{loc}: {err.get('msg')}")
    return out


async def _invalid(send: Send, problems: list[str]) -> None:
    log.warning("fast path -> 422: %s", "; ".join(problems))
    await _send_json(send, 422, {"error": "invalid request", "problems": problems})


async def _send_json(
    send: Send, status: int, value: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    await _send(send, status, body, headers)


async def _send(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    head = [*_JSON, (b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
