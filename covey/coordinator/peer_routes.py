"""The routes every mode serves its peers in one shape, over the host's parts: what the run
is (GET /v1/run), membership (POST /v1/join, /v1/heartbeat, /v1/leave) and reading blobs
(GET and HEAD /v1/blobs/{cid}, whole or one range). Rounds (covey.coordinator.app) and RL
(covey.rl.service) use all three; SWARM (covey.swarm.app) has its own join and heartbeat,
which carry a stage, and uses the other two.

Each route hands the request to a function of the mode: the routes decide nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import (
    FileResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.concurrency import run_in_threadpool

from covey.blobs import RangeNotSatisfiable, S3BlobStore, parse_range
from covey.protocol import schemas

from .openapi import BLOB_BODY, errors
from .rejected import Rejected

if TYPE_CHECKING:
    from covey.blobs import BlobStore

CHUNK_BYTES = 1 << 20  # a MiB a read when streaming a range


def run_route(app: FastAPI, describe: Callable[[], dict[str, Any]]) -> None:
    """GET /v1/run: `describe()` gives at least covey.errors.RUN_KEYS (run id, coordinator
    key, spec) and the mode: how `covey halt`, `covey ledger verify URL` and the peers
    recognize a covey coordinator and its run."""

    @app.get("/v1/run")
    def run() -> dict[str, Any]:
        """The run id, the mode, the coordinator's key and the spec the id covers."""
        return describe()


Handler = Callable[[Any, dict[str, Any]], Any]


def membership_routes(
    app: FastAPI,
    join: Handler,
    heartbeat: Handler,
    leave: Handler,
    *,
    heartbeat_call: Callable[[Handler, Any, dict[str, Any]], Awaitable[Any]] | None = None,
) -> None:
    """POST /v1/join, /v1/heartbeat and /v1/leave with the host's signed schemas. Each
    handler gets the validated request and the raw JSON (the signature covers the body
    exactly as sent). They run in the thread pool; `heartbeat_call` may run heartbeats
    another way (rounds: on the event loop when the database is free)."""

    async def pooled(fn: Handler, req: Any, raw: dict[str, Any]) -> Any:
        return await run_in_threadpool(fn, req, raw)

    beat = heartbeat_call or pooled

    @app.post("/v1/join")
    async def join_run(req: schemas.JoinRequest, request: Request) -> schemas.JoinReply:
        """Register (the first time: ledger entries for the join and its stake) and go live.
        The peer id must be the hash of the public key that signs the request."""
        return await run_in_threadpool(join, req, await request.json())

    @app.post("/v1/heartbeat")
    async def heartbeat_run(req: schemas.HeartbeatRequest, request: Request) -> dict[str, Any]:
        """The peer is alive (and, in rounds, what it is doing)."""
        return await beat(heartbeat, req, await request.json())

    @app.post("/v1/leave")
    async def leave_run(req: schemas.LeaveRequest, request: Request) -> dict[str, Any]:
        """The deathrattle: sent on Ctrl-C or SIGTERM, so nothing waits for this peer."""
        return await run_in_threadpool(leave, req, await request.json())


def file_range(path: Path, start: int, end: int) -> Iterator[bytes]:
    """Bytes start..end (inclusive) of a file, a MiB at a time (starlette iterates a sync
    generator in its thread pool)."""
    with path.open("rb") as f:
        f.seek(start)
        left = end - start + 1
        while left > 0:
            piece = f.read(min(left, CHUNK_BYTES))
            if not piece:
                return  # the file shrank: the client sees a short body
            left -= len(piece)
            yield piece


def blob_routes(app: FastAPI, blobs: BlobStore) -> None:
    """GET and HEAD /v1/blobs/{cid} over the host's blob store: the bytes whole, or a single
    `Range: bytes=a-b` as 206 with that slice, streamed from disk and never read whole into
    memory. An unknown id is a 404, a range outside the blob a 416. With the blobs in an
    object store (covey.blobs.S3BlobStore) a GET is a 307 to a presigned URL there."""

    def read_blob(cid: str, request: Request) -> Response:
        """Blob bytes; a single `Range: bytes=a-b` gives 206 with that slice (streamed from
        disk, never read whole into memory)."""
        if not blobs.has(cid):
            raise Rejected(404, f"no blob {cid[:80]!r}")
        if isinstance(blobs, S3BlobStore) and request.method == "GET":
            # the bytes come from the object store, not through this process (Range too)
            return RedirectResponse(blobs.presigned_url(cid), 307)
        size = blobs.size(cid)
        try:
            byte_range = parse_range(request.headers.get("range"), size)
        except RangeNotSatisfiable as e:
            return JSONResponse(
                {"error": str(e)}, 416, headers={"Content-Range": f"bytes */{size}"}
            )
        if byte_range is None:
            if request.method == "HEAD":
                return Response(headers={"Content-Length": str(size)})
            return FileResponse(blobs.path(cid), media_type="application/octet-stream")
        start, end = byte_range
        headers = {
            "Content-Range": f"bytes {start}-{end}/{size}",
            "Accept-Ranges": "bytes",
            "Content-Length": str(end - start + 1),
        }
        if request.method == "HEAD":
            return Response(None, 206, headers=headers, media_type="application/octet-stream")
        return StreamingResponse(
            file_range(blobs.path(cid), start, end),
            206,
            headers=headers,
            media_type="application/octet-stream",
        )

    responses = {**BLOB_BODY, **errors(404, 416)}
    # one operation each, so the OpenAPI document has no duplicate operation ids
    app.add_api_route(
        "/v1/blobs/{cid}",
        read_blob,
        methods=["GET"],
        response_class=Response,
        responses=responses,
        name="get_blob",
    )
    app.add_api_route(
        "/v1/blobs/{cid}",
        read_blob,
        methods=["HEAD"],
        response_class=Response,
        responses=responses,
        name="head_blob",
    )
