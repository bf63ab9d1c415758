"""What a request may cost the coordinator: per-peer and per-address rate limits (token
buckets, 429 with Retry-After), bounded long-polls, the `RateLimit` ASGI middleware, and
`header_deadline_protocol`: uvicorn's HTTP/1.1 protocol with a deadline on request headers.

Buckets are charged before a request runs. The peer bucket is keyed by the peer id a
request names (JSON `peer_id`/`validator_id`, or the signed upload header) and refunded
when the request turns out not to be that peer's (401/403/404): a stranger naming a
victim's id spends the victim's budget only for the instant its forgery takes to refuse,
and its own address bucket pays in full. All state is in memory: a restart forgets it.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # httptools parses HTTP in C: about a third less CPU a request than h11 (BENCHMARKS.md)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Http
except ImportError:  # pragma: no cover - httptools is a dependency; h11 is uvicorn's own
    _Http = H11Protocol  # type: ignore[assignment,misc]

from covey.blobs.store import UPLOAD_PEER_HEADER

if TYPE_CHECKING:
    from covey.config import LimitsConfig

_MAX_KEYS = 10_000  # buckets kept; beyond this, full (idle) ones are forgotten
_NOT_THEIRS = frozenset({401, 403, 404})  # the request was refused as not this peer's
# the rounds mode's paths that register a new key (which writes the ledger)
JOINS = frozenset({"/v1/join", "/v1/validators/join"})


class TokenBuckets:
    """One token bucket per key: `burst` tokens, refilled at `rate` per second. The clock
    is an argument, so the arithmetic is tested without sleeping. Thread-safe."""

    def __init__(self, rate: float, burst: int) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"need rate ({rate}) > 0 and burst ({burst}) >= 1")
        self.rate, self.burst = rate, float(burst)
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str, now: float) -> float:
        """Take one token for `key`: 0.0 if there was one, else the seconds until there
        will be (nothing taken)."""
        with self._lock:
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now)
                return (1.0 - tokens) / self.rate
            self._buckets[key] = (tokens - 1.0, now)
            if len(self._buckets) > _MAX_KEYS:
                self._forget_idle(now)
            return 0.0

    def give_back(self, key: str) -> None:
        """Return a token taken for a request that turned out not to be `key`'s."""
        with self._lock:
            if key in self._buckets:
                tokens, at = self._buckets[key]
                self._buckets[key] = (min(self.burst, tokens + 1.0), at)

    def _forget_idle(self, now: float) -> None:
        full = [
            k for k, (t, at) in self._buckets.items() if t + (now - at) * self.rate >= self.burst
        ]
        for k in full:
            del self._buckets[k]


class LongPolls:
    """Counts the long-polls held at once, in total and per key. Thread-safe."""

    def __init__(self, total: int, per_key: int) -> None:
        self.total, self.per_key = total, per_key
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def held(self) -> int:
        """Long-polls held right now, over every key."""
        with self._lock:
            return sum(self._held.values())

    @contextmanager
    def hold(self, key: str, per_key: int | None = None) -> Iterator[bool]:
        """Yields True with a slot held until the block ends, or False (nothing held) when
        the total or this key's share (`per_key`, default `self.per_key`) is taken."""
        cap = self.per_key if per_key is None else per_key
        with self._lock:
            ok = sum(self._held.values()) < self.total and self._held.get(key, 0) < cap
            if ok:
                self._held[key] = self._held.get(key, 0) + 1
        try:
            yield ok
        finally:
            if ok:
                with self._lock:
                    self._held[key] -= 1
                    if not self._held[key]:
                        del self._held[key]


class RateLimit:
    """ASGI middleware: every HTTP request takes a token from its client address's bucket
    and, when it names a peer, from that peer's; a join also from its address's (much
    smaller) join bucket, since every new key costs signed ledger entries. An empty bucket
    is a 429 with Retry-After and the handler never runs. JSON bodies (already bounded by
    BodyLimit) are read here to find the peer id, then handed to the app unchanged."""

    def __init__(self, app: ASGIApp, limits: LimitsConfig, joins: frozenset[str] = JOINS) -> None:
        """`joins`: the paths that register a new key in this mode (JOINS for rounds)."""
        self.app, self.joins_at = app, joins
        self.peers = TokenBuckets(limits.peer_rate, limits.peer_burst)
        self.addresses = TokenBuckets(limits.address_rate, limits.address_burst)
        self.joins = TokenBuckets(limits.join_rate, limits.join_burst)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        address = client[0] if client else "-"
        wait = self.addresses.take(address, time.monotonic())
        if wait:
            await _too_many(scope, send, f"client address {address}", wait)
            return
        if scope["method"] == "POST" and scope["path"] in self.joins_at:
            wait = self.joins.take(address, time.monotonic())
            if wait:
                await _too_many(scope, send, f"client address {address} (joins)", wait)
                return
        peer, receive = await _peer_of(scope, receive)
        if peer is None:
            await self.app(scope, receive, send)
            return
        wait = self.peers.take(peer, time.monotonic())
        if wait:
            await _too_many(scope, send, f"peer {peer[:12]}", wait)
            return
        status = 0

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            if status in _NOT_THEIRS:
                self.peers.give_back(peer)


async def _peer_of(scope: Scope, receive: Receive) -> tuple[str | None, Receive]:
    """The peer id a request names, and a receive that replays whatever was read."""
    headers = dict(scope["headers"])
    named = headers.get(UPLOAD_PEER_HEADER.lower().encode())
    if named is not None:
        return named.decode("latin-1")[:64], receive
    if scope["method"] != "POST" or b"json" not in headers.get(b"content-type", b""):
        return None, receive
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None, _replay([message], receive)
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    peer = None
    try:
        value = json.loads(body)
        scope["covey.json"] = (body, value)  # parsed once: the fast paths reuse it
        if isinstance(value, dict):
            named_id = value.get("peer_id") or value.get("validator_id")
            peer = named_id[:64] if isinstance(named_id, str) else None
    except ValueError:
        pass  # the handler refuses malformed JSON with its own message
    return peer, _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed


async def _too_many(scope: Scope, send: Send, who: str, wait_s: float) -> None:
    retry = max(1, math.ceil(wait_s))
    response = JSONResponse(
        {"error": f"too many requests from {who}: retry in {retry} s"},
        429,
        headers={"Retry-After": str(retry)},
    )
    await response(scope, _disconnected, send)


async def _disconnected() -> Message:
    return {"type": "http.disconnect"}


def header_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools, else h11), but a connection whose next request's
    headers are not all in within `timeout_s` of its first byte (or of the connection, for
    the first request) is closed. uvicorn has no such limit: its keep-alive timeout stops
    at the first byte, so a client sending a header byte now and then (slowloris) would
    hold a connection, and enough of them every connection slot, forever. Bodies have
    their own deadline (host_app.BodyLimit)."""

    class HeaderDeadline(_Http):  # type: ignore[valid-type,misc]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._arm()  # the first bytes of a request: its headers are now due
            super().data_received(data)
            if not self._between_requests():
                self._disarm()  # the headers are in: the request runs

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self._between_requests() and not self.transport.is_closing():
                self.logger.warning(
                    "closed %s: request headers not in within %.0f s", self.client, timeout_s
                )
                self.transport.close()

    return HeaderDeadline
