"""RL roles over real HTTP: a trainer process on 127.0.0.1, rollout workers and
validators talking to it (in this process, or as processes where a kill is the point).

One trainer per module; each test leaves it usable for the next. Policies are covey:nano
(fast on CPU); one accepted batch (2 prompts x G=4) is enough for a trainer step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.blobs import BlobError, BlobServer, BlobStore
from covey.rl.peer import PolicyCache
from covey.rl.policy import PolicyError
from covey.rl.worker import RolloutWorker
from covey.trust.identity import Identity, request_purpose
from tests.rl_helpers import (
    ROOT,
    batch_status,
    decided,
    free_port,
    fund,
    joined_worker,
    ledger,
    policy,
    start_trainer,
    stop,
    trainer_process,
    validator,
    wait_for,
)

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with trainer_process(tmp_path_factory.mktemp("rl") / "run") as url:
        yield url


def test_honest_batch_is_accepted_paid_and_trained_on(trainer: str) -> None:
    with validator(trainer):
        w = joined_worker(trainer)
        v0 = policy(trainer)["version"]
        receipt = w.step(policy(trainer))
        assert receipt is not None
        # the receipt's signed ledger head is kept, and the ledger holds what it names
        [kept] = [json.loads(x) for x in w.heads.path.read_text().splitlines()]
        assert kept == receipt["ledger_head"] and kept["run_id"] == w.run.run_id
        entries = httpx.get(f"{trainer}/v1/ledger", params={"limit": 5000}).json()
        assert entries[kept["length"] - 1]["hash"] == kept["hash"]
        row = wait_for(lambda: decided(trainer, w.identity.peer_id), 30, "a verdict")
        assert row["status"] in ("accepted", "consumed"), row
        wait_for(lambda: policy(trainer)["version"] > v0, 20, "a trainer step")
        wait_for(
            lambda: batch_status(trainer, w.identity.peer_id)[0]["status"] == "consumed",
            10,
            "the batch to be trained on",
        )
        [reward] = ledger(trainer, "reward", w.identity.peer_id)
        assert reward["payload"]["kind"] == "work"
        assert reward["payload"]["tokens"] == row["tokens"] > 0
        status = httpx.get(f"{trainer}/v1/rl/status").json()  # what the status page shows
        assert status["accepted"] >= 1 and status["reward"] and status["pass_at_1"]
        # the decentralization multiplier (covey.rl.costs): the worker's generation and the
        # trainer's step are useful, its check is verification, the fetched batch evidence
        costs = status["costs"]
        assert costs["multiplier"] >= 1.0 and costs["useful_s"] > 0, costs
        assert costs["parts_s"]["verification"] > 0 and costs["evidence_bytes"] > 0, costs
        text = httpx.get(f"{trainer}/metrics").text
        assert "covey_decentralization_multiplier " in text
        assert 'covey_peer_seconds_total{part="verification"}' in text
        assert "/v1/rl/status" in httpx.get(f"{trainer}/").text
        w.membership.leave()


def test_cheating_batch_is_rejected_and_slashed(trainer: str) -> None:
    with validator(trainer) as v:
        w = joined_worker(trainer, "inflated_rewards")
        assert w.step(policy(trainer)) is not None
        row = wait_for(lambda: decided(trainer, w.identity.peer_id), 30, "a verdict")
        assert row["status"] == "rejected" and row["problem"] == "reward", row
        assert ledger(trainer, "slash", w.identity.peer_id)
        assert not ledger(trainer, "reward", w.identity.peer_id)  # never paid
        catches = [
            e
            for e in ledger(trainer, "reward", v.identity.peer_id)
            if e["payload"]["kind"] == "catch"
        ]
        assert len(catches) == 1
        # excluded: its next submission is refused before anything is stored
        info = policy(trainer)
        batch = w.make_batch(w.policies.model(info["cid"], [trainer]), info["version"], info["cid"])
        body = {
            "run_id": w.run.run_id,
            "peer_id": w.identity.peer_id,
            "batch": batch.model_dump(mode="json"),
        }
        r = httpx.post(f"{trainer}/v1/rl/batch", json=_signed(w, body, info["version"]))
        assert r.status_code == 403 and "excluded" in r.json()["error"]
        w.membership.leave()


def test_lazy_validator_is_caught_by_the_audit(trainer: str) -> None:
    with validator(trainer, "lazy") as v:
        w = joined_worker(trainer, "inflated_rewards")
        assert w.step(policy(trainer)) is not None
        row = wait_for(lambda: decided(trainer, w.identity.peer_id), 30, "a verdict")
        assert row["status"] == "rejected", row  # audit_rate 1.0 re-checks every acceptance
        assert ledger(trainer, "slash", w.identity.peer_id)
        [penalty] = ledger(trainer, "penalty", v.identity.peer_id)
        assert penalty["payload"]["kind"] == "missed fraud"  # its own kind, not "canary"
        assert "missed fraud" in penalty["payload"]["reason"]
        w.membership.leave()


def _signed(w: RolloutWorker, body: dict[str, Any], step: int) -> dict[str, Any]:
    return w.identity.sign_request(body, step, purpose=request_purpose("/v1/rl/batch"))


def test_forged_replayed_and_oversized_submissions_are_refused(trainer: str) -> None:
    a, b = joined_worker(trainer), joined_worker(trainer)
    info = policy(trainer)
    model = a.policies.model(info["cid"], [trainer])
    batch = a.make_batch(model, info["version"], info["cid"])
    assert batch is not None
    body = {
        "run_id": a.run.run_id,
        "peer_id": a.identity.peer_id,
        "batch": batch.model_dump(mode="json"),
    }
    before = len(httpx.get(f"{trainer}/v1/rl/batches").json())
    url = f"{trainer}/v1/rl/batch"
    forged = _signed(a, body, info["version"])
    forged["batch"]["samples"][0]["reward"] = 1.0 - forged["batch"]["samples"][0]["reward"]
    assert httpx.post(url, json=forged).status_code == 401
    wrong_round = _signed(a, body, info["version"] + 7)
    assert httpx.post(url, json=wrong_round).status_code == 401
    bad = _signed(a, {**body, "batch": {**body["batch"], "step": -1}}, -1)
    r = httpx.post(url, json=bad)
    assert r.status_code == 422 and any("batch.step" in p for p in r.json()["problems"])
    huge = _signed(a, {**body, "pad": "x" * 300_000}, info["version"])
    assert httpx.post(url, json=huge).status_code == 413
    assert len(httpx.get(f"{trainer}/v1/rl/batches").json()) == before  # nothing changed
    # B resubmits A's batch under its own signature: a replay, refused and slashed
    stolen = _signed(b, {**body, "peer_id": b.identity.peer_id}, info["version"])
    r = httpx.post(url, json=stolen)
    assert r.status_code == 403 and "replay" in r.json()["error"]
    assert ledger(trainer, "slash", b.identity.peer_id)
    ok = _signed(a, body, info["version"])
    assert httpx.post(url, json=ok).status_code == 200
    assert httpx.post(url, json=ok).status_code == 401  # the same request again: nonce spent
    again = _signed(a, body, info["version"])
    assert httpx.post(url, json=again).status_code == 409  # one batch per worker per step
    for w in (a, b):
        w.membership.leave()


def test_worker_killed_mid_batch_does_not_stall_a_step(trainer: str, tmp_path: Path) -> None:
    key = tmp_path / "victim.key"
    victim = Identity.load_or_create(key)
    fund(trainer, victim.public_key, 1.0)  # what it stakes
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "covey",
            "rl",
            "worker",
            "--trainer",
            trainer,
            "--identity",
            str(key),
            "--name",
            "victim",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: any(
                a["name"] == "victim"
                for a in httpx.get(f"{trainer}/v1/rl/status").json()["accounts"].values()
            ),
            30,
            "the victim to join",
        )
        os.kill(proc.pid, signal.SIGKILL)  # no deathrattle, maybe mid-generation
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    with validator(trainer):
        w = joined_worker(trainer)
        v0 = policy(trainer)["version"]
        w.step(policy(trainer))
        wait_for(lambda: policy(trainer)["version"] > v0, 60, "a step without the victim")
        w.membership.leave()
    for row in batch_status(trainer, victim.peer_id):  # whatever it sent was checked
        assert row["status"] != "pending" or row["samples"] > 0


def test_corrupt_policy_blob_is_refused_and_fetched_elsewhere(trainer: str, tmp_path: Path) -> None:
    w = joined_worker(trainer)
    info = policy(trainer)
    bad_store = BlobStore(tmp_path / "bad")
    data = httpx.get(f"{trainer}/v1/blobs/{info['cid']}").content
    bad_store.put(data)
    corrupt = bytearray(data)
    corrupt[len(corrupt) // 2] ^= 0xFF
    bad_store.path(info["cid"]).chmod(0o644)
    bad_store.path(info["cid"]).write_bytes(bytes(corrupt))
    with BlobServer(bad_store) as server:
        liar = server.url
        cache = PolicyCache(w.run, BlobStore(tmp_path / "mine"), w.fetcher)
        with pytest.raises(BlobError):
            cache.model(info["cid"], [liar])
        assert not cache.store.has(info["cid"])  # never stored, never generated on
        cache.model(info["cid"], [liar, trainer])  # the next provider's bytes hash right
        assert cache.store.get(info["cid"]) == data
    # bytes that hash right but are not this run's policy are refused too
    junk = BlobStore(tmp_path / "junk")
    cid = junk.put(json.dumps({"not": "a policy"}).encode())
    with BlobServer(junk) as server, pytest.raises(PolicyError):
        PolicyCache(w.run, BlobStore(tmp_path / "mine2"), w.fetcher).model(cid, [server.url])
    w.membership.leave()


@pytest.mark.long  # two trainer starts: over a minute on a loaded 2-core machine
def test_trainer_restart_keeps_versions_and_ledger(tmp_path: Path) -> None:
    d, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_trainer(d, port)
    try:
        first = httpx.get(f"{url}/v1/rl/spec").json()["run_id"]
        with validator(url):
            w = joined_worker(url)
            w.step(policy(url))
            wait_for(lambda: policy(url)["version"] >= 1, 30, "a trainer step")
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        proc = start_trainer(d, port)
        assert httpx.get(f"{url}/v1/rl/spec").json()["run_id"] == first
        assert policy(url)["version"] >= 1
        out = subprocess.run(
            [sys.executable, "-m", "covey", "ledger", "verify", str(d)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        stop(proc)


@pytest.mark.long  # SFT, then every role as a process for two minutes
def test_demo_writes_a_summary_and_an_auditable_ledger(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "covey",
        "rl",
        "demo",
        "--minutes",
        "2",
        "--adversaries",
        "2",
        "--sft-steps",
        "60",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "pass_at_1_start",
        "pass_at_1_end",
        "rollouts_accepted",
        "rollouts_rejected",
        "honest_rejected",
        "cheats_caught",
        "cheats_missed",
    ):
        assert key in summary
    assert summary["rollouts_accepted"] > 0 and summary["honest_rejected"] == 0
    assert summary["cheats_missed"] == 0 and summary["cheats_caught"] >= 1
    audit = subprocess.run(
        [sys.executable, "-m", "covey", "ledger", "verify", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr
