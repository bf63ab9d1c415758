"""The serving mode in one process with real sockets: the server on uvicorn in a thread,
workers and a validator in threads, the official `openai` client; the answer check against
every cheat of covey.serve.cheater; the OpenAI response shapes; and an attacker's messages
(unsigned, forged, replayed, oversize, another's job, forged tokens, wrong roles)."""

from __future__ import annotations

import contextlib
import copy
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from covey.serve import model as served
from covey.serve.checks import check_answer
from covey.serve.config import ServeConfig
from covey.serve.openai_format import finish
from covey.serve.wire import Job
from covey.trust.identity import Identity, request_purpose
from tests.rl_helpers import free_port, wait_for
from tests.serve_helpers import funded, tiny_served_model
from tests.treasury_helpers import fund

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_served_model(tmp_path_factory.mktemp("serve") / "model")


@contextlib.contextmanager
def in_process_server(
    data_dir: Path,
    model: Path,
    house: list[dict[str, Any]] | None = None,
    house_every_s: float = 10.0,
    **cfg: Any,
) -> Iterator[tuple[str, Any]]:
    """A server on uvicorn in a thread; `house`, `house_every_s`: its house requests
    (covey.serve.app.create_app)."""
    import uvicorn

    from covey.serve.app import create_app
    from covey.serve.service import ServeCoordinator

    port = free_port()
    s = ServeCoordinator(ServeConfig(**cfg), data_dir, str(model))
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(s, house, house_every_s), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    s.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ok(f"{url}/healthz"), 30, "the server")
        yield url, s
    finally:
        server.should_exit = True
        thread.join(20)
        s.stop()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _job(tok: Any, **kw: Any) -> Job:
    base = dict(
        job_id="a" * 32,
        prompt_ids=tok.encode("Once upon a time"),
        max_tokens=12,
        temperature=1.0,
        top_p=1.0,
        seed=5,
        eos_id=tok.eos_id,
    )
    return Job(**{**base, **kw})


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread, as a worker runs: the peers of these tests share a process, and
    more threads each on a shared 2-core machine are many times slower. Restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_check_passes_honest_answers_and_catches_every_cheat(model_dir: Path) -> None:
    from covey.serve.cheater import CHEATS, cheat_answer, corrupt
    from covey.serve.worker import ServeWorker

    model, tok = served.load_model(model_dir)
    for top_p in (1.0, 0.8):
        job = _job(tok, top_p=top_p, temperature=0.7, max_tokens=6)
        tokens, proof = ServeWorker.answer(type("W", (), {"model": model})(), job)  # type: ignore[arg-type]
        assert check_answer(model, job.model_dump(), tokens, proof).ok
        assert not check_answer(model, job.model_dump(), tokens[:-1], proof).ok  # shape
        # a streamed job: segments of 3 tokens, each from its own seed
        streamed = job.model_copy(update={"segment": 3})
        seg_tokens, seg_proof = ServeWorker.answer(
            SimpleNamespace(model=model, progress=lambda *_: None), streamed
        )
        assert check_answer(model, streamed.model_dump(), seg_tokens, seg_proof).ok
        if seg_tokens[3:] != tokens[3:]:  # checked as one piece, the later segments fail
            assert not check_answer(model, job.model_dump(), seg_tokens, seg_proof).ok
        for cheat in CHEATS if top_p < 1 else ():  # through the top_p wrapper: every cheat
            bad = corrupt(copy.deepcopy(model), cheat)
            verdict = check_answer(model, job.model_dump(), *cheat_answer(bad, job, cheat))
            assert not verdict.ok, (cheat, top_p)


def test_stop_strings_eos_and_usage() -> None:
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    done = finish([0, 1, 2, 3, 4], decode, None, ["cd"])
    assert (done.text, done.completion_tokens, done.finish_reason) == ("ab", 4, "stop")
    done = finish([0, 1, 9], decode, 9, [])
    assert (done.text, done.completion_tokens, done.finish_reason) == ("ab", 3, "stop")
    # a streamed answer so far holds back what could be the start of a stop string
    assert finish([0, 1, 2], decode, None, ["cx"], partial=True).text == "ab"
    assert finish([0, 1, 2, 3], decode, None, ["cx"], partial=True).text == "abcd"
    assert finish([0, 1, 2], decode, None, ["bc"], partial=True).finish_reason == "stop"
    done = finish([0, 1], decode, 9, [])
    assert (done.text, done.finish_reason, "".join(done.pieces)) == ("ab", "length", "ab")


