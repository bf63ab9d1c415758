"""The shard board's HTTP routes (`/v1/shards`), as a FastAPI `APIRouter` that sharded
aggregation (covey.coordinator.shard_rounds.ShardedAggregation) owns and the rounds
coordinator's app includes. Handlers are thin: they call the board and the aggregation,
and turn a `ShardError` into a 4xx with its reason (a refused request changes nothing)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi import Path as PathParam
from starlette.concurrency import run_in_threadpool

from covey.protocol import schemas

from .openapi import errors
from .rejected import Rejected
from .sharding import ShardBoard, ShardError


def shard_router(
    board: ShardBoard,
    *,
    waiting_round: Callable[[], int | None],
    stored: Callable[[int], dict[str, Any] | None],
    ready: Callable[[dict[str, Any], float], dict[str, Any]],
) -> APIRouter:
    """The `/v1/shards` routes over `board`: the board of the round waiting on its
    aggregators (`waiting_round`), a validator's readiness (`ready`), a round's board or,
    once it is committed, its `stored` shard certificate, publishes and checks."""
    router = APIRouter(tags=["shards"])

    async def body_of(request: Request) -> dict[str, Any]:
        """The JSON object a peer sent; 400 naming the problem when it is not one."""
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise Rejected(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise Rejected(400, f"the body must be a JSON object, not {type(body).__name__}")
        return body

    def answer(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            return fn()
        except ShardError as e:
            raise Rejected(e.status, e.message) from None

    def read(round_: int) -> dict[str, Any]:
        if board.has(round_):
            board.expire(round_, time.time())
            return board.view(round_)
        final = stored(round_)
        if final is None:
            raise ShardError(404, f"round {round_} has no shard board (not sharded, or not yet)")
        return {"round": round_, "start_hash": final["start_hash"], "shards": [],
                "certificate": final}  # fmt: skip

    def live() -> int:
        r = waiting_round()
        if r is None or not board.has(r):
            raise ShardError(404, "no sharded round is waiting on its aggregators")
        return r

    @router.get("/v1/shards", responses=errors(404))
    async def shard_pending() -> dict[str, Any]:
        """The board of the sharded round now waiting on its aggregators (404: none)."""
        return await run_in_threadpool(answer, lambda: read(live()))

    @router.post("/v1/shards/ready", responses=errors(400, 401, 403, 422))
    async def shard_ready(request: Request) -> dict[str, Any]:
        """A staked validator's signed statement that it aggregates: it is in the draw
        of rounds closing within the next minute (aggregators repeat it while they run)."""
        body = await body_of(request)
        return await run_in_threadpool(answer, lambda: ready(body, time.time()))

    @router.get("/v1/shards/{round}", responses=errors(404))
    async def shard_view(round: int = PathParam(ge=0, le=schemas.MAX_INT)) -> dict[str, Any]:
        """A sharded round's board: the plan, each shard's aggregator (a beacon draw) and
        checker, the published hashes, the inputs, and the signed shard certificate once
        every shard is published and every drawn check agreed (with `new_hash` once the
        round is committed)."""
        return await run_in_threadpool(answer, lambda: read(round))

    refusals = errors(400, 401, 403, 404, 409, 422)

    @router.post("/v1/shards/{round}/publish", responses=refusals)
    async def shard_publish(
        request: Request, round: int = PathParam(ge=0, le=schemas.MAX_INT)
    ) -> dict[str, Any]:
        """An aggregator's signed hash of its new shard, and the URL serving it."""
        body = await body_of(request)
        return await run_in_threadpool(answer, lambda: board.publish(round, body))

    @router.post("/v1/shards/{round}/check", responses=refusals)
    async def shard_check(
        request: Request, round: int = PathParam(ge=0, le=schemas.MAX_INT)
    ) -> dict[str, Any]:
        """A drawn checker's hash of a published shard: a disagreement goes to the
        referee, and a proven wrong shard slashes its aggregator."""
        body = await body_of(request)
        return await run_in_threadpool(answer, lambda: board.check(round, body, time.time()))

    return router
