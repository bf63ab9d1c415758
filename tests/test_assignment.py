"""Validators are staked, assigned by the public beacon and paid only for checks they
complete, attacked through the HTTP API of a real coordinator process: a staked key claims
checks in a loop and never reports (before: it took every sampled task first come, the
tasks expired, the work was paid anyway and an honest validator beside it checked
nothing). Now it receives only the checks the beacon drew for it; each one it sits on is
missed, recorded against it and reassigned to the honest validator process; nothing is
paid before a validator reported on it; and the ledger replays every draw."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.io import audit
from covey.local.cluster import LocalCluster
from covey.trust.identity import NO_ROUND, Identity, request_purpose
from covey.trust.ledger import Entry

pytestmark = pytest.mark.network

SPEC = """
name = "assignment"
seed = 7
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 32
[algorithm]
method = "diloco"
inner_steps = 4
codec = "fp32"
inner_state = "reset"
[rounds]
deadline_min_s = 3
eval_batches = 1
max_rounds = 40
[trust]
sample_rate = 1.0
min_stake = 10.0
min_validator_stake = 5.0
validators_per_check = 2
validator_round_cap = 8
check_reward = 0.5
challenge_rounds = 1
verify_timeout_s = 6
commit_every = 2
canary_rate = 0.5
validator_slash_fraction = 0.5
"""


class Squatter:
    """A staked validator key that claims checks in a loop and never reports one (or,
    with `stamp`, reports every one "agree" at once without re-executing anything)."""

    def __init__(self, cluster: LocalCluster, stake: float, stamp: bool = False) -> None:
        self.stamp = stamp
        self.http = httpx.Client(base_url=cluster.url, timeout=20, trust_env=False)
        self.run_id = cluster.get("/v1/run")["run_id"]
        self.key = Identity.generate()
        self.id = self.key.peer_id
        if stake > 0:  # the run's owner funds the key: it bonds what it holds
            cluster.fund(self.key.public_key, stake)
        self.tasks: list[dict[str, Any]] = []
        self.stop = threading.Event()
        join = {
            "run_id": self.run_id,
            "validator_id": self.id,
            "public_key": self.key.public_key,
            "name": "squatter",
            "stake": stake,
        }
        reply = self.post("/v1/validators/join", join)
        assert reply.status_code == 200, reply.text
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def post(self, path: str, body: dict[str, Any], round: int = NO_ROUND) -> httpx.Response:
        signed = self.key.sign_request(body, round, purpose=request_purpose(path))
        return self.http.post(path, json=signed)

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            try:
                reply = self.post(
                    "/v1/verify/claim", {"run_id": self.run_id, "validator_id": self.id}
                )
            except httpx.HTTPError:
                continue
            if reply.status_code != 200 or (task := reply.json()["task"]) is None:
                continue
            self.tasks.append(task)
            if self.stamp:
                body = {
                    "run_id": self.run_id,
                    "round": task["round"],
                    "validator_id": self.id,
                    "task_id": task["task_id"],
                    "outcome": "agree",
                    "distance": 0.0,
                }
                try:
                    self.post("/v1/verify/report", body, round=task["round"])
                except httpx.HTTPError:
                    continue


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalCluster, Squatter, Squatter]]:
    tmp: Path = tmp_path_factory.mktemp("assignment")
    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    cluster = LocalCluster(spec, tmp)
    cluster.start_coordinator()
    squatter = Squatter(cluster, stake=5.0)
    stamp = Squatter(cluster, stake=8.0, stamp=True)
    squatter.thread.start()
    stamp.thread.start()
    cluster.start_worker("honest", "--stake", "20")
    cluster.start_validator("checker", "--stake", "5")
    yield cluster, squatter, stamp
    squatter.stop.set()
    stamp.stop.set()
    cluster.stop()


def ledger(cluster: LocalCluster) -> list[Entry]:
    found, _, _ = audit.load(cluster.url)
    return found


def test_a_squatting_validator_checks_nothing_and_blocks_nothing(
    world: tuple[LocalCluster, Squatter, Squatter],
) -> None:
    cluster, squatter, _ = world
    checker, worker = cluster.ids["checker"], cluster.ids["honest"]

    def enough(entries: list[Entry]) -> bool:
        checks = [e for e in entries if e.type == "verification"]
        done = [e for e in checks if e.payload["validator_id"] == checker]
        missed = [e for e in checks if e.payload["validator_id"] == squatter.id]
        reassigned = [
            e
            for e in entries
            if e.type == "assignment"
            and e.payload["reason"] == "reassign"
            and squatter.id not in e.payload["validators"]
        ]
        return len(done) >= 3 and len(missed) >= 2 and bool(reassigned)

    end = time.monotonic() + 150
    while not enough(entries := ledger(cluster)):
        assert time.monotonic() < end, cluster.tail()
        time.sleep(1.0)  # polling the ledger under a deadline
    # a check reached the squatter only when the beacon drew it for that contribution
    drawn = {
        (e.payload["round"], e.payload["peer_id"])
        for e in entries
        if e.type == "assignment" and squatter.id in e.payload["validators"]
    }
    accepted = {
        (e.payload["round"], e.payload["peer_id"]): e.payload["cid"]
        for e in entries
        if e.type == "contribution accepted"
    }
    real = [t for t in squatter.tasks if accepted.get((t["round"], t["peer_id"])) == t["cid"]]
    assert real, "the squatter was never drawn"
    assert {(t["round"], t["peer_id"]) for t in real} <= drawn  # the others are canaries
    # new peers' contributions are drawn for k = 2 validators
    first = [e for e in entries if e.type == "assignment" and e.payload["reason"] == "draw"]
    assert any(len(e.payload["validators"]) == 2 for e in first)
    # every check the squatter sat on was missed, counted against it and reassigned
    mine = [e for e in entries if e.type == "verification" and e.payload["validator_id"]]
    assert all(
        e.payload["outcome"] == "expired" for e in mine if e.payload["validator_id"] == squatter.id
    )
    # (and one it missed went to another validator in its place: `enough` waited for that)
    # paid: a validator per completed check; the squatter never
    checks_paid = [e for e in entries if e.type == "reward" and e.payload["kind"] == "check"]
    payees = {e.payload["peer_id"] for e in checks_paid}
    assert checker in payees and squatter.id not in payees
    # a sampled contribution is paid only after a validator reported on it
    done_at: dict[tuple[int, str], int] = {}
    for e in entries:
        if e.type == "verification" and e.payload["outcome"] in ("agree", "disagree"):
            done_at.setdefault((e.payload["round"], e.payload["peer_id"]), e.index)
        if e.type == "reward" and e.payload["kind"] == "work":
            key = (e.payload["round"], e.payload["peer_id"])
            assert key in done_at and done_at[key] < e.index, key
    accounts = cluster.get("/v1/ledger/balances")["accounts"]
    assert accounts[squatter.id]["counts"]["missed_checks"] >= 2
    assert accounts[squatter.id]["balance"] == 0.0
    assert accounts[squatter.id]["reputation"] < accounts[checker]["reputation"]
    assert accounts[worker]["balance"] > 0 and not accounts[worker]["banned"]
    # the ledger replays: the book recomputes every draw from the beacon
    audit.verify(cluster.url)


def test_an_unstaked_validator_cannot_check(
    world: tuple[LocalCluster, Squatter, Squatter],
) -> None:
    cluster, _, _ = world
    http = httpx.Client(base_url=cluster.url, timeout=20, trust_env=False)
    key = Identity.generate()
    body = {
        "run_id": cluster.get("/v1/run")["run_id"],
        "validator_id": key.peer_id,
        "public_key": key.public_key,
        "name": "poor",
        "stake": 1.0,
    }
    path = "/v1/validators/join"
    reply = http.post(path, json=key.sign_request(body, NO_ROUND, purpose=request_purpose(path)))
    assert reply.status_code == 403 and "minimum stake 5.0" in reply.text, reply.text
