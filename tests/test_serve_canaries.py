"""Serving validators are checked too (covey.serve.canaries): the run owner's house worker
answers some of the server's own house requests with a bad answer that looks like any;
a validator that agrees with every answer without checking passes such canaries and
loses stake (missed fraud); a diligent one catches them and is never charged; no user
ever gets a canary answer; the ledger, house canary reveals included, replays. Real
sockets: the server on uvicorn in a thread, a house worker and two validators in
threads."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from covey.config import TrustConfig
from covey.trust.identity import Identity
from tests.rl_helpers import stop, wait_for
from tests.serve_helpers import funded, tiny_served_model
from tests.test_serve import _job, _thread, in_process_server

HOUSE = [
    {"prompt": "Once upon a time", "max_tokens": 6},
    {"prompt": "The cat sat", "max_tokens": 6, "temperature": 0.7},
    {"prompt": "Hello there", "max_tokens": 6, "top_p": 0.9},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_served_model(tmp_path_factory.mktemp("canaries") / "model")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_house_requests_and_canary_draws_are_the_owners_secret() -> None:
    from covey.trust.house import house_canary_draw, house_request_id, is_house_request

    owner, other = Identity.generate(), Identity.generate()
    run, worker = "run-1", Identity.generate().peer_id
    ids = [house_request_id(owner, run, secrets.token_hex(8)) for _ in range(200)]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert all(is_house_request(owner, run, i) for i in ids)
    assert not any(is_house_request(other, run, i) for i in ids)  # another key: random ids
    assert not any(is_house_request(owner, "run-2", i) for i in ids)
    users = [secrets.token_hex(16) for _ in range(200)]  # how the server draws a user's id
    # a user's request is never a canary, even at rate 1
    assert not any(house_canary_draw(owner, run, u, worker, 1.0) for u in users)
    drawn = sum(house_canary_draw(owner, run, i, worker, 0.3) is not None for i in ids)
    assert 30 <= drawn <= 90, drawn  # about 0.3 of 200 house requests
    assert all(house_canary_draw(owner, run, i, worker, 0.0) is None for i in ids)


def test_a_serving_reveal_verifies_only_with_the_draw_over_its_own_request(
    tmp_path: Path,
) -> None:
    """The book (what `covey ledger verify` replays) takes a serving canary's reveal only
    when its draw is the coordinator's signature over the request it names; the genuine
    one convicts the answer, and the validator that agreed on it owes a missed fraud."""
    from covey.trust.house import (
        house_canary_draw,
        house_identity,
        house_proof,
        house_request_id,
    )
    from covey.trust.ledger import LedgerError
    from tests.test_ledger import Run

    run, run_id = Run(tmp_path), "r" * 16
    house = house_identity(run.coord, run_id, 0)
    run.add("join", peer_id=house.peer_id, public_key=house.public_key, name="h", role="worker")
    run.add("stake", peer_id=house.peer_id, amount=10.0)
    validator = run.join("v", "validator")
    run.add("verification", round=7, peer_id=house.peer_id, validator_id=validator,
            outcome="agree", distance=None, exact=True)  # fmt: skip
    request = house_request_id(run.coord, run_id, "0123456789abcdef")
    other = house_request_id(run.coord, run_id, "fedcba9876543210")
    draw = house_canary_draw(run.coord, run_id, request, house.peer_id, 1.0)
    assert draw is not None

    def reveal(**change: object) -> None:
        payload = dict(round=7, peer_id=house.peer_id, draw=draw, request=request,
                       proof=house_proof(run.coord, run_id, house.peer_id),
                       outcome="convicted", detail="sampling: 1 of 6 tokens")  # fmt: skip
        run.add("house canary", **{**payload, **change})

    with pytest.raises(LedgerError, match="draw is not the coordinator's signature"):
        reveal(request=other)  # the draw of one request shown for another
    with pytest.raises(LedgerError, match="draw is not the coordinator's signature"):
        reveal(request=None)  # nor over the answer's number
    with pytest.raises(LedgerError, match="is not a request id"):
        reveal(request="zz" * 16)
    with pytest.raises(LedgerError, match="proof is not the coordinator's signature"):
        reveal(proof=house_proof(Identity.generate(), run_id, house.peer_id))
    assert run.book.accounts[house.peer_id].banned is False
    reveal()
    assert run.book.accounts[house.peer_id].banned
    assert run.book.missed_fraud_due(7, validator)
    assert run.book.accounts[validator].canaries_passed == 1


def test_a_canary_answer_is_well_formed_and_fails_the_check(model_dir: Path) -> None:
    from covey.rl.proofs import ProofThresholds, compare_proof
    from covey.rl.sampling import prefill
    from covey.serve.checks import check_answer, check_shape
    from covey.serve.house import canary_answer
    from covey.serve.model import load_model, sampler
    from covey.serve.worker import ServeWorker

    model, tok = load_model(model_dir)
    for i, update in enumerate([{}, {"top_p": 0.9}, {"temperature": 0.05}, {"segment": 4}]):
        job = _job(tok, job_id=f"{i:032x}", seed=100 + i, **update)
        honest = ServeWorker.__new__(ServeWorker)
        honest.model, honest.progress = model, lambda *_: None  # type: ignore[method-assign]
        good_tokens, good_proof = ServeWorker.answer(honest, job)
        tokens, proof = canary_answer(model, job)
        assert len(proof) == len(good_proof)  # the same sizes as an honest answer
        assert check_shape(tokens, job.max_tokens, job.eos_id) is None
        assert check_answer(model, job.model_dump(), good_tokens, good_proof).ok
        verdict = check_answer(model, job.model_dump(), tokens, proof)
        assert not verdict.ok and verdict.problem == "sampling", verdict
        # its proof is honestly made for its tokens: only the sampling check tells
        lm = sampler(model, job.top_p, job.temperature)
        _, hidden = prefill(lm, [list(job.prompt_ids) + tokens])[0]
        made = compare_proof(proof, hidden[len(job.prompt_ids) :], ProofThresholds())
        assert made.ok, made.reason


def test_a_validator_that_agrees_without_checking_pays_for_a_house_canary(
    tmp_path: Path, model_dir: Path
) -> None:
    from covey.io.audit import verify
    from covey.serve.cheater import LazyServeValidator
    from covey.serve.checks import check_answer
    from covey.serve.house import HouseServeWorker
    from covey.serve.validator import ServeValidator

    cfg = dict(
        max_tokens=6,
        new_worker_answers=1000,  # every answer is drawn for a check
        heartbeat_s=0.5,
        dead_after_s=3.0,
        pull_wait_s=1.0,
        trust=TrustConfig(canary_rate=0.5, check_reward=0.01),
    )
    data = tmp_path / "server"
    with in_process_server(data, model_dir, house=HOUSE, house_every_s=0.3, **cfg) as (url, s):
        stop = threading.Event()
        worker = HouseServeWorker(url, data / "coordinator.key", model_dir, name="h", stop=stop)
        honest = funded(s, ServeValidator(url, Identity.generate(), model_dir, name="v", stop=stop))
        lazy = funded(
            s, LazyServeValidator(url, Identity.generate(), model_dir, name="lazy", stop=stop)
        )
        threads = [_thread(p.run_loop) for p in (worker, honest, lazy)]
        book = s.accounts.book.accounts
        users: list[str] = []  # the ids of users' requests answered
        try:
            wait_for(lambda: len(s.live_validators(time.time())) == 2, 30)
            http = httpx.Client(base_url=url, timeout=60)

            def both_met_canaries() -> bool:  # users ask meanwhile, like any traffic
                r = http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 6})
                if r.status_code == 200:
                    users.append(r.json()["id"].removeprefix("cmpl-"))
                return book[lazy.identity.peer_id].canaries_passed >= 1 and any(
                    r.get("outcome") == "canary caught" for r in getattr(honest, "reports", [])
                )

            wait_for(both_met_canaries, 150, "each validator to be handed a canary")

            def revealed() -> set[str]:  # a caught canary is revealed once the referee agrees
                entries = s.accounts.entries(0, 100_000)
                return {e["payload"]["outcome"] for e in entries if e["type"] == "house canary"}

            wait_for(lambda: {"caught", "convicted"} <= revealed(), 60, "both reveals")
            lazy_account, honest_account = (
                book[lazy.identity.peer_id],
                book[honest.identity.peer_id],
            )
            # the lazy one paid a missed fraud per canary it passed; the honest one nothing
            assert lazy_account.slashed > 0 and lazy_account.canaries_passed >= 1
            assert honest_account.canaries_passed == 0 and honest_account.slashed == 0
            assert honest_account.false_accusations == 0
            ledger = s.accounts.entries(0, 100_000)
            penalties = [
                e["payload"]
                for e in ledger
                if e["type"] == "penalty" and e["payload"]["peer_id"] == lazy.identity.peer_id
            ]
            assert penalties and {p["kind"] for p in penalties} == {"missed fraud"}
            reveals = [e["payload"] for e in ledger if e["type"] == "house canary"]
            assert {"caught", "convicted"} <= {r["outcome"] for r in reveals}
            assert all(r["request"] in worker.canaries for r in reveals)
            assert worker.index >= 1  # its burned keys: it moved on to the next
            counts = httpx.get(f"{url}/v1/serve/status").json()["canaries"]
            assert counts.get("convicted", 0) >= 1 and counts.get("caught", 0) >= 1, counts
            # no user got a canary answer: every answer a user got passes the check
            assert users and not set(users) & set(worker.canaries)
            marks = ",".join("?" * len(users))
            rows = s.db.query(
                f"SELECT job, tokens, proof FROM serve_answers WHERE job_id IN ({marks})",
                tuple(users),
            )
            assert len(rows) == len(users)
            for r in rows:
                job, tokens = json.loads(r["job"]), json.loads(r["tokens"])
                verdict = check_answer(s.model, job, tokens, bytes.fromhex(r["proof"]))
                assert verdict.ok, verdict
        finally:
            stop.set()
            for t in threads:
                t.join(20)
        audit = verify(url)  # house canary reveals, penalties and check pay replay
        assert audit.summary["accounts"][lazy.identity.peer_id]["slashed"] > 0


def test_house_requests_bad_input_exits_2_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "house.jsonl"
    bad.write_text('{"prompt": "Once", "max_tokens": 6}\n{"max_tokens": 6}\n')
    done = subprocess.run(
        [sys.executable, "-m", "covey", "serve", "server", "--data-dir", str(tmp_path / "s"),
         "--house-requests", str(bad)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "house request on line 2" in done.stderr, done.stderr


@pytest.mark.network
@pytest.mark.long
def test_house_canaries_with_real_processes(tmp_path: Path) -> None:
    """`covey serve server --house-requests`, `covey serve worker --house-of` and a
    validator as processes: the validator catches house canaries and passes none, the house
    worker goes on under its next keys, `covey ledger verify` replays."""
    from tests.serve_helpers import peer_process, server_process

    model = tiny_served_model(tmp_path / "model")
    house = tmp_path / "house.jsonl"
    house.write_text("\n".join(json.dumps(b) for b in HOUSE) + "\n")
    sets = ("new_worker_answers=1000", "max_tokens=6", "trust.canary_rate=0.5")
    extra = ("--house-requests", str(house), "--house-every", "0.3")
    with server_process(tmp_path, model, sets, extra) as (url, _):
        key = ("--house-of", str(tmp_path / "server" / "coordinator.key"))
        procs = [
            peer_process(tmp_path, url, model, "worker", "house", extra=key),
            peer_process(tmp_path, url, model, "validator", "v"),
        ]
        try:
            http = httpx.Client(base_url=url, timeout=60)

            def caught() -> bool:
                http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 6})
                return http.get("/v1/serve/status").json()["canaries"].get("caught", 0) >= 2

            wait_for(caught, 240, "the validator to catch two house canaries")
            status = http.get("/v1/serve/status").json()
            assert status["canaries"].get("convicted", 0) == 0  # it never passed one
            assert len(status["excluded"]) >= 2  # two house keys burned: it moved on
            verified = subprocess.run(
                [sys.executable, "-m", "covey", "ledger", "verify", url],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert verified.returncode == 0, verified.stdout + verified.stderr
        finally:
            for p in procs:
                stop(p)
