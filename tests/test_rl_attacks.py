"""Dishonest rollout workers and validators against a real RL trainer on 127.0.0.1.

Every field a worker or validator sends is an attack surface: each forged value must be a
4xx naming the field and change nothing, or end in a ledger verdict that rests on the
trainer's recomputation. One trainer per module; the validator here is driven by hand
(claim, report) so that each attack meets exactly the batch it targets.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.blobs import BlobStore
from covey.rl.batch import RolloutBatch
from covey.rl.validator import RolloutValidator
from covey.rl.worker import RolloutWorker
from covey.trust.identity import NO_ROUND, Identity, request_purpose, verify
from tests.rl_helpers import (
    fund,
    join_funded,
    joined_worker,
    ledger,
    policy,
    trainer_process,
    wait_for,
)

pytestmark = pytest.mark.network
DATA_DIRS: dict[str, Path] = {}  # trainer URL -> its data directory (its key is in it)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("rl-attacks") / "run"
    with trainer_process(d) as url:
        DATA_DIRS[url] = d
        yield url


@pytest.fixture(scope="module")
def checker(trainer: str) -> Iterator[RolloutValidator]:
    """A live validator that claims and reports only when a test tells it to."""
    v = RolloutValidator(trainer, Identity.generate(), name="v-manual")
    join_funded(trainer, v, "validator")
    try:
        yield v
    finally:
        v.membership.leave("shutdown")


def signed(ident: Identity, path: str, body: dict[str, Any], rnd: int = NO_ROUND) -> dict:
    return ident.sign_request(body, rnd, purpose=request_purpose(path))


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    data = json.dumps(body)  # a dishonest peer sends NaN and Infinity literals too
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}{path}", content=data, headers=headers, timeout=30)


def batches(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/v1/rl/batches").json()


def entries(url: str, *about: str) -> int:
    """Ledger entries (those naming one of `about` in their payload, when given): a
    trainer step may add its own entries at any time."""
    rows = httpx.get(f"{url}/v1/ledger", params={"limit": 5000}).json()
    if about:
        rows = [e for e in rows if set(map(str, e["payload"].values())) & set(about)]
    return len(rows)


def honest_body(url: str, w: RolloutWorker) -> tuple[dict[str, Any], int]:
    info = policy(url)
    batch = w.make_batch(w.policies.model(info["cid"], [url]), info["version"], info["cid"])
    assert batch is not None
    body = {"run_id": w.run.run_id, "peer_id": w.identity.peer_id}
    return {**body, "batch": batch.model_dump(mode="json")}, info["version"]


def with_batch(body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**body, "batch": {**body["batch"], **fields}}


def with_sample(body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    samples = [dict(s) for s in body["batch"]["samples"]]
    samples[0] |= fields
    return with_batch(body, samples=samples)


def claim(url: str, v: RolloutValidator) -> dict[str, Any] | None:
    body = {"run_id": v.run.run_id, "peer_id": v.identity.peer_id}
    r = post(url, "/v1/rl/claim", signed(v.identity, "/v1/rl/claim", body))
    assert r.status_code == 200, r.text
    return r.json()["task"]


def report(url: str, v: RolloutValidator, cid: str, **fields: Any) -> httpx.Response:
    body = {"run_id": v.run.run_id, "peer_id": v.identity.peer_id, "batch_cid": cid, **fields}
    return post(url, "/v1/rl/report", signed(v.identity, "/v1/rl/report", body))


def test_every_submitted_field_a_worker_could_forge_is_refused(
    trainer: str, checker: RolloutValidator
) -> None:
    w = joined_worker(trainer)
    body, v = honest_body(trainer, w)
    me, path = w.identity, "/v1/rl/batch"
    n_batches, n_entries = len(batches(trainer)), entries(trainer)
    bad_proof = "not base64!"
    # (the body sent, the round signed, the status expected, what the error must name)
    attacks: list[tuple[str, dict[str, Any], int, int, str]] = [
        ("future step", with_batch(body, step=v + 1, policy_version=v + 1), v + 1, 409, "step"),
        (
            "another policy version",
            with_batch(body, policy_version=v + 1),
            v,
            409,
            "policy_version",
        ),
        ("another policy", with_batch(body, policy_cid="0" * 64), v, 409, "policy_cid"),
        ("another run in the batch", with_batch(body, run_id="f" * 16), v, 409, "batch.run_id"),
        ("another run", {**body, "run_id": "f" * 16}, v, 409, "run"),
        ("huge G", with_batch(body, group_size=10**9), v, 422, "batch.group_size"),
        ("negative step", with_batch(body, step=-1), -1, 422, "batch.step"),
        ("NaN logprob", with_sample(body, logprobs=[math.nan]), v, 422, "logprobs"),
        ("infinite logprob", with_sample(body, logprobs=[-math.inf]), v, 422, "logprobs"),
        ("NaN reward", with_sample(body, reward=math.nan), v, 422, "reward"),
        ("infinite reward", with_sample(body, reward=math.inf), v, 422, "reward"),
        ("proof not base64", with_sample(body, proof=bad_proof), v, 422, "proof"),
        ("an extra field", with_sample(body, note="\u202etrust me"), v, 422, "note"),
        ("unicode ids", with_batch(body, policy_cid="\u00e9" * 64), v, 409, "policy_cid"),
    ]
    for what, attack, rnd, status, field in attacks:
        r = post(trainer, path, signed(me, path, attack, rnd))
        text = r.text
        assert r.status_code == status, f"{what}: {r.status_code} {text[:300]}"
        assert field in text, f"{what}: the error does not name {field!r}: {text[:300]}"
    # a signature over other bytes: the honest body signed, then one reward edited
    forged = signed(me, path, body, v)
    forged["batch"]["samples"][1]["reward"] = -5.0
    assert post(trainer, path, forged).status_code == 401
    # a validator's key cannot submit, an unknown key neither
    stranger = Identity.generate()
    r = post(trainer, path, signed(stranger, path, {**body, "peer_id": stranger.peer_id}, v))
    assert r.status_code == 404 and "join" in r.text
    vbody = {**body, "peer_id": checker.identity.peer_id}
    r = post(trainer, path, signed(checker.identity, path, vbody, v))
    assert r.status_code == 403 and "validator" in r.text
    assert len(batches(trainer)) == n_batches and entries(trainer) == n_entries  # nothing changed
    w.membership.leave()


def test_validator_cannot_report_unassigned_twice_or_falsely(
    trainer: str, checker: RolloutValidator
) -> None:
    w = joined_worker(trainer)
    body, v = honest_body(trainer, w)
    r = post(trainer, "/v1/rl/batch", signed(w.identity, "/v1/rl/batch", body, v))
    assert r.status_code == 200, r.text
    cid = r.json()["cid"]
    # a worker cannot claim or report; a report before the claim is refused
    wb = {"run_id": w.run.run_id, "peer_id": w.identity.peer_id}
    r = post(trainer, "/v1/rl/claim", signed(w.identity, "/v1/rl/claim", wb))
    assert r.status_code == 403
    other = RolloutValidator(trainer, Identity.generate(), name="v-other")
    join_funded(trainer, other, "validator")
    before = entries(trainer)
    r = report(trainer, checker, cid, ok=True)
    assert r.status_code == 409 and "not assigned" in r.text
    try:
        # the batch goes to one of the two by rank; the other cannot report on it
        def assigned() -> tuple[RolloutValidator, RolloutValidator] | None:
            for a, b in ((checker, other), (other, checker)):
                if (task := claim(trainer, a)) is not None:
                    assert task["batch_cid"] == cid
                    return a, b
            return None

        mine, stranger = wait_for(assigned, 10, "an assignment")
        r = report(trainer, stranger, cid, ok=False, problem="sampling", detail="made up")
        assert r.status_code == 409 and "not assigned" in r.text
        assert entries(trainer) == before  # nothing changed so far
        # the assigned validator rejects the honest batch with a made-up reason and sample
        r = report(trainer, mine, cid, ok=False, problem="proof", detail="\u2603", sample=10**12)
        assert r.status_code == 200, r.text
        assert r.json()["outcome"] == "false accusation" and r.json()["accepted"] is True
        # reporting again (either way) is refused and records nothing
        ids = (cid, w.identity.peer_id, mine.identity.peer_id)
        after = entries(trainer, *ids)
        assert report(trainer, mine, cid, ok=True).status_code == 409
        assert report(trainer, mine, cid, ok=False, problem="reward").status_code == 409
        assert entries(trainer, *ids) == after
        accuser = mine.identity.peer_id
    finally:
        other.membership.leave("shutdown")
    penalties = ledger(trainer, "penalty", accuser)
    [penalty] = [p for p in penalties if cid[:12] in p["payload"]["reason"]]
    assert penalty["payload"]["kind"] == "false accusation"
    assert not ledger(trainer, "slash", w.identity.peer_id)  # the honest worker keeps its stake
    [paid] = ledger(trainer, "reward", w.identity.peer_id)
    assert paid["payload"]["kind"] == "work"
    w.membership.leave()


def test_out_of_vocabulary_tokens_are_rejected_by_recomputation(
    trainer: str, checker: RolloutValidator
) -> None:
    """Token ids no model has (negative, beyond any vocabulary) pass the schema; the
    verdict rests on the check, and a validator that waves them through is caught."""
    w = joined_worker(trainer)
    body, v = honest_body(trainer, w)
    tokens = list(body["batch"]["samples"][0]["tokens"])
    tokens[0] = -(2**62)
    attack = with_sample(body, tokens=tokens)
    r = post(trainer, "/v1/rl/batch", signed(w.identity, "/v1/rl/batch", attack, v))
    assert r.status_code == 200, r.text
    cid = r.json()["cid"]
    task = wait_for(lambda: claim(trainer, checker), 10, "the checker's assignment")
    assert task["batch_cid"] == cid
    r = report(trainer, checker, cid, ok=True)  # lazy: audit_rate 1.0 re-checks it
    assert r.status_code == 200 and r.json()["accepted"] is False, r.text
    row = next(b for b in batches(trainer) if b["cid"] == cid)
    assert row["status"] == "rejected" and row["problem"] == "tokens", row
    assert ledger(trainer, "slash", w.identity.peer_id)
    assert not ledger(trainer, "reward", w.identity.peer_id)
    # excluded: joining again with the same key is refused
    r = post(
        trainer, "/v1/join", signed(w.identity, "/v1/join", join_body(trainer, w.identity), -1)
    )
    assert r.status_code == 403 and "excluded" in r.text
    w.membership.leave()


def join_body(url: str, ident: Identity, **fields: Any) -> dict[str, Any]:
    run_id = httpx.get(f"{url}/v1/run").json()["run_id"]
    body = {"peer_id": ident.peer_id, "public_key": ident.public_key, "step_time_s": 1.0}
    return {"run_id": run_id, **body, "name": "w", "stake": 1.0, **fields}


def test_join_fields_a_peer_could_forge_are_refused(
    trainer: str, checker: RolloutValidator
) -> None:
    me, n = Identity.generate(), entries(trainer)
    path, vpath = "/v1/join", "/v1/rl/validators/join"
    good = join_body(trainer, me)
    attacks: list[tuple[str, str, dict[str, Any], int, str]] = [
        (
            "a key that is not the id's",
            path,
            {**good, "public_key": checker.identity.public_key},
            400,
            "public key",
        ),
        ("a unicode name", path, {**good, "name": "w\u202eevil"}, 422, "name"),
        ("NaN stake", path, {**good, "stake": math.nan}, 422, "stake"),
        ("negative stake", path, {**good, "stake": -5.0}, 422, "stake"),
        ("another run", path, {**good, "run_id": "f" * 16}, 409, "run"),
    ]
    for what, where, body, status, field in attacks:
        r = post(trainer, where, signed(me, where, body, -1))
        assert r.status_code == status, f"{what}: {r.status_code} {r.text[:300]}"
        assert field in r.text, f"{what}: the error does not name {field!r}: {r.text[:300]}"
    v = {"run_id": good["run_id"], "validator_id": me.peer_id, "public_key": me.public_key}
    r = post(trainer, vpath, signed(me, vpath, {**v, "stake": 0.5}, -1))
    assert r.status_code == 403 and "minimum stake" in r.text  # a validator must stake
    assert entries(trainer) == n  # nothing recorded for any of these
    # a worker key cannot also validate (no checking its own batches)
    fund(trainer, me.public_key, good["stake"])  # what it stakes, from the run's owner
    assert post(trainer, path, signed(me, path, good, -1)).status_code == 200
    r = post(trainer, vpath, signed(me, vpath, {**v, "stake": 50.0}, -1))
    assert r.status_code == 409 and "registered as a worker" in r.text


def test_a_claim_held_without_a_report_expires_and_a_late_report_is_refused(
    trainer: str, checker: RolloutValidator
) -> None:
    """A validator that hoards its assignment stalls nothing: after verify_timeout_s the
    check is recorded as expired and goes elsewhere (here: the trainer, the only validator
    having tried it); its late verdict changes nothing."""
    w = joined_worker(trainer)
    body, v = honest_body(trainer, w)
    r = post(trainer, "/v1/rl/batch", signed(w.identity, "/v1/rl/batch", body, v))
    assert r.status_code == 200, r.text
    cid = r.json()["cid"]
    task = wait_for(lambda: claim(trainer, checker), 10, "the checker's assignment")
    assert task["batch_cid"] == cid

    def expired() -> list[dict[str, Any]]:
        rows = httpx.get(f"{trainer}/v1/ledger", params={"limit": 5000}).json()
        return [
            e
            for e in rows
            if e["type"] == "verification"
            and e["payload"].get("cid") == cid
            and e["payload"].get("outcome") == "expired"
        ]

    [entry] = wait_for(expired, 30, "the claim to expire")
    assert entry["payload"]["validator_id"] == checker.identity.peer_id
    row = wait_for(
        lambda: next(
            (
                b
                for b in batches(trainer)
                if b["cid"] == cid and b["status"] in ("accepted", "consumed")
            ),
            None,
        ),
        30,
        "the trainer's own check",
    )
    assert row["validator_id"] is None or row["validator_id"] != checker.identity.peer_id
    r = report(trainer, checker, cid, ok=False, problem="sampling", detail="too late")
    assert r.status_code == 409 and "not assigned" in r.text
    w.membership.leave()


@pytest.mark.parametrize("proof", [b"", b"\x00" * 7, b"\xff" * 300])
def test_garbage_proofs_are_a_verdict_not_a_crash(
    trainer: str, checker: RolloutValidator, proof: bytes
) -> None:
    """Proof bytes that are base64 but no proof: the trainer's recomputation rejects the
    batch ("proof") and slashes; the check never raises."""
    w = joined_worker(trainer)
    body, v = honest_body(trainer, w)
    samples = [dict(s) for s in body["batch"]["samples"]]
    samples = [{**s, "proof": base64.b64encode(proof).decode()} for s in samples]
    attack = with_batch(body, samples=samples)
    r = post(trainer, "/v1/rl/batch", signed(w.identity, "/v1/rl/batch", attack, v))
    assert r.status_code == 200, r.text
    cid = r.json()["cid"]
    task = wait_for(lambda: claim(trainer, checker), 10, "the checker's assignment")
    assert task["batch_cid"] == cid
    r = report(trainer, checker, cid, ok=True)  # audit_rate 1.0: the trainer checks it all
    assert r.status_code == 200 and r.json()["accepted"] is False, r.text
    row = next(b for b in batches(trainer) if b["cid"] == cid)
    assert row["status"] == "rejected" and row["problem"] == "proof", row
    assert ledger(trainer, "slash", w.identity.peer_id)
    w.membership.leave()


def _old_rank(cid: str, v: str) -> str:
    """The assignment rank as it once was: sha256(cid, validator), which the worker can
    compute, so grind."""
    return hashlib.sha256("|".join(("covey-rl-assign", cid, v)).encode()).hexdigest()


def test_a_worker_cannot_aim_its_batch_at_a_chosen_validator(
    trainer: str, checker: RolloutValidator
) -> None:
    """The validator ranking rests on the trainer's signature over (run, cid), which the
    worker cannot compute: grinding its batch's bytes until the cid-only rank picks a
    colluder no longer works. (The test reads the trainer's key to grind for the worst
    case: old rank -> checker, signed rank -> the other validator.)"""
    from covey.rl.intake import assign_rank

    key = Identity.load_or_create(DATA_DIRS[trainer] / "trainer.key")
    other = RolloutValidator(trainer, Identity.generate(), name="v-second")
    join_funded(trainer, other, "validator")
    w = joined_worker(trainer)
    try:
        body, v = honest_body(trainer, w)
        pair = (checker.identity.peer_id, other.identity.peer_id)
        for j in range(1000):  # each try is a hash: a cheater's grinding, at no cost
            # an edited reward: never a value the task pays (0, format_reward, 1)
            attack = with_sample(body, reward=0.5 + j / 4000)
            batch = RolloutBatch.model_validate(attack["batch"])
            cid = hashlib.sha256(batch.model_dump_json().encode()).hexdigest()
            draw = key.sign(f"covey-rl-assign/v1\n{w.run.run_id}\n{cid}".encode())
            old = min(pair, key=lambda x: _old_rank(cid, x))
            new = min(pair, key=lambda x: assign_rank(draw, x))
            if old == pair[0] and new == pair[1]:
                break
        else:
            raise AssertionError("no grinding result in 1000 tries")
        r = post(trainer, "/v1/rl/batch", signed(w.identity, "/v1/rl/batch", attack, v))
        assert r.status_code == 200 and r.json()["cid"] == cid, r.text
        [row] = [b for b in batches(trainer) if b["worker_id"] == w.identity.peer_id]
        assert row == {**row, "status": "pending", "cid": None, "validator_id": None}
        assert claim(trainer, checker) is None  # the colluder the worker aimed at
        task = wait_for(lambda: claim(trainer, other), 10, "the signed rank's assignment")
        assert task["batch_cid"] == cid and task["assign_draw"] == draw
        message = f"covey-rl-assign/v1\n{w.run.run_id}\n{cid}".encode()
        assert verify(w.run.trainer_key, message, task["assign_draw"])  # auditable
        [row] = [b for b in batches(trainer) if b["worker_id"] == w.identity.peer_id]
        assert row["status"] == "pending" and row["validator_id"] is None  # who: secret
        r = report(trainer, other, cid, ok=False, problem="reward", detail="edited reward")
        assert r.status_code == 200 and r.json()["outcome"] == "caught", r.text
    finally:
        other.membership.leave("shutdown")
        w.membership.leave()


def test_report_words_that_would_reach_the_ledger_must_be_plain(
    trainer: str, checker: RolloutValidator
) -> None:
    n = entries(trainer)
    cid = "ab" * 32
    attacks = [
        ("an unknown problem", {"ok": False, "problem": "you are fired"}, "problem"),
        ("a terminal escape", {"ok": False, "problem": "proof", "detail": "\x1b[2J"}, "detail"),
        ("a bidi override", {"ok": False, "detail": "\u202eevil"}, "detail"),
        ("a newline", {"ok": True, "detail": "ok\nINVALID"}, "detail"),
    ]
    for what, fields, name in attacks:
        r = report(trainer, checker, cid, **fields)
        assert r.status_code == 422, f"{what}: {r.status_code} {r.text[:300]}"
        assert name in r.text, f"{what}: the error does not name {name!r}: {r.text[:300]}"
    assert entries(trainer) == n


class _Flood(http.server.BaseHTTPRequestHandler):
    """A peer's "blob server" that streams bytes forever (no Content-Length)."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        deadline = time.monotonic() + 60
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline:
                self.wfile.write(b"\0" * 65536)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_policy_provider_cannot_flood_a_worker_or_crowd_the_list(
    trainer: str, tmp_path: Path
) -> None:
    """The trainer's policy size bounds every fetch (an endless body fails its provider at
    size + 1 bytes, the next provider serves), and at most 4 peers' servers are listed."""
    from covey.rl.peer import PolicyCache
    from covey.rl.trainer import MAX_PEER_PROVIDERS

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flood)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    w = joined_worker(trainer)
    crowd = [Identity.generate() for _ in range(MAX_PEER_PROVIDERS + 3)]
    try:
        flood = f"http://127.0.0.1:{server.server_address[1]}"
        for i, ident in enumerate(crowd):
            fund(trainer, ident.public_key, 1.0)  # each key of the crowd holds its stake
            fields = {"accepts_connections": True, "blob_url": f"{flood}/p{i}"}
            r = post(
                trainer,
                "/v1/join",
                signed(ident, "/v1/join", join_body(trainer, ident, **fields), -1),
            )
            assert r.status_code == 200, r.text
        info = policy(trainer)
        peers = [p for p in info["providers"] if p.startswith(flood)]
        assert len(peers) == MAX_PEER_PROVIDERS and info["providers"][-1] == trainer
        cache = PolicyCache(w.run, BlobStore(tmp_path / "mine"), w.fetcher)
        started = time.monotonic()
        cache.model(info["cid"], [flood, trainer], info["size"])
        assert time.monotonic() - started < 30  # not read forever
        assert (
            cache.store.get(info["cid"]) == httpx.get(f"{trainer}/v1/blobs/{info['cid']}").content
        )
    finally:
        for ident in crowd:
            post(
                trainer,
                "/v1/leave",
                signed(
                    ident,
                    "/v1/leave",
                    {"run_id": w.run.run_id, "peer_id": ident.peer_id, "reason": "done"},
                    -1,
                ),
            )
        w.membership.leave()
        server.shutdown()
