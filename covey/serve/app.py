"""HTTP for the serving mode: the OpenAI-compatible API users call, and the signed routes
of workers and validators. The owner's HALT, /healthz, /metrics, the ledger routes and the
rate and body limits are the host's (covey.coordinator.host_app).

    GET  /v1/models                       the served model (OpenAI's list)
    POST /v1/completions                  OpenAI completions (stream: server-sent events)
    POST /v1/chat/completions             OpenAI chat completions (the tokenizer's template)
    GET  /v1/run, /v1/serve/spec          run id, mode, keys, spec; what a peer needs
    GET  /v1/serve/status                 answers by status, workers' pay, who was excluded
    POST /v1/join, /v1/heartbeat, /v1/leave, /v1/serve/validators/join   membership
    POST /v1/serve/pull, /v1/serve/answer a worker's long-poll for a request; its answer
    POST /v1/serve/progress               a streamed request's tokens so far (per segment)
    POST /v1/serve/claim, /v1/serve/report   a validator's check and its verdict

A user's request gets 400 for what it may not ask (too many tokens, too long a prompt),
429 with Retry-After when every worker is busy, 503 with no worker (or a halted run), 504
past request_timeout_s; a client that hangs up drops its request from the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from covey.coordinator.host_app import handle_errors, host_middleware, host_routes, serve_app
from covey.coordinator.metrics import HostCollector, Metrics
from covey.coordinator.peer_routes import membership_routes, run_route
from covey.coordinator.rejected import Rejected
from covey.protocol import schemas
from covey.rl.sampling import sample_seed
from covey.serve import openai_format as fmt
from covey.serve.config import MIN_TEMPERATURE
from covey.serve.dispatch import Dispatcher, Pending
from covey.serve.model import render_chat
from covey.serve.service import ServeCoordinator
from covey.serve.wire import (
    AnswerSubmit,
    ChatRequest,
    ClaimRequest,
    CompletionRequest,
    Job,
    ProgressSubmit,
    PullRequest,
    ReportRequest,
)
from covey.trust.house import house_request_id

log = logging.getLogger("covey.serve")
JOINS = frozenset({"/v1/join", "/v1/serve/validators/join"})
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ClientGone(Exception):
    pass


def create_app(
    s: ServeCoordinator, house: list[dict[str, Any]] | None = None, house_every_s: float = 10.0
) -> FastAPI:
    """`house`: the owner's house requests (covey.serve.canaries.house_request_bodies), sent
    by the server itself at random times, one every `house_every_s` on average."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.ensure_future(house_traffic()) if house else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    app = FastAPI(
        title="covey serve",
        version="1",
        description="An OpenAI-compatible API answered by verified workers.",
        lifespan=lifespan,
    )
    cfg, tok = s.cfg, s.tokenizer
    handle_errors(app, log)
    dispatch = Dispatcher(cfg.queue_per_worker, s.alive, cfg.pull_wait_s + cfg.dead_after_s)
    metrics = Metrics(HostCollector(s.db, cfg.dead_after_s), ServeCollector(s, dispatch))
    answer_s = Histogram(
        "covey_serve_answer_seconds",
        "From a request's arrival to its answer",
        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        registry=metrics.registry,
    )
    served = Counter(
        "covey_serve_requests", "User requests by outcome", ["outcome"], registry=metrics.registry
    )
    host_routes(app, metrics, s.halt, s.accounts)
    app.state.dispatch = dispatch

    run_route(
        app,
        lambda: {
            "run_id": s.run_id,
            "mode": "serve",
            "coordinator_key": s.identity.public_key,
            "owner_key": s.halt.owner_key,
            "spec": s.spec_of_run(),
        },
    )

    @app.get("/v1/serve/spec")
    def spec() -> dict[str, Any]:
        """What a worker or validator checks before it joins: the model's content id."""
        return {
            "run_id": s.run_id,
            "model_cid": s.model_cid,
            "name": cfg.name,
            "coordinator_key": s.identity.public_key,
            "heartbeat_s": cfg.heartbeat_s,
            "pull_wait_s": cfg.pull_wait_s,
            "spec": cfg.model_dump(mode="json"),
        }

    @app.get("/v1/serve/status")
    def status() -> dict[str, Any]:
        serving = dispatch.serving()
        return {
            **s.status(),
            "serving": len(serving),
            "waiting": len(dispatch.queue),
            "held": dispatch.held(),  # requests workers' slots are answering
            "slots": dispatch.capacity(serving),  # the serving workers' slots
        }

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": cfg.name, "object": "model", "created": int(s.started), "owned_by": "covey"}
            ],
        }

    def make_job(req: Any, text: str, max_tokens: int | None, is_chat: bool) -> Job:
        if s.halt.halted is not None:
            raise Rejected(503, f"this run was halted by its owner: {s.halt.halted['reason']}")
        if req.model not in (None, cfg.name):
            raise Rejected(404, f"model {req.model!r} is not served here; this serves {cfg.name!r}")
        ids = tok.encode(text) or [tok.eos_id]
        if len(ids) > cfg.max_prompt_tokens:
            raise Rejected(400, f"the prompt is {len(ids)} tokens, over {cfg.max_prompt_tokens}")
        room = cfg.max_tokens if s.window is None else min(cfg.max_tokens, s.window - len(ids))
        # not asked: OpenAI's 16 for a completion, as many as fit for a chat
        n = max_tokens or (min(DEFAULT_COMPLETION_TOKENS, room) if not is_chat else room)
        if n > cfg.max_tokens:
            raise Rejected(400, f"max_tokens {n} is over this server's limit {cfg.max_tokens}")
        if n > room or n < 1:
            raise Rejected(
                400,
                f"{len(ids)} prompt tokens + max_tokens {n} exceed the model's "
                f"context of {s.window}",
            )
        seed = (
            sample_seed(s.run_id, 0, "serve", req.seed, 0)
            if req.seed is not None
            else secrets.randbits(64)
        )
        return Job(
            job_id=secrets.token_hex(16),
            prompt_ids=ids,
            max_tokens=n,
            eos_id=tok.eos_id,
            temperature=max(req.temperature, MIN_TEMPERATURE),
            top_p=req.top_p,
            seed=seed,
        )

    async def wait(p: Pending, request: Request | None) -> list[int]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.request_timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({p.future}, timeout=0.25)
                if done:
                    return p.future.result()  # type: ignore[no-any-return]
                if request is not None and await request.is_disconnected():
                    served.labels("client gone").inc()
                    raise ClientGone
                if loop.time() >= deadline:
                    served.labels("timeout").inc()
                    raise Rejected(504, f"no answer within {cfg.request_timeout_s} s")
        finally:
            if not p.future.done():
                dispatch.drop(p)

    async def stream(
        p: Pending, job: Job, rid: str, req: Any, is_chat: bool, done: Any
    ) -> AsyncIterator[bytes]:
        """Server-sent events: the text as the worker's progress comes in (held back where
        it could be the start of a stop string), then the answer's rest, the finish and
        the usage. A client that hangs up cancels this generator, which drops the job."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.request_timeout_s
        text, name, n_prompt = "", cfg.name, len(job.prompt_ids)
        stops = req.stops()
        if is_chat:
            yield fmt.sse(fmt.chunk(rid, name, None, None, True, first=True))
        try:
            while True:
                update = asyncio.ensure_future(p.updates.get())
                ready, _ = await asyncio.wait(
                    {update, p.future},
                    timeout=max(0.0, deadline - loop.time()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not ready:
                    update.cancel()
                    served.labels("timeout").inc()
                    yield fmt.error_event(f"no answer within {cfg.request_timeout_s} s", 504)
                    return
                if p.future in ready:
                    update.cancel()
                    finished = done(p.future.result())
                else:
                    finished = fmt.finish(update.result(), tok.decode, job.eos_id, stops, True)
                if finished.text.startswith(text) and len(finished.text) > len(text):
                    piece, text = finished.text[len(text) :], finished.text
                    yield fmt.sse(fmt.chunk(rid, name, piece, None, is_chat))
                if p.future in ready or finished.finish_reason == "stop":
                    break
            yield fmt.sse(fmt.chunk(rid, name, None, finished.finish_reason, is_chat))
            if req.include_usage():
                yield fmt.sse(fmt.usage_chunk(rid, name, n_prompt, finished, is_chat))
            yield fmt.sse("[DONE]")
        finally:
            if not p.future.done():
                dispatch.drop(p)

    async def answer(
        req: Any, text: str, max_tokens: int | None, request: Request, is_chat: bool
    ) -> Response:
        job = make_job(req, text, max_tokens, is_chat)
        if req.stream:
            job = job.model_copy(update={"segment": cfg.stream_segment})
        try:
            p = await dispatch.submit(job)
        except Rejected as e:
            served.labels(str(e.status)).inc()
            raise
        start, rid = time.monotonic(), ("chatcmpl-" if is_chat else "cmpl-") + job.job_id

        def done(tokens: list[int]) -> fmt.Finished:
            answer_s.observe(time.monotonic() - start)
            served.labels("answered").inc()
            return fmt.finish(tokens, tok.decode, job.eos_id, req.stops())

        if req.stream:
            return StreamingResponse(
                stream(p, job, rid, req, is_chat, done),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            finished = done(await wait(p, request))
        except ClientGone:
            return Response(status_code=499)
        shape = fmt.chat if is_chat else fmt.completion
        return JSONResponse(shape(rid, cfg.name, len(job.prompt_ids), finished))

    async def house_traffic() -> None:
        """The owner's house requests (covey.serve.canaries), in turn, at the times of a
        Poisson process, queued like a user's; every answer is dropped unread."""
        bodies, n = house or [], 0
        while True:
            await asyncio.sleep(random.expovariate(1.0 / house_every_s))
            req, n = CompletionRequest.model_validate(bodies[n % len(bodies)]), n + 1
            try:
                job = make_job(req, req.text(), req.max_tokens, False)
                nonce = secrets.token_hex(8)
                update: dict[str, Any] = {"job_id": house_request_id(s.identity, s.run_id, nonce)}
                if req.stream:
                    update["segment"] = cfg.stream_segment
                await wait(await dispatch.submit(job.model_copy(update=update)), None)
            except Rejected:  # busy, no worker, halted, no answer in time: the next one
                continue
            except Exception:  # the house traffic must outlive one bad request
                log.exception("a house request failed")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        try:
            text = req.text()
        except ValueError as e:
            raise Rejected(400, str(e)) from None
        return await answer(req, text, req.max_tokens, request, False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        return await answer(
            req,
            render_chat(tok, messages),
            req.max_completion_tokens or req.max_tokens,
            request,
            True,
        )

    # -- membership (the host's) --------------------------------------------------------------

    membership_routes(app, s.membership.join, s.membership.heartbeat, s.membership.leave)

    @app.post("/v1/serve/validators/join")
    async def validator_join(req: schemas.ValidatorJoin, request: Request) -> dict[str, Any]:
        raw = await request.json()

        def go() -> dict[str, Any]:
            s.membership.join_validator(req, raw)
            return {"ok": True, "heartbeat_s": cfg.heartbeat_s}

        return await run_in_threadpool(go)

    # -- workers and validators ---------------------------------------------------------------

    @app.post("/v1/serve/pull")
    async def pull(req: PullRequest, request: Request) -> dict[str, Any]:
        """A worker's long-poll: a request to answer, or {"job": null} after pull_wait_s."""
        await run_in_threadpool(s.authenticate, await request.json(), req.peer_id, "worker")
        if req.slot >= cfg.worker_slots:
            raise Rejected(409, f"slot {req.slot}: this run's workers have {cfg.worker_slots}")
        job = await dispatch.take(req.peer_id, cfg.pull_wait_s, req.slot)
        if job is not None and await request.is_disconnected():
            dispatch.release(req.peer_id, req.slot)  # it never got it: another worker will
            return {"job": None}
        return {"job": None if job is None else job.model_dump()}

    @app.post("/v1/serve/answer")
    async def submit(req: AnswerSubmit, request: Request) -> dict[str, Any]:
        """A worker's answer to the job it holds; 409 for a job it does not hold (another
        worker's, an answered one, a replay), 422 for tokens or a proof of the wrong shape."""
        await run_in_threadpool(s.authenticate, await request.json(), req.peer_id, "worker")
        p = dispatch.holder(req.job_id)
        if p is None or p.worker != req.peer_id or p.answering:
            raise Rejected(409, f"job {req.job_id} is not held by worker {req.peer_id[:12]}")
        if list(req.tokens[: len(p.streamed)]) != p.streamed:
            raise Rejected(422, f"the answer to {req.job_id} does not extend its streamed tokens")
        p.answering = True
        try:
            number = await run_in_threadpool(
                s.intake, p.job, req.peer_id, list(req.tokens), req.proof
            )
        except BaseException:
            p.answering = False
            raise
        dispatch.finish(p, list(req.tokens))
        return {"ok": True, "answer_id": number}

    @app.post("/v1/serve/progress")
    async def progress(req: ProgressSubmit, request: Request) -> dict[str, Any]:
        """A worker's tokens so far of a streamed job it holds: sent on to the user; 409 for
        a job it does not hold, 422 for tokens that do not extend its last progress."""
        await run_in_threadpool(s.authenticate, await request.json(), req.peer_id, "worker")
        p = dispatch.holder(req.job_id)
        if p is None or p.worker != req.peer_id or p.answering or not p.job.segment:
            raise Rejected(409, f"job {req.job_id} is not a streamed job of {req.peer_id[:12]}")
        if any(t >= s.vocab_size for t in req.tokens):
            raise Rejected(422, f"a token id outside the model's vocabulary of {s.vocab_size}")
        try:
            dispatch.progress(p, list(req.tokens))
        except ValueError as e:
            raise Rejected(422, str(e)) from None
        return {"ok": True}

    @app.post("/v1/serve/claim")
    async def claim(req: ClaimRequest, request: Request) -> dict[str, Any]:
        raw = await request.json()

        def go() -> dict[str, Any]:
            s.authenticate(raw, req.peer_id, "validator")
            return {"task": s.claim(req.peer_id)}

        return await run_in_threadpool(go)

    @app.post("/v1/serve/report")
    async def report(req: ReportRequest, request: Request) -> dict[str, Any]:
        raw = await request.json()

        def go() -> dict[str, Any]:
            s.authenticate(raw, req.peer_id, "validator")
            return s.report(req.peer_id, req.answer_id, req.ok, req.problem, req.detail)

        return await run_in_threadpool(go)

    host_middleware(app, metrics, cfg.limits, json_limit=cfg.limits.max_json_bytes, joins=JOINS)
    return app


class ServeCollector(Collector):
    """The serving run as metrics: answers by status, tokens answered, tokens/s since start,
    requests waiting, workers serving, workers excluded."""

    def __init__(self, s: ServeCoordinator, dispatch: Dispatcher) -> None:
        self.s, self.dispatch = s, dispatch

    def collect(self) -> Iterator[Metric]:
        status = self.s.status()
        answers = GaugeMetricFamily("covey_serve_answers", "Answers by status", labels=["status"])
        for k, n in sorted(status["answers"].items()):
            answers.add_metric([k], n)
        yield answers
        tokens = sum(status["tokens"].values())
        yield GaugeMetricFamily("covey_serve_tokens", "Tokens answered by workers", value=tokens)
        rate = tokens / max(1e-9, time.time() - self.s.started)
        yield GaugeMetricFamily(
            "covey_serve_tokens_per_second",
            "Tokens answered per second since the server started",
            value=rate,
        )
        yield GaugeMetricFamily(
            "covey_serve_waiting", "Requests waiting for a worker", value=len(self.dispatch.queue)
        )
        serving = self.dispatch.serving()
        yield GaugeMetricFamily(
            "covey_serve_workers", "Workers serving (pulled recently)", value=len(serving)
        )
        yield GaugeMetricFamily(
            "covey_serve_slots",
            "Requests the serving workers answer at a time (their slots)",
            value=self.dispatch.capacity(serving),
        )
        yield GaugeMetricFamily(
            "covey_serve_held", "Requests held by workers' slots", value=self.dispatch.held()
        )
        yield GaugeMetricFamily(
            "covey_serve_excluded", "Peers excluded for fraud", value=len(status["excluded"])
        )


def serve(
    s: ServeCoordinator,
    host: str,
    port: int,
    house: list[dict[str, Any]] | None = None,
    house_every_s: float = 10.0,
) -> None:
    """Run until SIGINT/SIGTERM, then stop the driver and close the database. `house`,
    `house_every_s`: the owner's house requests (create_app)."""
    serve_app(create_app(s, house, house_every_s), host, port, s.cfg.limits, s.start, s.stop)
