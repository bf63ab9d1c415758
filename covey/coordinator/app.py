"""The rounds coordinator's HTTP face: the versioned JSON API (/v1/...), its OpenAPI
document (/openapi.json, /docs), the blob relay and the status page (/). What every mode
serves alike (error replies, /healthz, /metrics, POST /v1/halt, the ledger, the rate and
body-size limits, serving) is the host's: covey.coordinator.host_app.

Handlers are thin: they validate with the pydantic schemas of covey.protocol.schemas and
call covey.coordinator.service. Every refusal is a 4xx with a JSON body {"error": "..."},
logged with the peer and round it concerns; a refused request changes nothing.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import (
    FileResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from covey.blobs import BlobError, RangeNotSatisfiable, S3BlobStore, parse_range
from covey.protocol import schemas

from .fastpaths import MAX_ROUND_WAIT_S, ClientGone, FastPaths, hold_round_poll, unless_gone
from .host_app import handle_errors, host_middleware, host_routes, serve_app
from .limits import LongPolls
from .metrics import HostCollector, Metrics, RunCollector
from .openapi import BLOB_BODY, BLOB_UPLOAD, errors
from .openapi import document as document_api
from .rejected import Rejected
from .service import Coordinator

log = logging.getLogger("covey.coordinator")
STATIC = resources.files("covey.dashboard") / "static"


_WRITE_BYTES = 1 << 20


def _file_range(path: Path, start: int, end: int) -> Iterator[bytes]:
    """Bytes start..end (inclusive) of a file, a MiB at a time (starlette iterates a sync
    generator in its thread pool)."""
    with path.open("rb") as f:
        f.seek(start)
        left = end - start + 1
        while left > 0:
            piece = f.read(min(left, _WRITE_BYTES))
            if not piece:
                return  # the file shrank: the client sees a short body
            left -= len(piece)
            yield piece


def create_app(coord: Coordinator, *, fast_paths: bool = True) -> FastAPI:
    """The app over `coord`. `fast_paths=False` leaves heartbeats and round polls to the
    FastAPI routes too (tests compare the two answers; covey.coordinator.fastpaths)."""
    app = FastAPI(
        title="covey coordinator",
        version="1",
        description="Rounds, membership and blobs of one covey training run.",
    )
    handle_errors(app, log)

    @app.get("/", include_in_schema=False)
    def index() -> Response:
        return Response((STATIC / "index.html").read_bytes(), media_type="text/html")

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        if "/" in name or name.startswith(".") or not (STATIC / name).is_file():
            raise Rejected(404, f"no static file {name!r}")
        media = "application/javascript" if name.endswith(".js") else "text/plain"
        media = "text/css" if name.endswith(".css") else media
        return Response((STATIC / name).read_bytes(), media_type=media)

    async def _inline_or_thread(fn: Any, *args: Any) -> Any:
        """Run a cheap handler (heartbeat, round poll: cached views, a read, no write) on
        the event loop when the database is free, saving a thread hop per request (most of
        their cost); in the thread pool when a writer holds it, so the loop never waits."""
        if not coord.db.lock.acquire(blocking=False):
            return await run_in_threadpool(fn, *args)
        try:
            return fn(*args)
        finally:
            coord.db.lock.release()

    metrics = Metrics(HostCollector(coord.db, coord.cfg.rounds.dead_after_s), RunCollector(coord))
    limits = coord.cfg.limits
    long_polls = LongPolls(limits.max_long_polls, limits.max_long_polls_per_peer)
    # the round long-poll has a pool of its own: waiting peers that fill it never leave a
    # member without a slot for its certificate (which has no plain-poll fallback)
    round_polls = LongPolls(limits.max_long_polls, limits.max_long_polls_per_peer)
    metrics.gauge(
        "covey_long_polls_held",
        "Long-polls held now (certificate and round)",
        lambda: long_polls.held() + round_polls.held(),
    )

    host_routes(app, metrics, coord.halt, coord.accounts)

    @app.get("/v1/run")
    def run() -> dict[str, Any]:
        """The run spec, its id and the corpus fingerprint every peer must match."""
        return coord.run_spec()

    @app.get("/v1/status")
    def status() -> dict[str, Any]:
        """Live peers, rounds, losses and bytes (the dashboard's feed)."""
        return coord.status()

    # Signed requests: the signature covers the body exactly as sent, so handlers read the
    # raw JSON (FastAPI has already parsed and validated it into the model) and pass both.

    @app.post("/v1/join")
    async def join(req: schemas.JoinRequest, request: Request) -> schemas.JoinReply:
        """Register (the first time: ledger entries for the join and its stake) and go live.
        The peer id must be the hash of the public key that signs the request."""
        return await run_in_threadpool(coord.join, req, await request.json())

    @app.post("/v1/heartbeat")
    async def heartbeat(req: schemas.HeartbeatRequest, request: Request) -> dict[str, Any]:
        return await _inline_or_thread(coord.heartbeat, req, await request.json())

    @app.post("/v1/leave")
    async def leave(req: schemas.LeaveRequest, request: Request) -> dict[str, Any]:
        """The deathrattle: sent on Ctrl-C or SIGTERM, so no round waits for this peer."""
        return await run_in_threadpool(coord.leave, req, await request.json())

    @app.get("/v1/round", responses=errors(401))
    async def current_round(
        request: Request,
        peer_id: str | None = Query(None, pattern=schemas.PEER_ID_PATTERN),
        after: str | None = Query(
            None, max_length=64, description="long-poll: the `tag` of the view last seen"
        ),
        wait: float = Query(
            0.0, ge=0, le=MAX_ROUND_WAIT_S, description="long-poll seconds (with `after`)"
        ),
    ) -> schemas.RoundInfo:
        """The open round: start weights, this peer's assignment and the deadline. With
        `after` and `wait`, the request is held until the view past tag `after` has news
        for `peer_id` (a round it is a member of opens; the run finishes or is halted; a
        round that only closes, or one it is not in, is not news) or `wait` seconds pass,
        holding no thread: a waiting peer learns of its round at once instead of
        polling. Held polls are bounded like the certificate's (signed in headers with
        covey.trust.polls' ROUND_POLL purpose: per peer; else per address)."""
        if wait > 0 and after is not None:
            client = request.client.host if request.client else "-"
            try:
                await hold_round_poll(
                    coord,
                    round_polls,
                    request.headers,
                    client,
                    after,
                    wait,
                    peer_id or None,
                    request.receive,
                )
            except ClientGone:
                return Response(status_code=499)  # nobody reads it: the client left
        return await _inline_or_thread(coord.round_info, peer_id)

    @app.post("/v1/rounds/{round}/contributions")
    async def submit(
        round: int = PathParam(ge=0, le=schemas.MAX_INT),
        *,
        req: schemas.ContributionRequest,
        request: Request,
    ) -> dict[str, Any]:
        """A contribution's metadata and commitments, signed for this run and round."""
        return await run_in_threadpool(coord.submit, round, req, await request.json())

    @app.get("/v1/rounds/{round}/certificate", responses=errors(401, 404))
    async def certificate(
        request: Request,
        round: int = PathParam(ge=0, le=schemas.MAX_INT),
        wait: float = Query(0.0, ge=0, le=30, description="long-poll seconds"),
        peer_id: str | None = Query(
            None, max_length=64, description="who waits (informational: not counted on)"
        ),
    ) -> schemas.Certificate:
        """The accepted set with weights, the rejections and the new weights hash. With
        `wait`, the request is held until the round commits (or `wait` seconds pass), so
        peers learn of a commit at once; waiting holds no thread. Long-polls held at once
        are bounded in total and per peer, past that 429: a poll counts against a peer
        only when signed by it in headers (covey.trust.polls; a forged one is 401), else
        against its client address (16 peers' share), whatever `peer_id` says."""
        if wait <= 0 or coord.state.round > round:
            return coord.certificate(round)
        client = request.client.host if request.client else "-"
        signer = coord.membership.poll_signer(request.headers, round)
        key, share = (f"peer:{signer}", None) if signer else (f"address:{client}", 16)
        with long_polls.hold(key, None if share is None else share * long_polls.per_key) as ok:
            if not ok:
                raise Rejected(429, f"too many long-polls held for {key[:40]}: retry shortly")
            # woken by the commit itself (CommitSignal, set in service._close), not a timer;
            # a client that disconnects gives its slot back at once
            try:
                committed = coord.commits.wait(lambda: coord.state.round > round, wait)
                await unless_gone(committed, request.receive)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it: the client left
        return coord.certificate(round)

    @app.post("/v1/validators/join")
    async def validator_join(req: schemas.ValidatorJoin, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(coord.validator_join, req, await request.json())

    @app.post("/v1/verify/claim")
    async def claim(req: schemas.ClaimRequest, request: Request) -> dict[str, Any]:
        """A sampled contribution to re-execute ({"task": null} when there is none)."""
        return await run_in_threadpool(coord.claim, req, await request.json())

    @app.post("/v1/verify/report")
    async def report(req: schemas.VerifyReport, request: Request) -> dict[str, Any]:
        """A re-execution's outcome; a disagreement opens a dispute the referee settles."""
        return await run_in_threadpool(coord.report, req, await request.json())

    @app.get("/v1/ledger/receipt", responses=errors(404))
    def receipt(
        round: int = Query(ge=0, le=schemas.MAX_INT),
        peer_id: str = Query(pattern=schemas.PEER_ID_PATTERN),
    ) -> dict[str, Any]:
        """The signed ledger entry accepting this peer's contribution to this round."""
        entry = coord.accounts.find("contribution accepted", round=round, peer_id=peer_id)
        if entry is None:
            raise Rejected(404, f"no accepted contribution of {peer_id[:12]} in round {round}")
        return entry

    @app.get("/v1/checkpoints")
    def checkpoints() -> list[schemas.CheckpointEntry]:
        return coord.checkpoints()

    @app.put("/v1/blobs/{cid}", responses=errors(400, 401, 403, 411), openapi_extra=BLOB_UPLOAD)
    async def put_blob(cid: str, request: Request) -> dict[str, Any]:
        """Store a blob a member uploads: signed in headers (covey.blobs.store.
        upload_message) by a live worker or a registered validator, of a size this run's
        model implies; all checked before a byte of the body is read. The body streams to
        disk and is hashed off the event loop; refused unless it hashes to `cid`."""
        ticket = await run_in_threadpool(
            coord.uploads.admit, cid, request.headers, request.headers.get("content-length")
        )
        stored = False
        try:
            writer = await run_in_threadpool(coord.uploads.writer, ticket)
            try:
                pending: list[bytes] = []
                buffered = 0
                async for piece in request.stream():
                    pending.append(piece)
                    buffered += len(piece)
                    if buffered >= _WRITE_BYTES:  # one thread hop per MiB, not per packet
                        await run_in_threadpool(writer.write, b"".join(pending))
                        pending, buffered = [], 0
                await run_in_threadpool(writer.write, b"".join(pending))
                await run_in_threadpool(writer.commit)
                stored = True
            finally:
                if not stored:
                    writer.abort()
        except BlobError as e:
            raise Rejected(400, str(e)) from None
        except ClientDisconnect:
            raise Rejected(400, f"upload of {cid[:12]} ended early: client went away") from None
        finally:
            coord.uploads.done(ticket, stored)
        return {"ok": True, "cid": cid, "size": ticket.size}

    @app.api_route(
        "/v1/blobs/{cid}",
        methods=["GET", "HEAD"],
        response_class=Response,
        responses={**BLOB_BODY, **errors(404, 416)},
    )
    def get_blob(cid: str, request: Request) -> Response:
        """Blob bytes; a single `Range: bytes=a-b` gives 206 with that slice (streamed from
        disk, never read whole into memory). With blobs in an object store, a GET is a 307
        to a presigned URL there (the Range goes along)."""
        if not coord.blobs.has(cid):
            raise Rejected(404, f"no blob {cid[:80]!r}")
        if isinstance(coord.blobs, S3BlobStore) and request.method == "GET":
            # the bytes come from the object store, not through this process
            return RedirectResponse(coord.blobs.presigned_url(cid), 307)
        size = coord.blobs.size(cid)
        try:
            byte_range = parse_range(request.headers.get("range"), size)
        except RangeNotSatisfiable as e:
            return JSONResponse(
                {"error": str(e)}, 416, headers={"Content-Range": f"bytes */{size}"}
            )
        if byte_range is None:
            if request.method == "HEAD":
                return Response(headers={"Content-Length": str(size)})
            return FileResponse(coord.blobs.path(cid), media_type="application/octet-stream")
        start, end = byte_range
        headers = {
            "Content-Range": f"bytes {start}-{end}/{size}",
            "Accept-Ranges": "bytes",
            "Content-Length": str(end - start + 1),
        }
        if request.method == "HEAD":
            return Response(None, 206, headers=headers, media_type="application/octet-stream")
        return StreamingResponse(
            _file_range(coord.blobs.path(cid), start, end),
            206,
            headers=headers,
            media_type="application/octet-stream",
        )

    # the rounds mode's aggregation serves its own routes (sharded: the shard board's)
    app.include_router(coord.rounds.aggregation.router)
    coord.uploads  # noqa: B018 -- sizes implied by the model, worked out before serving
    # innermost: heartbeats and round polls skip FastAPI's routing, not the layers below
    if fast_paths:
        app.add_middleware(FastPaths, coord=coord, long_polls=round_polls)
    host_middleware(app, metrics, limits, json_limit=limits.max_json_bytes)
    document_api(app, coord.run_id)  # every status code each operation can answer
    return app


def quiet_gc() -> None:
    """Keep the garbage collector from pausing the event loop for a quarter second every
    few seconds. What exists once the coordinator is up (torch, the model template,
    FastAPI, pydantic's schemas: most of the heap) lives as long as the process, so it is
    frozen out of every collection; and the youngest generation is collected per 50,000
    new container objects instead of 700, so a busy coordinator reaches a full collection
    less often. Measured: full collections took 150-290 ms every ~3 s at 1000 peers
    (BENCHMARKS.md, `covey bench coordinator`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def serve(coord: Coordinator, host: str, port: int) -> None:
    """Run until SIGINT/SIGTERM (uvicorn's graceful shutdown), then stop the driver."""

    def start() -> None:
        coord.start()
        quiet_gc()

    serve_app(create_app(coord), host, port, coord.cfg.limits, start, coord.stop)