def _thread(target: Any) -> threading.Thread:
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_openai_client_and_a_caught_cheat_in_process(tmp_path: Path, model_dir: Path) -> None:
    from covey.serve.cheater import CheatingServeWorker
    from covey.serve.validator import ServeValidator
    from covey.serve.worker import ServeWorker

    cfg = dict(
        max_tokens=16,
        new_worker_answers=50,
        heartbeat_s=0.5,
        dead_after_s=3.0,
        stream_segment=4,
        pull_wait_s=1.0,
    )
    with in_process_server(tmp_path / "server", model_dir, **cfg) as (url, s):
        stop = threading.Event()
        honest = funded(
            s, ServeWorker(url, Identity.generate(), model_dir, name="honest", stop=stop)
        )
        cheat = CheatingServeWorker(
            url, Identity.generate(), model_dir, name="cheat", cheat="edited_tokens"
        )
        funded(s, cheat)
        validator = funded(
            s, ServeValidator(url, Identity.generate(), model_dir, name="v", stop=stop)
        )
        threads = [_thread(honest.run_loop), _thread(cheat.run_loop), _thread(validator.run_loop)]
        try:
            wait_for(lambda: httpx.get(f"{url}/v1/serve/status").json()["serving"] == 2, 30)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=6)
            c = client.completions.create(model="serve", prompt="Once", max_tokens=6, seed=1)
            assert c.usage.completion_tokens <= 6 and c.object == "text_completion"
            chat = client.chat.completions.create(
                model="serve", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
            )
            assert chat.choices[0].message.role == "assistant"
            events = list(
                client.completions.create(model="serve", prompt="x", max_tokens=4, stream=True)
            )
            assert events[-1].choices[0].finish_reason in ("stop", "length")
            chunks = list(
                client.chat.completions.create(
                    model="serve",
                    messages=[{"role": "user", "content": "Go"}],
                    max_tokens=12,
                    stream=True,
                    stream_options={"include_usage": True},
                    seed=4,
                )
            )
            assert chunks[0].choices[0].delta.role == "assistant"
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 12

            def caught() -> bool:
                client.completions.create(model="serve", prompt="more", max_tokens=4)
                return s.accounts.book.accounts[cheat.identity.peer_id].banned

            wait_for(caught, 60, "the cheat to be caught")
            wait_for(lambda: cheat.stopped is not None, 20, "the cheat to stop")
            assert not s.accounts.book.accounts[honest.identity.peer_id].banned
            assert "excluded" in cheat.stopped
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model="serve", prompt="x", max_tokens=999)
            from covey.io.audit import verify

            audit = verify(url)  # the ledger replays: pay, the slash, the catch reward
            cheat_account = audit.summary["accounts"][cheat.identity.peer_id]
            assert cheat_account["banned"] and cheat_account["slashed"] > 0
            metrics = httpx.get(f"{url}/metrics").text
            assert "covey_serve_tokens_per_second" in metrics
            assert "covey_serve_answer_seconds_bucket" in metrics
        finally:
            stop.set()
            for t in threads:
                t.join(20)


