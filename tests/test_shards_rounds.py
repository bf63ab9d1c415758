"""Sharded rounds end to end with real processes: `covey worker`s train,
`covey validator --aggregate` aggregates the drawn shards, the coordinator certifies shard
hashes and commits; the workers assemble each new state shard by shard. A coordinator
SIGKILLed while a sharded round waits on its aggregators finishes that round after its
restart, neither lost nor doubled; with no aggregator delivering, the coordinator
aggregates the shards itself and the round still commits. Long: minutes of processes."""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.local.cluster import LocalCluster
from covey.trust.identity import Identity

pytestmark = [pytest.mark.network, pytest.mark.long]

SPEC = """
name = "sharded-{name}"
seed = 3
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 32
[algorithm]
method = "diloco"
inner_steps = 4
outer_momentum = 0.5
codec = "int8"
[rounds]
min_peers = 2
deadline_min_s = 6
deadline_max_s = 60
eval_batches = 1
[trust]
sample_rate = 0
new_peer_rate = 0
canary_rate = 0
sharded_above_peers = 2
shards = 4
shard_check_rate = 0.5
shard_publish_timeout_s = {timeout}
"""


def until(what: str, check: Callable[[], Any], timeout_s: float = 180.0) -> Any:
    give_up = time.monotonic() + timeout_s
    while True:
        try:
            got = check()
        except httpx.HTTPError:
            got = None
        if got:
            return got
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.3)


def pending(cluster: LocalCluster) -> dict[str, Any] | None:
    resp = httpx.get(f"{cluster.url}/v1/shards", timeout=10, trust_env=False)
    return resp.json() if resp.status_code == 200 else None


def stake(cluster: LocalCluster, name: str) -> str:
    """Join `name`'s key as a staked validator that aggregates, over HTTP (no process: it
    publishes nothing until one starts with this key)."""
    key = Identity.load_or_create(cluster.key(name))
    cluster.fund(key.public_key, 5.0)  # the run's owner funds what it bonds
    body = {"run_id": cluster.run_id, "validator_id": key.peer_id, "name": name,
            "public_key": key.public_key, "stake": 5.0}  # fmt: skip
    path = "/v1/validators/join"
    for _ in range(50):
        resp = httpx.post(f"{cluster.url}{path}", json=key.sign_request(
            body, -1, purpose=f"POST {path}"), timeout=10, trust_env=False)  # fmt: skip
        if resp.status_code != 429:
            break
        time.sleep(0.5)
    assert resp.status_code == 200, resp.text
    path = "/v1/shards/ready"  # it says it aggregates: in the draw for the next minute
    body = {"run_id": cluster.run_id, "peer_id": key.peer_id}
    resp = httpx.post(f"{cluster.url}{path}", json=key.sign_request(
        body, -1, purpose=f"POST {path}"), timeout=10, trust_env=False)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return key.peer_id


def applied(tmp: Path, worker: str) -> list[dict[str, Any]]:
    path = tmp / "peers" / worker / "applied.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def check_rounds(cluster: LocalCluster, tmp: Path, upto: int) -> list[dict[str, Any]]:
    """Every round 0..upto-1 committed once, chained; each sharded one (both workers in
    it) with a shard certificate that binds the same new_hash; both workers applied each
    round once, matched. The sharded rounds' shard certificates."""
    certs = [cluster.get(f"/v1/rounds/{r}/certificate") for r in range(upto)]
    certs = [c for c in certs if len(c["accepted"]) >= 2]
    assert len(certs) >= upto - 1, "a round without both workers"
    for prev, cert in itertools.pairwise(certs):
        assert cert["round"] != prev["round"] + 1 or cert["start_hash"] == prev["new_hash"], cert[
            "round"
        ]
    shard_certs = [cluster.get(f"/v1/shards/{c['round']}")["certificate"] for c in certs]
    assert [s["new_hash"] for s in shard_certs] == [c["new_hash"] for c in certs]
    for w in ("w0", "w1"):
        records = [r for r in applied(tmp, w) if r["round"] < upto]
        assert all(r["matched"] for r in records), records
        rounds = [r["round"] for r in records]
        assert len(rounds) == len(set(rounds)), f"{w} applied a round twice: {rounds}"
        assert "assembled 4 certified shards" in (tmp / "logs" / f"{w}.log").read_text()
    return shard_certs


def test_a_sharded_round_survives_a_coordinator_sigkill(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(SPEC.format(name="crash", timeout=300))
    with LocalCluster(tmp_path / "run.toml", tmp_path) as cluster:
        cluster.start_coordinator()
        ids = {stake(cluster, v) for v in ("v0", "v1")}
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        board = until("a sharded round to wait on its aggregators", lambda: pending(cluster))
        first = board["round"]
        assert board["certificate"] is None
        cluster.signal("coordinator", signal.SIGKILL)
        cluster.wait_exit("coordinator", 10)
        cluster.start_coordinator()
        assert cluster.status()["committed_rounds"] == first
        again = until("the round to close again after the restart", lambda: pending(cluster))
        assert again["round"] == first and again["beacon"] == board["beacon"]  # same inputs
        for v in ("v0", "v1"):
            cluster.start_validator(v, "--aggregate", "--stake", "5")
        cluster.wait_for(lambda s: s["committed_rounds"] >= first + 3, 240, "3 sharded rounds")
        shard_certs = check_rounds(cluster, tmp_path, first + 3)
        log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert {s["aggregator"] for c in shard_certs for s in c["shards"]} <= ids
    assert "resumed run" in log and "aggregated it" not in log


def test_with_no_aggregator_delivering_the_coordinator_aggregates(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(SPEC.format(name="orphans", timeout=2))
    with LocalCluster(tmp_path / "run.toml", tmp_path) as cluster:
        cluster.start_coordinator()
        for v in ("v0", "v1"):
            stake(cluster, v)  # staked, drawn, and silent
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        cluster.wait_for(lambda s: s["committed_rounds"] >= 2, 240, "2 rounds")
        shard_certs = check_rounds(cluster, tmp_path, 2)
        coordinator = Identity.load_or_create(cluster.data_dir / "coordinator.key").peer_id
        log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert {s["aggregator"] for c in shard_certs for s in c["shards"]} == {coordinator}
    assert "no aggregator delivered shard" in log or "sharding overdue" in log
