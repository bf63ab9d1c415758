"""Coordinator replicas that all serve (`--replica` on every mode; docs/scale-out.md).

Every replica of a run listens from the start. The one holding the run's lease
(covey.coordinator.lease) serves the mode's own app and drives the run; every other one
serves a *follower* app:

- reads that the database and the bucket answer (the ledger and its head and balances,
  blobs by presigned URL, /metrics, /v1/host, and the mode's own read routes: the rounds
  mode's status, certificates, checkpoints and receipts) are answered by the follower
  itself, from the shared database (its book of the ledger and its view of the canonical
  state refreshed every `REFRESH_S`);
- everything else, every signed write (joins, heartbeats, contributions, uploads, reports,
  a HALT) and every read that the leader's memory answers (a round's long-poll, the
  assignment view), is relayed to the leader named in the lease row, its body and headers
  byte for byte: a signature covers the body exactly as sent and names the endpoint, which
  is the same path on the leader, so the leader checks it as if the peer had come to it.

Why forward writes rather than write to the shared database from every replica: a write
in covey changes more than rows (membership keeps heartbeats and nonces in memory, the
round driver is woken by a contribution, intake checks a contribution against the open
round's cached members), so two writers would need every write path made safe across
processes. One writer keeps the lease's fence (every writing transaction of the leader
checks it still holds the lease) the only rule, and a follower cannot write at all: its
database's fence refuses every transaction. The cost is one more hop for writes.

While no replica holds the lease (a leader died and its lease has not expired yet), a
follower answers what it would forward with 503 and Retry-After: peers retry 5xx with
backoff (covey.peer.client), so nothing is lost across a takeover.

The switch from follower to leader happens in the same process and on the same port
(`Switch`): the lease is won, the mode is built from the database as a restarted
coordinator builds it, and the server's app is swapped under the open connections.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .lease import leader

if TYPE_CHECKING:
    import httpx

    from .db import Database

log = logging.getLogger("covey.coordinator")

LEASE_TTL_S = 4.0  # a replica's lease: a dead leader is replaced within this and a start-up
REFRESH_S = 0.5  # a follower's book of the ledger and its view of the state, at most this old
LEADER_CACHE_S = 0.5  # how long a follower trusts its last look at the lease row
RELAY_CONNECTIONS = 2048  # a follower's connections to the leader, long-polls included
# hop-by-hop headers (RFC 9110 7.6.1) and the ones the relay sets itself
_HOP = {
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
    b"upgrade", b"host",
}  # fmt: skip


class NotLeader(RuntimeError):
    """A follower's database refuses to write: only the lease holder writes."""


def refuse_writes(_conn: Any) -> None:
    """The fence of a follower's database: any writing transaction is rolled back."""
    raise NotLeader("this replica does not hold the run's lease: it does not write")