def _signed(ident: Identity, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return ident.sign_request(body, -1, purpose=request_purpose(path))


def test_attacker_messages_change_nothing(tmp_path: Path, model_dir: Path) -> None:
    from covey.serve.worker import ServeWorker

    with in_process_server(
        tmp_path / "server",
        model_dir,
        max_tokens=8,
        request_timeout_s=30,
        limits={"max_json_bytes": 64 << 10},
        trust={"canary_rate": 0.0},  # the accusation below must meet the real answer
    ) as (url, s):
        http = httpx.Client(base_url=url, timeout=30)
        run = s.run_id
        me, other = Identity.generate(), Identity.generate()
        for ident in (me, other):
            fund(s, ident.public_key, 1.0)  # what it stakes, from the run's owner
            body = {
                "run_id": run,
                "peer_id": ident.peer_id,
                "public_key": ident.public_key,
                "name": "w",
                "stake": 1.0,
                "step_time_s": 1.0,
            }
            assert http.post("/v1/join", json=_signed(ident, "/v1/join", body)).status_code == 200
            http.post(
                "/v1/heartbeat",
                json=_signed(ident, "/v1/heartbeat", {"run_id": run, "peer_id": ident.peer_id}),
            )
        # an honest worker refuses to start on another copy of the model
        other_copy = tmp_path / "other-model"
        shutil.copytree(model_dir, other_copy)
        (other_copy / "config.json").write_text((model_dir / "config.json").read_text() + " ")
        with pytest.raises(ValueError, match="the server serves"):
            ServeWorker(url, Identity.generate(), other_copy)
        # no worker pulled yet: a user's request finds none
        assert (
            http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503
        )
        box: dict[str, Any] = {}

        def pull() -> None:
            box["pull"] = http.post(
                "/v1/serve/pull",
                json=_signed(me, "/v1/serve/pull", {"run_id": run, "peer_id": me.peer_id}),
            ).json()

        puller = _thread(pull)
        wait_for(lambda: s and httpx.get(f"{url}/v1/serve/status").json()["serving"] == 1, 10)
        user = _thread(
            lambda: box.update(
                user=http.post(
                    "/v1/completions", json={"prompt": "Once", "max_tokens": 6, "seed": 3}
                )
            )
        )
        puller.join(20)
        job = Job.model_validate(box["pull"]["job"])
        worker = type("W", (), {"model": s.model})()
        tokens, proof = ServeWorker.answer(worker, job)  # type: ignore[arg-type]
        answer = {
            "run_id": run,
            "peer_id": me.peer_id,
            "job_id": job.job_id,
            "tokens": tokens,
            "proof": proof.hex(),
        }
        path = "/v1/serve/answer"

        def post(body: dict[str, Any]) -> httpx.Response:
            return http.post(path, json=body)

        assert post(answer).status_code == 422  # unsigned: no signature field
        forged = _signed(me, path, answer) | {"tokens": [1, *tokens[1:]]}
        assert post(forged).status_code == 401  # tokens edited after signing
        assert post(_signed(me, "/v1/serve/pull", answer)).status_code == 401  # other endpoint
        assert post(_signed(other, path, answer | {"peer_id": other.peer_id})).status_code == 409
        assert post(_signed(me, path, answer | {"job_id": "b" * 32})).status_code == 409
        assert post(_signed(me, path, answer | {"tokens": tokens * 3})).status_code == 422
        assert post(_signed(me, path, answer | {"proof": proof.hex()[:-2]})).status_code == 422
        big = answer | {"proof": "00" * (40 << 10)}
        assert post(_signed(me, path, big)).status_code == 413  # oversize body
        assert post(_signed(me, path, answer | {"tokens": [10**6]})).status_code == 422
        progress = {k: answer[k] for k in ("run_id", "peer_id", "job_id", "tokens")}
        ppath = "/v1/serve/progress"
        r = http.post(ppath, json=_signed(me, ppath, progress))
        assert r.status_code == 409  # not a streamed job: no progress to send
        # a worker may not claim or report as a validator
        claim = {"run_id": run, "peer_id": me.peer_id}
        r = http.post("/v1/serve/claim", json=_signed(me, "/v1/serve/claim", claim))
        assert r.status_code == 403
        assert s.answers() == 0  # nothing above was recorded
        good = _signed(me, path, answer)
        assert post(good).status_code == 200
        assert post(good).status_code == 401  # the same signed body again: a replay
        assert post(_signed(me, path, answer)).status_code == 409  # answered already
        user.join(30)
        assert box["user"].status_code == 200, box["user"].text
        assert box["user"].json()["usage"]["completion_tokens"] <= 6
        assert s.answers() == 1
        # a pull unsigned, signed by another key, or for another run
        pull = {"run_id": run, "peer_id": me.peer_id}
        assert http.post("/v1/serve/pull", json=pull).status_code == 422
        forged_pull = _signed(other, "/v1/serve/pull", pull)
        assert http.post("/v1/serve/pull", json=forged_pull).status_code == 401
        elsewhere = _signed(me, "/v1/serve/pull", pull | {"run_id": "0" * 16})
        assert http.post("/v1/serve/pull", json=elsewhere).status_code == 409
        # two validators join; the answer's draw assigns it to one of them, the other gets
        # nothing (a new worker's answers are all drawn)
        path = "/v1/serve/validators/join"
        tasks = {}
        pair = (Identity.generate(), Identity.generate())
        for ident in pair:
            fund(s, ident.public_key, 5.0)
            vjoin = {
                "run_id": run,
                "validator_id": ident.peer_id,
                "public_key": ident.public_key,
                "name": "v",
                "stake": 5.0,
            }
            assert http.post(path, json=_signed(ident, path, vjoin)).status_code == 200
        for ident in pair:
            claim = {"run_id": run, "peer_id": ident.peer_id}
            got = http.post("/v1/serve/claim", json=_signed(ident, "/v1/serve/claim", claim))
            tasks[ident.peer_id] = got.json()["task"]
        from covey.serve.assign import assigned

        row = s.db.one("SELECT draw FROM serve_answers WHERE id = 1")
        chosen = assigned(row["draw"], me.peer_id, [i.peer_id for i in pair], [])
        v = next(i for i in pair if i.peer_id == chosen)
        assert [p for p, t in tasks.items() if t is not None] == [chosen]
        task = {"task": tasks[chosen]}
        assert task["task"]["answer_id"] == 1 and task["task"]["tokens"] == tokens
        report = {"run_id": run, "peer_id": v.peer_id, "answer_id": 1, "ok": True}
        rpath = "/v1/serve/report"
        wrong = _signed(v, rpath, report | {"answer_id": 2})
        assert http.post(rpath, json=wrong).status_code == 409  # holds no claim on it
        as_worker = _signed(me, rpath, report | {"peer_id": me.peer_id})
        assert http.post(rpath, json=as_worker).status_code == 403  # a worker is no validator
        # a false accusation: the server's re-check accepts the answer, the validator pays
        accuse = _signed(v, rpath, report | {"ok": False, "problem": "proof"})
        r = http.post(rpath, json=accuse)
        assert r.status_code == 200 and r.json()["outcome"] == "false accusation"
        assert http.post(rpath, json=accuse).status_code == 401  # a replay
        book = s.accounts.book.accounts
        assert not book[me.peer_id].banned and book[me.peer_id].tokens_paid == len(tokens)
        assert book[v.peer_id].stake < 5.0
        # the owner's HALT: users get 503, workers 410, and nothing more is recorded
        halt = {"run_id": run, "owner_key": s.identity.public_key, "reason": "test over"}
        r = http.post("/v1/halt", json=_signed(s.identity, "/v1/halt", halt))
        assert r.status_code == 200, r.text
        wait_for(lambda: s.halt.halted is not None, 10, "the HALT")
        assert (
            http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503
        )
        pull = {"run_id": run, "peer_id": me.peer_id}
        r = http.post("/v1/serve/pull", json=_signed(me, "/v1/serve/pull", pull))
        assert r.status_code == 410


def _join_worker(http: httpx.Client, service: Any, ident: Identity) -> None:
    """Join `ident` as a worker staking 1 credit, which the run's owner deposits first."""
    fund(service, ident.public_key, 1.0)
    body = {
        "run_id": service.run_id,
        "peer_id": ident.peer_id,
        "public_key": ident.public_key,
        "name": "w",
        "stake": 1.0,
        "step_time_s": 1.0,
    }
    assert http.post("/v1/join", json=_signed(ident, "/v1/join", body)).status_code == 200


def test_backpressure_timeout_and_hangup(tmp_path: Path, model_dir: Path) -> None:
    """One worker holds a request and never answers: the next request waits, the one after
    gets 429 with Retry-After, a client that hangs up leaves the queue, and the held one
    gets 504 at request_timeout_s."""
    with in_process_server(
        tmp_path / "server", model_dir, max_tokens=4, queue_per_worker=1, request_timeout_s=5.0
    ) as (url, s):
        http = httpx.Client(base_url=url, timeout=30)
        me = Identity.generate()
        _join_worker(http, s, me)
        done = threading.Event()

        def beat() -> None:
            while not done.wait(0.5):
                body = {"run_id": s.run_id, "peer_id": me.peer_id}
                http.post("/v1/heartbeat", json=_signed(me, "/v1/heartbeat", body))

        _thread(beat)
        box: dict[str, Any] = {}
        pull = {"run_id": s.run_id, "peer_id": me.peer_id}
        puller = _thread(
            lambda: box.update(
                job=http.post("/v1/serve/pull", json=_signed(me, "/v1/serve/pull", pull)).json()[
                    "job"
                ]
            )
        )
        wait_for(
            lambda: httpx.get(f"{url}/v1/serve/status").json()["serving"] == 1,
            10,
            "the worker's first heartbeat and pull",
        )
        ask = {"prompt": "x", "max_tokens": 2}
        streamed = {**ask, "stream": True}  # its worker sends progress, then nothing
        first = _thread(lambda: box.update(first=http.post("/v1/completions", json=streamed)))
        puller.join(10)
        assert box["job"] is not None and box["job"]["segment"] > 0  # held, never answered
        ppath = "/v1/serve/progress"
        step = {"run_id": s.run_id, "peer_id": me.peer_id, "job_id": box["job"]["job_id"]}
        first_token = next(tok for tok in range(3, 300) if tok != box["job"]["eos_id"])

        def progress(tokens: list[int]) -> int:
            body = _signed(me, ppath, step | {"tokens": tokens})
            return http.post(ppath, json=body).status_code

        assert progress([first_token]) == 200
        assert progress([first_token + 1]) == 422  # does not extend what was streamed
        assert progress([first_token] * 3) == 422  # over the job's max_tokens

        def hang_up() -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json=ask, timeout=2.5)  # < request_timeout_s

        second = _thread(hang_up)
        wait_for(lambda: httpx.get(f"{url}/v1/serve/status").json()["waiting"] == 1, 5)
        busy = http.post("/v1/completions", json=ask)
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        second.join(10)
        wait_for(
            lambda: httpx.get(f"{url}/v1/serve/status").json()["waiting"] == 0,
            5,
            "the hung-up request to leave the queue",
        )
        first.join(20)
        events = box["first"].text  # the stream had begun: the timeout is its last event
        assert box["first"].status_code == 200 and '"code":504' in events
        assert events.count("data: ") == 2  # the streamed token's text, then the timeout
        done.set()


