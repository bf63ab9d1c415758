"""A serving worker answers several requests at a time (its slots, at most the run's
worker_slots): each slot holds one request, the router counts slots in its load and
backpressure, a slot that pulls again gives back only its own request, and a request's
seeded answer does not depend on what else its worker answers meanwhile. Real sockets: the
server on uvicorn in a thread (tests.test_serve.in_process_server)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.trust.identity import Identity
from tests.rl_helpers import wait_for
from tests.serve_helpers import funded, tiny_served_model
from tests.test_serve import _join_worker, _signed, _thread, in_process_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_served_model(tmp_path_factory.mktemp("slots") / "model")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _status(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/serve/status").json()


def test_each_slot_holds_one_request_and_backpressure_counts_slots(
    tmp_path: Path, model_dir: Path
) -> None:
    """Three slots of one worker hold three requests; a fourth waits (queue_per_worker 1);
    a fifth gets 429. A slot past worker_slots is refused; a slot that pulls again gives back
    its own request, not its neighbours', which the worker still answers."""
    # the requests left held at the end get their 504 soon: the server then stops at once
    cfg = dict(max_tokens=2, worker_slots=3, queue_per_worker=1, request_timeout_s=6.0)
    with in_process_server(tmp_path / "server", model_dir, **cfg) as (url, s):
        http = httpx.Client(base_url=url, timeout=30)
        me = Identity.generate()
        _join_worker(http, s, me)
        done = threading.Event()

        def beat() -> None:
            while not done.wait(0.5):
                body = {"run_id": s.run_id, "peer_id": me.peer_id}
                http.post("/v1/heartbeat", json=_signed(me, "/v1/heartbeat", body))

        def pull(slot: int) -> httpx.Response:
            body = {"run_id": s.run_id, "peer_id": me.peer_id, "slot": slot}
            return http.post("/v1/serve/pull", json=_signed(me, "/v1/serve/pull", body))

        _thread(beat)
        assert pull(3).status_code == 409  # the run's workers have 3 slots: 0, 1, 2
        jobs: dict[int, Any] = {}
        pullers = [_thread(lambda i=i: jobs.update({i: pull(i).json()["job"]})) for i in range(3)]
        wait_for(lambda: _status(url)["slots"] == 3, 10, "three slots pulling")
        ask = {"prompt": "x", "max_tokens": 2}
        users: dict[int, httpx.Response] = {}
        for i in range(3):
            _thread(lambda i=i: users.update({i: http.post("/v1/completions", json=ask)}))
        for p in pullers:
            p.join(10)
        assert all(jobs[i] is not None for i in range(3)), jobs
        assert len({j["job_id"] for j in jobs.values()}) == 3  # one request per slot
        assert _status(url)["held"] == 3
        _thread(lambda: users.update({3: http.post("/v1/completions", json=ask)}))
        wait_for(lambda: _status(url)["waiting"] == 1, 5, "the fourth request to wait")
        busy = http.post("/v1/completions", json=ask)
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        # slot 0 pulls again: its request goes back to the head of the queue (and to it)
        again = pull(0).json()["job"]
        assert again["job_id"] == jobs[0]["job_id"]
        # slot 1 still holds its request: the worker's answer to it is taken
        token = next(t for t in range(3, 300) if t != jobs[1]["eos_id"])
        from covey.rl.proofs import proof_size

        body = {"run_id": s.run_id, "peer_id": me.peer_id, "job_id": jobs[1]["job_id"]}
        body |= {"tokens": [token, token], "proof": "00" * proof_size(2, s.hidden_size)}
        answered = http.post("/v1/serve/answer", json=_signed(me, "/v1/serve/answer", body))
        assert answered.status_code == 200, answered.text
        wait_for(lambda: any(r.status_code == 200 for r in users.values()), 10, "an answer")
        assert _status(url)["held"] == 2  # slots 0 and 2
        metrics = httpx.get(f"{url}/metrics").text
        assert "covey_serve_slots 3.0" in metrics and "covey_serve_held 2.0" in metrics
        done.set()


def test_a_worker_answers_requests_at_once_each_as_if_alone(
    tmp_path: Path, model_dir: Path
) -> None:
    """A worker with three slots answers three requests at once (its answers wait on one
    barrier: a worker answering one at a time would break it), and a seeded request's
    answer is the same as when it was answered alone; the validator clears every answer."""
    from covey.serve.validator import ServeValidator
    from covey.serve.worker import ServeWorker

    barrier = threading.Barrier(3, timeout=30)
    together = threading.Event()

    class Gathered(ServeWorker):
        def answer(self, job: Any) -> Any:
            if together.is_set():
                barrier.wait()  # BrokenBarrierError unless three answers run at once
            return super().answer(job)

    cfg = dict(
        max_tokens=8,
        worker_slots=3,
        new_worker_answers=50,
        heartbeat_s=0.5,
        dead_after_s=3.0,
        pull_wait_s=1.0,
    )
    with in_process_server(tmp_path / "server", model_dir, **cfg) as (url, s):
        stop = threading.Event()
        worker = funded(s, Gathered(url, Identity.generate(), model_dir, name="w", stop=stop))
        validator = funded(
            s, ServeValidator(url, Identity.generate(), model_dir, name="v", stop=stop)
        )
        threads = [_thread(worker.run_loop), _thread(validator.run_loop)]
        try:
            wait_for(lambda: _status(url)["slots"] == 3, 30, "the worker's three slots")
            http = httpx.Client(base_url=url, timeout=60)
            ask = {"prompt": "Once upon", "max_tokens": 8, "seed": 7, "temperature": 1.0}
            alone = http.post("/v1/completions", json=ask).json()["choices"][0]["text"]
            together.set()
            out: dict[int, httpx.Response] = {}
            asks = [ask, {**ask, "seed": 8}, {**ask, "prompt": "A cat"}]
            users = [
                _thread(lambda i=i, a=a: out.update({i: http.post("/v1/completions", json=a)}))
                for i, a in enumerate(asks)
            ]
            for u in users:
                u.join(60)
            assert all(out[i].status_code == 200 for i in range(3)), out
            assert out[0].json()["choices"][0]["text"] == alone
            assert not barrier.broken
            wait_for(
                lambda: _status(url)["answers"].get("accepted", 0) == 4,
                60,
                "the validator to clear all four answers",
            )
            assert not s.accounts.book.accounts[worker.identity.peer_id].banned
        finally:
            stop.set()
            for t in threads:
                t.join(20)