async def _reply(send: Send, status: int, body: dict[str, Any], retry: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if retry:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class Switch:
    """The ASGI app a replica's server runs: the follower's app until `to(leader_app)`,
    then the leader's, for every request from then on (the server and its port stay).
    Lifespan events are answered here: the apps have no start-up of their own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def to(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await self.app(scope, receive, send)


class Leader:
    """Where the lease holder serves, read from the lease row at most every
    LEADER_CACHE_S; None while nobody holds it or when it is this replica itself (a
    takeover under way: the switch is moments away)."""

    def __init__(self, db: Database, own_url: str) -> None:
        self.db, self.own_url = db, own_url.rstrip("/")
        self._cached: tuple[float, str | None] = (0.0, None)
        self._lock = threading.Lock()

    def url(self) -> str | None:
        with self._lock:
            at, url = self._cached
            if time.monotonic() - at < LEADER_CACHE_S:
                return url
            held = leader(self.db)
            url = None if held is None or not held[1] else str(held[1]).rstrip("/")
            url = None if url == self.own_url else url
            self._cached = (time.monotonic(), url)
            return url

    def forget(self) -> None:
        """The leader did not answer: look at the lease row again on the next request."""
        with self._lock:
            self._cached = (0.0, None)


class ForwardRest:
    """ASGI middleware of a follower's app: a GET or HEAD that one of the app's own routes
    matches (and that is no long-poll: a `wait` the leader's commit signal ends) is
    answered here; every other request is relayed to the leader, streamed both ways."""

    def __init__(self, app: ASGIApp, leader: Leader, timeout_s: float) -> None:
        import httpx

        self.app, self.leader = app, leader
        # a long-poll is held up to 30 s (covey.coordinator.fastpaths, the certificate's),
        # and every peer that polls through this follower holds a connection to the leader
        self.client: httpx.AsyncClient = httpx.AsyncClient(
            timeout=httpx.Timeout(max(timeout_s, 40.0), connect=2.0, pool=5.0),
            limits=httpx.Limits(max_connections=RELAY_CONNECTIONS, max_keepalive_connections=64),
            follow_redirects=False,
            trust_env=False,  # the leader's address is the lease row's, never a proxy's
        )

    def _local(self, scope: Scope) -> bool:
        if scope["method"] not in ("GET", "HEAD"):
            return False
        query = scope.get("query_string", b"").decode("latin-1")
        for part in query.split("&"):
            name, _, value = part.partition("=")
            if name == "wait" and value not in ("", "0", "0.0"):
                return False
        router = scope["app"].router
        return any(route.matches(scope)[0] == Match.FULL for route in router.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._local(scope):
            await self.app(scope, receive, send)
            return
        await self.forward(scope, receive, send)

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        import httpx

        try:
            target = await run_in_threadpool(self.leader.url)
        except sqlite3.Error:  # the database away: nobody can be named the leader now
            target = None
        if target is None:
            await _reply(
                send, 503, {"error": "no replica holds the run's lease now (a takeover is "
                            "under way): retry in a moment"}, retry=True,
            )  # fmt: skip
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        client = scope.get("client")
        if client:
            headers.append((b"x-forwarded-for", str(client[0]).encode()))
        path = scope.get("raw_path") or scope["path"].encode()
        url = target + path.decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")

        async def body() -> AsyncIterator[bytes]:
            while True:
                message: Message = await receive()
                if message["type"] == "http.disconnect":
                    return
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return

        has_body = any(k.lower() == b"content-length" for k, _ in headers) or any(
            k.lower() == b"transfer-encoding" for k, _ in scope["headers"]
        )
        request = self.client.build_request(
            scope["method"], url, headers=headers, content=body() if has_body else None
        )
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as e:
            self.leader.forget()
            log.warning("the leader at %s did not answer %s %s: %s", target, scope["method"],
                        scope["path"], e)  # fmt: skip
            await _reply(
                send, 503, {"error": f"the run's leader did not answer ({type(e).__name__}): "
                            "retry in a moment"}, retry=True,
            )  # fmt: skip
            return
        try:
            out = [
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in response.headers.multi_items()
                if k.lower().encode() not in _HOP
            ]
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": out})  # fmt: skip
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except (httpx.TransportError, asyncio.CancelledError, OSError):
            self.leader.forget()
            raise
        finally:
            await response.aclose()


class Refresher:
    """A follower's thread calling each of `refreshes` every REFRESH_S until `stop`
    (what it keeps of the database in memory: the ledger's book, the canonical state);
    a failed refresh is logged and tried again on the next turn."""

    def __init__(self, refreshes: list[Callable[[], None]], stop: threading.Event) -> None:
        self.refreshes, self.stop = refreshes, stop
        self.refresh_all()
        threading.Thread(target=self._run, name="replica-refresh", daemon=True).start()

    def refresh_all(self) -> None:
        for refresh in self.refreshes:
            try:
                refresh()
            except Exception as e:  # the database away for a moment: the next turn
                log.warning("a follower's refresh failed: %s", e)

    def _run(self) -> None:
        while not self.stop.wait(REFRESH_S):
            self.refresh_all()


def holder_of(port: int) -> str:
    """How a replica names itself in the lease row: host:port:pid."""
    import os
    import socket

    return f"{socket.gethostname()}:{port}:{os.getpid()}"


def url_of(host: str, port: int) -> str:
    """Where the other replicas reach this one (the lease row's url)."""
    import socket

    reach = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"http://{reach}:{port}"


def exit_on_lost(holder: str) -> Callable[[], None]:
    """What a replica does when it cannot keep the run's lease: exit (code 3) at once, no
    more writes from here; its supervisor starts it again as a follower."""
    import os
    import sys

    def lost() -> None:
        print(f"replica {holder}: lost the run's lease; exiting", file=sys.stderr, flush=True)
        os._exit(3)

    return lost


# the mode's app over its fenced database: (app, start its driver, stop it)
LeaderParts = tuple[ASGIApp, Callable[[], None], Callable[[], None]]


def serve_replica(
    *,
    db_url: str,
    holder: str,
    own_url: str,
    host: str,
    port: int,
    limits: Any,
    build_follower: Callable[[], Any],
    build_leader: Callable[[Callable[[Any], None]], LeaderParts],
    on_lost: Callable[[], None],
    ttl_s: float = LEASE_TTL_S,
) -> None:
    """Wait for the run's lease in a thread at once (a takeover does not wait for this
    replica's start-up), build the follower (`build_follower()`: its `app` and `close()`)
    and serve it on host:port; once the lease is held, `build_leader(fence)`, start it and
    switch the server to its app; until SIGINT/SIGTERM. `on_lost()` when the lease cannot
    be waited for or kept (or the mode cannot be built once it is held). ValueError for a
    `db_url` that is no PostgreSQL server's."""
    from .host_app import serve_app
    from .lease import lead
    from .pg import is_url

    if not is_url(db_url):
        raise ValueError("--replica needs --db postgresql://...: replicas share one database")
    switch = Switch(_not_ready)
    stop = threading.Event()
    stop_mode: list[Callable[[], None]] = []
    followers: list[Any] = []
    lock = threading.Lock()  # the switch to the leader's app is final

    def close_follower() -> None:
        for follower in followers:
            follower.close()

    def take_over() -> None:
        try:
            lease, _ = lead(db_url, holder, ttl_s, on_lost, serves_at=own_url, stop=stop)
        except Exception:  # the database unreachable: a supervisor starts us again
            log.exception("replica %s: cannot wait for the run's lease", holder)
            on_lost()
            return
        if not lease.held:
            return
        try:
            app, start, stop_it = build_leader(lease.fence)
        except Exception:
            log.exception("replica %s: the run could not be built after taking the lease", holder)
            on_lost()
            return
        start()
        with lock:
            stop_mode.append(stop_it)
            switch.to(app)
        log.info("replica %s leads the run and serves it at %s", holder, own_url)
        # requests the follower's app is answering finish first
        threading.Timer(10.0, close_follower).start()

    threading.Thread(target=take_over, name="replica-lease", daemon=True).start()
    follower = build_follower()
    with lock:
        followers.append(follower)
        if not stop_mode:  # not the leader already
            switch.to(follower.app)
        else:
            threading.Timer(1.0, close_follower).start()

    def stop_all() -> None:
        stop.set()
        for stop_it in stop_mode:
            stop_it()
        if not stop_mode:
            close_follower()

    serve_app(switch, host, port, limits, lambda: None, stop_all)  # type: ignore[arg-type]


async def _not_ready(scope: Scope, receive: Receive, send: Send) -> None:
    """What a replica answers before its follower or its leader is built: 503."""
    await _reply(send, 503, {"error": "this replica is starting: retry"}, retry=True)


class RelayFollower:
    """A follower that answers only /healthz itself and relays every other request to the
    leader (the RL trainer's and the SWARM coordinator's replicas: their reads are views
    of the leader's memory, not of the database alone); `close()` once its replica leads."""

    def __init__(self, db_url: str, own_url: str, timeout_s: float) -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        from .db import Database

        self.db = Database(db_url)
        self.db.fence = refuse_writes

        async def healthz(_request: Any) -> JSONResponse:
            return JSONResponse({"ok": True})

        app = Starlette(routes=[Route("/healthz", healthz)])
        app.add_middleware(ForwardRest, leader=Leader(self.db, own_url), timeout_s=timeout_s)
        self.app: ASGIApp = app

    def close(self) -> None:
        self.db.close()
