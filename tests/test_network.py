"""The round protocol over real sockets: a coordinator and workers as separate processes
on 127.0.0.1, killed with real signals. Each test starts its own cluster (nano GPT, tiny
rounds), but for the last two, which share one, and waits on conditions with deadlines;
nothing here is mocked."""

from __future__ import annotations

import itertools
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from covey.local.cluster import LocalCluster

pytestmark = [pytest.mark.network, pytest.mark.slow]

SPEC = """
name = "test-{name}"
seed = 3
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = {inner_steps}
outer_momentum = 0.5
[rounds]
target_compute_s = 30
deadline_min_s = {deadline_min_s}
deadline_max_s = 60
eval_batches = 2
checkpoint_every = 2
"""


def make_cluster(
    tmp_path: Path, name: str, inner_steps: int = 6, deadline_min_s: float = 4
) -> LocalCluster:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(name=name, inner_steps=inner_steps, deadline_min_s=deadline_min_s))
    cluster = LocalCluster(spec, tmp_path)
    cluster.start_coordinator()
    return cluster


def committed(n: int):
    return lambda s: s["committed_rounds"] >= n


def certificates(cluster: LocalCluster, upto: int) -> list[dict[str, Any]]:
    return [cluster.get(f"/v1/rounds/{r}/certificate") for r in range(upto)]


def applied(tmp_path: Path, peer: str) -> list[dict[str, Any]]:
    path = tmp_path / "peers" / peer / "applied.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_chain(certs: list[dict[str, Any]]) -> None:
    """Each round starts where the previous one ended: none lost, none applied twice."""
    for prev, cert in itertools.pairwise(certs):
        assert cert["round"] == prev["round"] + 1
        assert cert["start_hash"] == prev["new_hash"], f"round {cert['round']} breaks the chain"


def test_sigkill_worker_mid_round_round_closes_without_it(tmp_path: Path) -> None:
    with make_cluster(tmp_path, "kill", deadline_min_s=4) as cluster:
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        cluster.start_worker("slow", "--slowdown", "6")
        cluster.wait_for(
            lambda s: (
                s["phase"] == "open"
                and s["committed_rounds"] >= 1
                # all three are members of the open round (membership is fixed at open)
                and sorted(p["name"] for p in s["peers"] if p["state"] == "training")
                == ["slow", "w0", "w1"]
            ),
            180,
            "a round with all three workers training",
        )
        victim_round = cluster.status()["round"]
        cluster.signal("slow", signal.SIGKILL)
        cluster.wait_exit("slow", 10)
        # no deathrattle: the coordinator notices the silence (6 s) or the deadline passes
        status = cluster.wait_for(committed(victim_round + 3), 120, "3 rounds after the kill")
        cert = cluster.get(f"/v1/rounds/{victim_round}/certificate")
        peers = {p["name"]: p for p in status["peers"]}
    assert "slow" not in {a["name"] for a in cert["accepted"]}
    assert {a["name"] for a in cert["accepted"]} == {"w0", "w1"}
    assert "slow" in {r["name"] for r in cert["rejected"]}
    assert peers["slow"]["state"] == "dead" and not peers["slow"]["alive"]


