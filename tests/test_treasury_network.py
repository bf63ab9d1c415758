"""Stake is held, not declared, against a real coordinator process on 127.0.0.1: the test
is a key signing its own requests as any peer would. A key that declares more than it
holds is refused; a deposit not signed by the run's owner is refused; the owner's deposit
(POST /v1/ledger/deposit, and `covey ledger deposit`) funds a key, which bonds it; leaving
unbonds, and a join before the release rebonds. With a worker process training (long): a
validator that files a false accusation and leaves at once still pays the penalty from
its unbonding stake, and only what is left is released, after the unbonding period."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.algorithms.codecs import get_codec
from covey.blobs.client import BlobClient
from covey.io import audit
from covey.io.deposit import DepositRefused, deposit
from covey.local.cluster import LocalCluster
from covey.protocol.content import content_id
from covey.trust.identity import NO_ROUND, Identity, request_purpose
from covey.trust.ledger import Entry

SPEC = """
name = "treasury"
seed = 5
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
deadline_max_s = 4
eval_batches = 1
max_rounds = 400
[trust]
sample_rate = 1.0
min_stake = 10.0
min_validator_stake = 5.0
validator_slash_fraction = 0.5
commit_every = 2
challenge_rounds = 0
verify_timeout_s = 3
validators_per_check = 1
dispute_attempts = 1
shard_publish_timeout_s = 1
audit_rate = 0.0
canary_rate = 0.0
"""
# the unbonding period this spec gives (covey.trust.treasury.unbonding_delay):
# (0 + 1) x 4 + (2 x 1 + 2 + 1) x 3 + 2 x 1
UNBONDING_S = 21.0


class Key:
    """A key that signs its own requests to the coordinator, as a validator would."""

    def __init__(self, cluster: LocalCluster, name: str, key: Identity | None = None) -> None:
        self.http = httpx.Client(base_url=cluster.url, timeout=20, trust_env=False)
        self.run_id = cluster.run_id
        self.key = key or Identity.generate()
        self.id, self.name = self.key.peer_id, name

    def post(self, path: str, body: dict[str, Any], round: int = NO_ROUND) -> httpx.Response:
        signed = self.key.sign_request(body, round, purpose=request_purpose(path))
        return self.http.post(path, json=signed)

    def join(self, stake: float) -> httpx.Response:
        body = {"run_id": self.run_id, "validator_id": self.id,
                "public_key": self.key.public_key, "name": self.name, "stake": stake}  # fmt: skip
        return self.post("/v1/validators/join", body)

    def leave(self) -> httpx.Response:
        return self.post("/v1/leave", {"run_id": self.run_id, "peer_id": self.id})


def entries(cluster: LocalCluster) -> list[Entry]:
    return audit.load(cluster.url)[0]


def wait_entry(
    cluster: LocalCluster, match: Callable[[Entry], bool], what: str, deadline_s: float = 90.0
) -> Entry:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if hits := [e for e in entries(cluster) if match(e)]:
            return hits[-1]
        time.sleep(0.3)  # polling a condition under a deadline
    raise AssertionError(f"no ledger entry for {what} within {deadline_s} s")


def account(cluster: LocalCluster, peer_id: str) -> dict[str, Any]:
    return cluster.get("/v1/ledger/balances")["accounts"][peer_id]


FUNDED = Identity.generate()  # credited by the spec's [trust.funds] when the run is created


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    spec = tmp_path / "run.toml"
    spec.write_text(f'{SPEC}\n[trust.funds]\n"{FUNDED.public_key}" = 5.0\n')
    with LocalCluster(spec, tmp_path) as c:
        c.start_coordinator()
        yield c


@pytest.mark.network
def test_a_key_bonds_only_what_the_owner_deposited_and_unbonds_on_leaving(
    cluster: LocalCluster,
) -> None:
    me = Key(cluster, "me")
    reply = me.join(5.0)  # a stake it does not hold
    assert reply.status_code == 403, reply.text
    assert "more than key" in reply.text and "holds (0 credits" in reply.text, reply.text
    assert not [e for e in entries(cluster) if e.payload.get("peer_id") == me.id]
    # a deposit signed by anyone but the owner is refused, and credits nobody
    with pytest.raises(DepositRefused, match=r"403.*not the owner key"):
        deposit(cluster.url, Identity.generate(), me.key.public_key, 100.0, cluster.run_id)
    assert cluster.fund(me.key.public_key, 4.0) == 4.0
    # the owner's `covey ledger deposit` (the coordinator's key: the spec names no owner)
    cli = subprocess.run(
        [sys.executable, "-m", "covey", "ledger", "deposit", "--coordinator", cluster.url,
         "--to", me.key.public_key, "--amount", "2", "--key", str(cluster.data_dir /
         "coordinator.key"), "--run-id", cluster.run_id],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "it holds 6" in cli.stdout, cli.stdout
    reply = me.join(7.0)
    assert reply.status_code == 403 and "holds (6 credits" in reply.text, reply.text
    assert me.join(6.0).status_code == 200
    mine = account(cluster, me.id)
    assert (mine["stake"], mine["held"], mine["release_at"]) == (6.0, 0.0, None)
    # leaving starts the unbonding: the stake stays bonded until its release
    assert me.leave().status_code == 200, "leave"
    unbond = wait_entry(cluster, lambda e: e.type == "unbond", "the unbonding")
    assert unbond.payload == {"peer_id": me.id, "amount": 6.0,
                              "release_at": unbond.at + UNBONDING_S}  # fmt: skip
    created = entries(cluster)[0].payload["policy"]
    assert (created["held_stake"], created["unbonding_s"]) == (1, UNBONDING_S)
    assert account(cluster, me.id)["stake"] == 6.0
    # joining again before the release cancels the unbonding
    assert me.join(6.0).status_code == 200
    assert [e.type for e in entries(cluster)][-1] == "rebond"
    assert account(cluster, me.id)["release_at"] is None
    # a key the spec funds holds its grant from the start, with no deposit asked
    grant = entries(cluster)[1]
    assert grant.type == "deposit" and grant.payload["source"] == "spec"
    assert grant.payload == {**grant.payload, "public_key": FUNDED.public_key, "amount": 5.0}
    funded = Key(cluster, "funded", FUNDED)
    assert funded.join(6.0).status_code == 403
    assert funded.join(5.0).status_code == 200
    audit.verify(cluster.url)  # deposits, the bonds, unbond and rebond replay


@pytest.mark.network
@pytest.mark.long
def test_a_slash_during_unbonding_lands_and_only_the_rest_is_released(
    cluster: LocalCluster,
) -> None:
    """A funded validator files a false accusation against an honest worker's contribution
    and leaves at once: the referee's penalty lands on its unbonding stake, and the release
    (no sooner than unbonding_s after the leave) returns only what is left."""
    liar = Key(cluster, "liar")
    cluster.fund(liar.key.public_key, 10.0)
    assert liar.join(10.0).status_code == 200
    cluster.start_worker("honest", "--stake", "10")  # the cluster funds what it stakes
    worker = cluster.ids["honest"]
    task = None
    end = time.monotonic() + 180
    while task is None and time.monotonic() < end:
        reply = liar.post("/v1/verify/claim", {"run_id": liar.run_id, "validator_id": liar.id})
        assert reply.status_code == 200, reply.text
        got = reply.json()["task"]
        task = got if got is not None and got["peer_id"] == worker else None
        time.sleep(0.3)  # polling a condition under a deadline
    assert task is not None, f"no check of the worker was drawn\n{cluster.tail()}"
    codec = get_codec("fp32")
    honest = httpx.get(f"{cluster.url}/v1/blobs/{task['cid']}", timeout=20).content
    lie = codec.encode(-codec.decode(honest))
    lie_cid = BlobClient().upload(cluster.url, lie, content_id(lie), signer=(liar.key, liar.run_id))
    report = {"run_id": liar.run_id, "round": task["round"], "validator_id": liar.id,
              "task_id": task["task_id"], "outcome": "disagree", "distance": 1.0,
              "segment": 1, "payload_cid": lie_cid}  # fmt: skip
    reply = liar.post("/v1/verify/report", report, round=task["round"])
    assert reply.status_code == 200 and reply.json()["status"] == "disputed", reply.text
    assert liar.leave().status_code == 200  # gone before the verdict
    unbond = wait_entry(cluster, lambda e: e.type == "unbond", "the unbonding")
    penalty = wait_entry(
        cluster,
        lambda e: e.type == "penalty" and e.payload["peer_id"] == liar.id,
        "the false accusation's penalty",
    )
    assert penalty.index > unbond.index and penalty.payload["amount"] == 5.0
    assert penalty.at < unbond.payload["release_at"]  # it landed during the unbonding
    release = wait_entry(
        cluster,
        lambda e: e.type == "release" and e.payload["peer_id"] == liar.id,
        "the release",
        deadline_s=UNBONDING_S + 60,
    )
    assert release.at >= unbond.payload["release_at"] >= unbond.at + UNBONDING_S
    assert release.payload["amount"] == 5.0  # the stake less the penalty
    mine = account(cluster, liar.id)
    assert (mine["stake"], mine["slashed"]) == (0.0, 5.0)
    assert mine["held"] == 5.0 + mine["balance"]  # the release and any pay it earned
    audit.verify(cluster.url)


@pytest.mark.network
def test_a_worker_stakes_the_runs_minimum_which_follows_the_sampling_rate(
    tmp_path: Path,
) -> None:
    """A spec that leaves trust.min_stake unset asks the stake at which cheating one round
    does not pay at its sample_rate (covey.config.RunConfig.min_stake): the run's signed
    policy names it; a join below it is refused with what to do; `covey ledger deposit`
    without --amount deposits it, and a worker started without --stake bonds exactly it."""
    spec = tmp_path / "run.toml"
    spec.write_text(
        SPEC.replace("min_stake = 10.0\n", "").replace("sample_rate = 1.0", "sample_rate = 0.05")
    )
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        least = cluster.config.min_stake(32)  # the spec's data.seq_len
        # 4 steps x 4 rows x 32 tokens at 0.001 a token: R = 0.512; 2R x 0.95 / (0.05 x 0.5)
        assert least == 39.0
        assert entries(cluster)[0].payload["policy"]["min_stake"] == least
        assert cluster.get("/v1/ledger/balances")["min_stake"] == {
            "worker": least,
            "validator": 5.0,
        }
        me = Identity.generate()

        def join(stake: float) -> httpx.Response:
            body = {"run_id": cluster.run_id, "peer_id": me.peer_id, "public_key": me.public_key,
                    "name": "me", "stake": stake, "device": "cpu", "step_time_s": 0.1}  # fmt: skip
            signed = me.sign_request(body, purpose=request_purpose("/v1/join"))
            return httpx.post(f"{cluster.url}/v1/join", json=signed, timeout=20, trust_env=False)

        reply = join(least - 1)
        assert reply.status_code == 403, reply.text
        assert f"minimum stake {least} for a worker" in reply.text, reply.text
        assert "covey ledger deposit" in reply.text
        assert me.peer_id not in cluster.get("/v1/ledger/balances")["accounts"]
        cli = subprocess.run(
            [sys.executable, "-m", "covey", "ledger", "deposit", "--coordinator", cluster.url,
             "--to", me.public_key, "--key", str(cluster.data_dir / "coordinator.key")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert f"deposited {least:g} credits" in cli.stdout, cli.stdout
        assert join(least).status_code == 200
        # a worker process started without --stake: the cluster deposits the run's minimum
        # to its key as the owner, and the worker bonds exactly that
        cluster.start_worker("w")
        worker = cluster.ids["w"]
        end = time.monotonic() + 120
        while time.monotonic() < end:
            mine = cluster.get("/v1/ledger/balances")["accounts"].get(worker)
            if mine is not None and mine["stake"] > 0:
                break
            time.sleep(0.3)  # polling a condition under a deadline
        else:
            raise AssertionError(f"the worker never bonded\n{cluster.tail()}")
        assert (mine["stake"], mine["held"]) == (least, 0.0)
        audit.verify(cluster.url)