def test_a_data_dir_reopens_its_run_and_refuses_another(tmp_path: Path, model_dir: Path) -> None:
    from covey.serve.service import ServeCoordinator

    s = ServeCoordinator(ServeConfig(), tmp_path / "d", str(model_dir))
    run_id = s.run_id
    s.stop()
    again = ServeCoordinator(None, tmp_path / "d", None)  # spec and model from the data dir
    assert again.run_id == run_id and again.model_cid == served.model_cid(model_dir)
    again.stop()
    with pytest.raises(ValueError, match="another spec or model"):
        ServeCoordinator(ServeConfig(verify_rate=0.5), tmp_path / "d", str(model_dir))
    with pytest.raises(ValueError, match="no serving run"):
        ServeCoordinator(None, tmp_path / "empty", None)


def test_a_dead_workers_request_goes_to_another(tmp_path: Path, model_dir: Path) -> None:
    """A worker takes a request and falls silent (no answer, no heartbeat): after
    dead_after_s its request goes back to the queue and another worker answers it."""
    from covey.serve.worker import ServeWorker

    cfg = dict(
        max_tokens=4, heartbeat_s=0.5, dead_after_s=2.0, request_timeout_s=30, pull_wait_s=1.0
    )  # a stopped worker's long-poll ends within a second
    with in_process_server(tmp_path / "server", model_dir, **cfg) as (url, s):
        http = httpx.Client(base_url=url, timeout=30)
        ghost = Identity.generate()
        _join_worker(http, s, ghost)
        beat = {"run_id": s.run_id, "peer_id": ghost.peer_id}
        http.post("/v1/heartbeat", json=_signed(ghost, "/v1/heartbeat", beat))
        box: dict[str, Any] = {}
        pull = {"run_id": s.run_id, "peer_id": ghost.peer_id}
        puller = _thread(
            lambda: box.update(
                job=http.post("/v1/serve/pull", json=_signed(ghost, "/v1/serve/pull", pull)).json()[
                    "job"
                ]
            )
        )
        wait_for(lambda: httpx.get(f"{url}/v1/serve/status").json()["serving"] == 1, 10)
        user = _thread(
            lambda: box.update(
                user=http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 3})
            )
        )
        puller.join(10)
        assert box["job"] is not None  # the ghost holds it, and says nothing more
        stop = threading.Event()
        honest = funded(
            s, ServeWorker(url, Identity.generate(), model_dir, name="honest", stop=stop)
        )
        worker = _thread(honest.run_loop)
        try:
            user.join(25)
            assert box["user"].status_code == 200, box["user"].text
            rows = s.db.query("SELECT worker_id FROM serve_answers")
            assert [r["worker_id"] for r in rows] == [honest.identity.peer_id]
        finally:
            stop.set()
            worker.join(20)