@pytest.mark.long  # joiners download state in tests/test_sim.py and the replica and HF runs
def test_joiner_downloads_canonical_state_and_is_accepted(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    text = SPEC.format(name="join", inner_steps=6, deadline_min_s=4)
    spec.write_text(text + "[limits]\nchunk_bytes = 65536\n")  # state: ~1 MB in 16 ranges
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        cluster.wait_for(committed(3), 180, "3 rounds before the join")
        cluster.start_worker("late")
        status = cluster.wait_for(
            lambda s: any(p["name"] == "late" and p["contributions"] >= 2 for p in s["peers"]),
            180,
            "the joiner's contributions to be accepted",
        )
        certs = certificates(cluster, status["committed_rounds"])
    joined = [c for c in certs if "late" in {a["name"] for a in c["accepted"]}]
    assert joined and joined[0]["round"] >= 3  # it entered mid-run, from the canonical state
    log = (tmp_path / "logs" / "late.log").read_text()
    assert "loaded canonical state of round" in log
    # the joiner's state came in ranges from the peers that hold it and the relay; how the
    # ranges split between them depends on which peers were live and quick at that moment
    # (on a loaded machine the relay may serve them all: CI saw it), so only a source is
    # asserted here; the split itself is tests/test_blobs.py's
    fetched = next(line for line in log.splitlines() if "fetched state" in line)
    assert fetched.count(" B)") >= 1, fetched
    records = applied(tmp_path, "late")
    assert records and all(r["matched"] for r in records)
    by_round = {c["round"]: c["new_hash"] for c in certs}
    assert all(r["weights_hash"] == by_round[r["round"]] for r in records if r["round"] in by_round)


@pytest.mark.long  # a leave is written in tests/test_treasury_network.py by default
def test_sigterm_sends_deathrattle_and_round_does_not_wait(tmp_path: Path) -> None:
    with make_cluster(tmp_path, "term", deadline_min_s=30) as cluster:
        cluster.start_worker("w0")
        cluster.start_worker("slow", "--slowdown", "8")
        cluster.wait_for(
            lambda s: (
                s["committed_rounds"] >= 1
                and s["phase"] == "open"
                and sorted(p["name"] for p in s["peers"] if p["state"] == "training")
                == ["slow", "w0"]
            ),
            240,
            "a round with both workers training",
        )
        victim_round = cluster.status()["round"]
        cluster.signal("slow", signal.SIGTERM)
        assert cluster.wait_exit("slow", 20) == 0
        # the deathrattle marks it left at once; the round closes as soon as w0 submits,
        # long before the 30 s minimum deadline or the 6 s silence rule would matter
        status = cluster.wait_for(committed(victim_round + 1), 60, "the round to close")
        cert = cluster.get(f"/v1/rounds/{victim_round}/certificate")
    peers = {p["name"]: p for p in status["peers"]}
    assert peers["slow"]["state"] == "left"
    assert [a["name"] for a in cert["accepted"]] == ["w0"]
    assert cert["reason"] == "every live member submitted"
    assert "left: shutdown" in (tmp_path / "logs" / "coordinator.log").read_text()


@pytest.mark.long  # the budget is pure: tests/test_protocol.py checks it by default
def test_slow_peer_gets_a_smaller_budget_and_weighs_its_tokens(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    text = SPEC.format(name="hetero", inner_steps=40, deadline_min_s=4)
    spec.write_text(text.replace("target_compute_s = 30", "target_compute_s = 1.5"))
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        cluster.start_worker("fast")
        cluster.start_worker("slow", "--slowdown", "25")
        cluster.wait_for(
            lambda s: any(p["name"] == "slow" and p["contributions"] >= 2 for p in s["peers"]),
            180,
            "two rounds with the slow peer",
        )
        certs = certificates(cluster, cluster.status()["committed_rounds"])
    both = [c for c in certs if {a["name"] for a in c["accepted"]} == {"fast", "slow"}]
    assert both
    for cert in both:
        by = {a["name"]: a for a in cert["accepted"]}
        assert by["slow"]["inner_steps"] < by["fast"]["inner_steps"]
        total = by["slow"]["tokens"] + by["fast"]["tokens"]
        assert by["slow"]["weight"] == pytest.approx(by["slow"]["tokens"] / total)


@pytest.mark.parametrize(
    "algorithm",
    [
        # the long run only (the suite's time budget)
        pytest.param('method = "ddp"', marks=pytest.mark.long),
        # Streaming over the network runs by default in test_worker_overlap.py (with overlap)
        pytest.param(
            'method = "streaming"\ninner_steps = 8\nfragments = 4\noverlap_steps = 0',
            marks=pytest.mark.long,
        ),
        pytest.param('method = "demo"\ntopk = 8', marks=pytest.mark.long),
    ],
    ids=["ddp", "streaming", "demo"],
)
def test_every_method_runs_over_the_network(tmp_path: Path, algorithm: str) -> None:
    spec = tmp_path / "run.toml"
    text = SPEC.format(name="methods", inner_steps=6, deadline_min_s=4)
    head, rest = text.split("[algorithm]")
    rest = rest.split("[rounds]")[1]
    spec.write_text(f"{head}[algorithm]\n{algorithm}\n[rounds]{rest}")
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        status = cluster.wait_for(committed(6), 180, "6 committed rounds")
        certs = certificates(cluster, status["committed_rounds"])
    assert_chain(certs)
    for w in ("w0", "w1"):
        records = applied(tmp_path, w)
        assert len(records) >= 3 and all(r["matched"] for r in records), records


# -- one cluster for the last two tests: three workers train, then the coordinator is
# SIGKILLed under two of them and restarted. Module-scoped (a cluster's start is most of either
# test's time on two cores), so these two stay last: nothing else runs beside it.


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with make_cluster(tmp_path_factory.mktemp("three"), "three") as cluster:
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        cluster.start_worker("w2", "--no-serve-blobs")  # unreachable: uploads, relayed
        yield cluster


def test_three_workers_train_and_agree_on_every_round(three: LocalCluster) -> None:
    cluster, run_dir = three, three.run_dir
    # a worker slow to start (three import torch at once on two cores) joins a round
    # or two late: wait until each has applied three, not only for five rounds
    status = cluster.wait_for(
        lambda s: (
            committed(5)(s) and all(len(applied(run_dir, w)) >= 3 for w in ("w0", "w1", "w2"))
        ),
        180,
        "5 committed rounds, 3 applied by every worker",
    )
    certs = certificates(cluster, status["committed_rounds"])
    assert_chain(certs)
    assert all(len(c["accepted"]) >= 1 for c in certs)
    assert any({a["name"] for a in c["accepted"]} == {"w0", "w1", "w2"} for c in certs)
    for a in (a for c in certs for a in c["accepted"]):
        assert bool(a["providers"]) == (a["name"] != "w2"), a  # w2's come from the relay
    # every peer computed every certified round's weights itself, bit for bit
    by_round = {c["round"]: c["new_hash"] for c in certs}
    for w in ("w0", "w1", "w2"):
        records = applied(run_dir, w)
        assert len(records) >= 3, f"{w} applied only {len(records)} rounds"
        for rec in records:
            assert rec["matched"], f"{w} round {rec['round']}: {rec}"
            if rec["round"] in by_round:
                assert rec["weights_hash"] == by_round[rec["round"]]
    losses = [r["val_loss"] for r in status["rounds"] if r["val_loss"] is not None]
    assert losses[-1] < losses[0], f"validation loss did not fall: {losses}"
    # the canonical state is kept as a checkpoint every K=2 rounds, as safetensors
    assert list((run_dir / "coordinator" / "checkpoints").glob("round-*.safetensors"))


def test_coordinator_sigkill_and_restart_resumes(three: LocalCluster) -> None:
    cluster, run_dir = three, three.run_dir
    # w2 uploads its payloads to the coordinator (no blob server): an upload that meets the
    # coordinator down is tried again until it is back (covey.peer.worker_publish._upload)
    before = cluster.wait_for(
        lambda s: s["committed_rounds"] >= 3 and s["phase"] == "open", 180, "3 rounds"
    )
    cluster.signal("coordinator", signal.SIGKILL)
    cluster.wait_exit("coordinator", 10)
    cluster.start_coordinator()
    after = cluster.status()
    assert after["committed_rounds"] >= before["committed_rounds"]
    # the peers reconnect by themselves and training goes on
    status = cluster.wait_for(
        committed(after["committed_rounds"] + 3), 180, "3 rounds after the restart"
    )
    certs = certificates(cluster, status["committed_rounds"])
    assert all(cluster.workers[w].poll() is None for w in ("w0", "w1", "w2")), cluster.tail()
    assert_chain(certs)
    assert [c["round"] for c in certs] == list(range(len(certs)))
    for w in ("w0", "w1", "w2"):
        records = applied(run_dir, w)
        assert all(r["matched"] for r in records)
        rounds = [r["round"] for r in records]
        assert len(rounds) == len(set(rounds)), f"{w} applied a round twice: {rounds}"
    log = (cluster.logs / "coordinator.log").read_text()
    assert "resumed run" in log
