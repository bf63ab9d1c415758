"""Requests waiting for a worker, and the workers holding them: the event loop's side of
the serving mode (every method runs on the app's event loop, none blocks).

Routing is by load: each of a worker's slots (at most the run's worker_slots) pulls (a
long-poll) when it is free, so a worker holds at most one request per slot, and the oldest
waiting request goes to whichever slot asks first. The capacity of the serving workers is
their slots seen pulling; backpressure: past the free slots plus `queue_per_worker`
waiting requests per live worker, a new request is refused (429 with Retry-After); with no
live worker, 503. A slot that pulls again gives back what it held (it lost it); a worker
that stops heartbeating, or is excluded, loses what it held: its requests go back to the
head of the queue. A request whose client hung up or timed out is dropped (a worker that answers it
later is still paid for verified work: it did what it was asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from covey.coordinator.rejected import Rejected
from covey.serve.wire import Job

SWEEP_S = 0.5  # how often a waiting worker's long-poll looks for requeued jobs


class Busy(Rejected):
    """Every worker is busy and the queue is full: 429 with Retry-After (host_app)."""


@dataclass
class Pending:
    job: Job
    future: asyncio.Future[Any]
    created: float = field(default_factory=time.monotonic)
    worker: str | None = None
    slot: int = 0  # which of its worker's slots holds it
    dropped: bool = False  # the client is gone: nobody waits for the answer
    answering: bool = False  # its worker's answer is being recorded
    streamed: list[int] = field(default_factory=list)  # its worker's progress so far
    updates: asyncio.Queue[list[int]] = field(default_factory=asyncio.Queue)  # to the stream


class Dispatcher:
    def __init__(
        self,
        queue_per_worker: int,
        alive: Callable[[str], bool],
        live_after_s: float,
    ) -> None:
        """`alive(peer)`: the worker heartbeats and is not excluded; `live_after_s`: a
        worker that pulled within this long counts as serving."""
        self.queue_per_worker = queue_per_worker
        self.alive = alive
        self.live_after_s = live_after_s
        self.queue: deque[Pending] = deque()
        self.jobs: dict[str, Pending] = {}  # job id -> waiting or held
        self.pulled: dict[str, float] = {}  # worker -> when it last asked
        self.slots: dict[str, set[int]] = {}  # worker -> its slots seen pulling
        self._cond: asyncio.Condition | None = None

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:  # made on the event loop that uses it
            self._cond = asyncio.Condition()
        return self._cond

    def serving(self) -> list[str]:
        """Workers that pulled lately and are alive. Also read by the status and metrics
        handlers from the thread pool while the loop adds pulls: it reads a copy (made in
        one step under the GIL), never the dict the loop changes."""
        now = time.monotonic()
        pulled = tuple(self.pulled.items())
        return [w for w, t in pulled if now - t < self.live_after_s and self.alive(w)]

    def held(self) -> int:
        return sum(1 for p in self.jobs.values() if p.worker is not None)

    def capacity(self, workers: list[str]) -> int:
        """The slots of `workers` (those seen pulling; one for a worker not seen yet)."""
        return sum(len(self.slots.get(w, ())) or 1 for w in workers)

    async def submit(self, job: Job) -> Pending:
        """Queue `job`; Busy (429) past the queue's room, Rejected(503) with no worker."""
        self.sweep()
        serving = self.serving()
        workers = len(serving)
        if workers == 0:
            raise Rejected(503, "no inference worker is serving this model now; retry later")
        idle = max(0, self.capacity(serving) - self.held())
        if len(self.queue) >= idle + self.queue_per_worker * workers:
            raise Busy(429, f"all {workers} workers are busy and {len(self.queue)} requests wait")
        p = Pending(job, asyncio.get_running_loop().create_future())
        self.jobs[job.job_id] = p
        async with self.cond:
            self.queue.append(p)
            self.cond.notify()
        return p

    async def take(self, worker: str, wait_s: float, slot: int = 0) -> Job | None:
        """The oldest waiting job for `worker`'s `slot`, waiting up to `wait_s`; None if
        none came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        self.pulled[worker] = time.monotonic()
        self.slots.setdefault(worker, set()).add(slot)
        self.release(worker, slot)  # a slot pulls when it is free: what it held was lost
        async with self.cond:
            while True:
                self.sweep()
                while self.queue and self.queue[0].dropped:
                    self.jobs.pop(self.queue.popleft().job.job_id, None)
                if self.queue:
                    p = self.queue.popleft()
                    p.worker, p.slot = worker, slot
                    return p.job
                left = deadline - loop.time()
                if left <= 0:
                    return None
                # at most SWEEP_S at a time: a dead worker's jobs are requeued meanwhile
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await asyncio.wait_for(self.cond.wait(), min(left, SWEEP_S))
                self.pulled[worker] = time.monotonic()

    def release(self, worker: str, slot: int | None = None) -> None:
        """What `worker` (its `slot`; None: every slot) holds and is not answering goes back
        to the head of the queue."""
        for p in list(self.jobs.values()):
            if p.worker == worker and slot in (None, p.slot) and not p.answering:
                p.worker = None
                if p.dropped:
                    self.jobs.pop(p.job.job_id, None)
                else:
                    self.queue.appendleft(p)

    def progress(self, p: Pending, tokens: list[int]) -> None:
        """A streamed job's tokens so far: they must extend what came before (ValueError)."""
        if len(tokens) <= len(p.streamed) or tokens[: len(p.streamed)] != p.streamed:
            raise ValueError(f"progress of {len(tokens)} tokens does not extend the last")
        if len(tokens) > p.job.max_tokens:
            raise ValueError(f"progress of {len(tokens)} tokens, over max_tokens")
        p.streamed = list(tokens)
        p.updates.put_nowait(p.streamed)

    def holder(self, job_id: str) -> Pending | None:
        return self.jobs.get(job_id)

    def finish(self, p: Pending, result: Any) -> None:
        """The job is answered: its waiter (if still there) gets `result`."""
        self.jobs.pop(p.job.job_id, None)
        if not p.future.done():
            p.future.set_result(result)

    def drop(self, p: Pending) -> None:
        """The client hung up or timed out: nobody waits for this job any more."""
        p.dropped = True
        if p.worker is None or p.future.done():
            self.jobs.pop(p.job.job_id, None)
            if p in self.queue:
                self.queue.remove(p)
        if not p.future.done():
            p.future.cancel()

    def sweep(self) -> None:
        """Jobs held by a worker that is dead or excluded go back to the head of the queue
        (or are forgotten, if their client is gone)."""
        for p in list(self.jobs.values()):
            if p.worker is None or self.alive(p.worker):
                continue
            self.pulled.pop(p.worker, None)
            self.slots.pop(p.worker, None)
            p.worker = None
            if p.dropped:
                self.jobs.pop(p.job.job_id, None)
            else:
                self.queue.appendleft(p)
