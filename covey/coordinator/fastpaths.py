"""The two requests every peer sends every few seconds, answered without FastAPI's routing.

At 1000 peers a coordinator answers about 500 heartbeats and 500 `/v1/round` polls a
second. Through FastAPI each costs its dependency solving, its response-model validation
and serialization and a few exception-handling layers: most of a request's CPU, measured
(BENCHMARKS: `covey bench coordinator`). `FastPaths` is a raw
ASGI layer just inside the app's own middlewares (rate limits, body limits and deadlines,
the endpoint tag signatures are checked against, metrics: all still apply) that answers
exactly `POST /v1/heartbeat` and `GET /v1/round` (with its long-poll, `hold_round_poll`)
itself and passes everything else on.

It does what the FastAPI routes would, in the same words: the body is validated by the
same pydantic model (a refusal is the same 422 with the same `problems`), the query by
the same pattern, and the same service methods answer; the routes stay declared in the
app, so /openapi.json is unchanged. The service call runs on the event loop when the
database is free, in the thread pool when a writer holds it (as `_inline_or_thread`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import parse_qs

import anyio
import anyio.to_thread
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from covey.protocol import schemas
from covey.trust.polls import ROUND_POLL

from .pg import DatabaseUnavailable
from .rejected import Rejected

FAST_PATH_THREADS = 16  # on PostgreSQL: heartbeats and round polls in flight at once

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .limits import LongPolls
    from .service import Coordinator

log = logging.getLogger("covey.coordinator")
_PEER_ID = re.compile(schemas.PEER_ID_PATTERN)
_JSON = [(b"content-type", b"application/json")]


class _Route:
    """What covey.coordinator.metrics.route_label reads of a matched route."""

    def __init__(self, path: str) -> None:
        self.path = path


_HEARTBEAT, _ROUND = _Route("/v1/heartbeat"), _Route("/v1/round")
MAX_ROUND_WAIT_S = 30.0
_WAIT = TypeAdapter(Annotated[float, Field(ge=0, le=MAX_ROUND_WAIT_S)])
_AFTER = TypeAdapter(Annotated[str, Field(max_length=64)])


class ClientGone(Exception):
    """The client disconnected while its long-poll was held: nothing is sent."""


async def unless_gone(waiting: Awaitable[Any], receive: Receive | None) -> Any:
    """`waiting`'s result, or ClientGone as soon as the client disconnects (read from
    `receive`, whose body, if any, is already in): a held long-poll gives its slot back
    when its connection drops, not when its `wait` runs out."""
    if receive is None:
        return await waiting

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(waiting), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


async def hold_round_poll(
    coord: Coordinator,
    long_polls: LongPolls,
    headers: Mapping[str, str],
    client: str,
    after: str,
    wait_s: float,
    peer_id: str | None,
    receive: Receive | None = None,
) -> None:
    """The round long-poll: return once the view past tag `after` has news for `peer_id`
    (a round it is a member of opened, the run finished or halted: Views.round_news) or
    about `wait_s` passed (0.75-1x, at random), holding no thread meanwhile. Held polls
    count against the peer that signed the poll (covey.trust.polls, purpose ROUND_POLL)
    or, unsigned, against the client address (16 peers' share), like the certificate's;
    past that, Rejected(429). Past the total (limits.max_long_polls) the poll is answered
    at once, as a plain poll: a run with more peers than slots degrades to polling. With
    `receive`, ClientGone when the client disconnects while held (its slot freed)."""
    if coord.round_news(after, peer_id):
        return
    signer = coord.membership.poll_signer(headers, -1, ROUND_POLL)
    key, share = (f"peer:{signer}", None) if signer else (f"address:{client}", 16)
    with long_polls.hold(key, None if share is None else share * long_polls.per_key) as ok:
        if not ok and long_polls.held() >= long_polls.total:
            return  # every slot taken (more peers than max_long_polls): a plain poll
        if not ok:
            raise Rejected(429, f"too many long-polls held for {key[:40]}: retry shortly")
        # held a little less than asked, at random: polls woken together by one round
        # do not all time out, and come back, together ever after
        held_s = wait_s * random.uniform(0.75, 1.0)
        news = coord.commits.wait(lambda: coord.round_news(after, peer_id), held_s)
        await unless_gone(news, receive)  # ClientGone: the slot is back at once


class FastPaths:
    """ASGI middleware: heartbeats and round polls answered directly (see the module)."""

    def __init__(self, app: ASGIApp, coord: Coordinator, long_polls: LongPolls) -> None:
        self.app, self.coord, self.long_polls = app, coord, long_polls
        self._own_threads: Any = None  # PostgreSQL: threads of their own (see _answer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            if method == "POST" and path == "/v1/heartbeat":
                scope["route"] = _HEARTBEAT  # the metrics' route label, as routing sets it
                await self._heartbeat(scope, receive, send)
                return
            if method == "GET" and path == "/v1/round":
                scope["route"] = _ROUND
                await self._round(scope, receive, send)
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

    async def _round(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        peer_id = query.get("peer_id", [None])[-1]
        if peer_id is not None and not _PEER_ID.match(peer_id):
            await _invalid(
                send, [f"query.peer_id: String should match pattern '{schemas.PEER_ID_PATTERN}'"]
            )
            return
        problems, wait_s, after = [], 0.0, None
        try:
            wait_s = _WAIT.validate_python(query.get("wait", ["0"])[-1], strict=False)
        except ValidationError as e:
            problems += _problems(e, "query.wait")
        try:
            after = _AFTER.validate_python(query["after"][-1]) if "after" in query else None
        except ValidationError as e:
            problems += _problems(e, "query.after")
        if problems:
            await _invalid(send, problems)
            return
        if wait_s > 0 and after is not None:
            client = scope.get("client") or ("-", 0)
            try:
                await hold_round_poll(
                    self.coord,
                    self.long_polls,
                    Headers(scope=scope),
                    client[0],
                    after,
                    wait_s,
                    peer_id or None,
                    receive,
                )
            except ClientGone:
                return  # nobody to answer
            except Rejected as e:
                log.warning("fast path -> %d: %s", e.status, e.message)
                retry = [(b"retry-after", b"1")] if e.status == 429 else []
                await _send_json(send, e.status, {"error": e.message}, retry)
                return
        await self._answer(send, self.coord.round_info, peer_id)

    async def _answer(self, send: Send, fn: Callable[..., Any], *args: Any) -> None:
        """Call the service (inline when the database is free and in this process: on
        PostgreSQL a query is a round trip that must not hold up the event loop) and send
        its answer, or the refusal it raised, as the app's exception handlers would."""
        lock = self.coord.db.lock
        try:
            if self.coord.db.is_postgres:
                # threads no join or submission waiting for the write lock can take, or a
                # herd of joins would starve heartbeats until their peers count as dead
                if self._own_threads is None:
                    self._own_threads = anyio.CapacityLimiter(FAST_PATH_THREADS)
                result = await anyio.to_thread.run_sync(
                    functools.partial(fn, *args), limiter=self._own_threads
                )
            elif lock.acquire(blocking=False):
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
        except DatabaseUnavailable as e:  # as covey.coordinator.host_app answers it
            log.warning("fast path -> 503: %s", e)
            message = f"the run's database is unavailable now, retry shortly: {e}"
            await _send_json(send, 503, {"error": message}, [(b"retry-after", b"1")])
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
