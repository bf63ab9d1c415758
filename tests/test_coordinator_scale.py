"""The coordinator is O(1) per request: heartbeats live in memory and reach
SQLite in batches, a crash loses at most the flush interval of liveness, the certificate
long-poll wakes at the commit, and `covey bench coordinator` runs end to end."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from covey.algorithms.codecs import get_codec
from covey.bench.coordinator import SPEC as BENCH_SPEC
from covey.bench.coordinator import run_coordinator_bench
from covey.blobs.client import upload_headers
from covey.config import load_run_config
from covey.coordinator.app import create_app
from covey.coordinator.liveness import FLUSH_S, Liveness
from covey.coordinator.service import Coordinator
from covey.coordinator.views import CommitSignal
from covey.local.cluster import LocalCluster
from covey.protocol.content import content_id
from covey.trust.identity import Identity, request_purpose

SPEC = BENCH_SPEC.format(heartbeat_s=1.0, dead_after_s=5.0, lease_s=10.0, min_peers=1)


def signed(key: Identity, body: dict[str, Any], path: str, round: int = -1) -> dict[str, Any]:
    return key.sign_request(body, round, purpose=request_purpose(path))


def join_body(key: Identity, run_id: str) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "peer_id": key.peer_id,
        "public_key": key.public_key,
        "name": "tester",
        "step_time_s": 0.01,
    }


def changes(coord: Coordinator) -> int:
    row = coord.db.one("SELECT total_changes() AS n")
    assert row is not None
    return int(row["n"])


def test_heartbeats_do_not_write_sqlite_per_request(tmp_path: Path) -> None:
    """Thirty heartbeats change no row; one flush writes them (and their nonces) in one
    batch; a replayed heartbeat is refused from memory, and after a restart from SQLite."""
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    coord = Coordinator(load_run_config(spec), tmp_path / "coord")
    coord.membership._liveness = live = Liveness(coord.db, 300.0, flush_s=3600)  # by hand
    try:
        http = TestClient(create_app(coord))
        key = Identity.generate()
        join = signed(key, join_body(key, coord.run_id), "/v1/join")
        assert http.post("/v1/join", json=join).status_code == 200
        joined = coord.db.one("SELECT last_seen FROM peers WHERE peer_id = ?", (key.peer_id,))
        before, beats = changes(coord), []
        for _ in range(30):  # under the per-peer burst (limits.peer_burst = 40)
            beat = signed(key, {"run_id": coord.run_id, "peer_id": key.peer_id}, "/v1/heartbeat")
            assert http.post("/v1/heartbeat", json=beat).status_code == 200, beat
            beats.append(beat)
        assert changes(coord) == before, "a heartbeat wrote to SQLite"
        stored = coord.db.one("SELECT last_seen FROM peers WHERE peer_id = ?", (key.peer_id,))
        assert stored["last_seen"] == joined["last_seen"]
        (view,) = [p for p in coord._peer_views() if p.peer_id == key.peer_id]
        assert view.last_seen > joined["last_seen"]  # the round planner sees the heartbeats
        replay = http.post("/v1/heartbeat", json=beats[-1])
        assert replay.status_code == 401 and "replayed" in replay.text

        assert live.flush() == 1 and live.flushes == 1
        assert changes(coord) == before + 1 + 30  # one peer row, thirty nonces
        stored = coord.db.one("SELECT last_seen FROM peers WHERE peer_id = ?", (key.peer_id,))
        assert stored["last_seen"] == pytest.approx(view.last_seen)
        coord.membership._liveness = Liveness(coord.db, 300.0, flush_s=3600)  # a restart
        replay = http.post("/v1/heartbeat", json=beats[0])
        assert replay.status_code == 401 and "replayed" in replay.text
    finally:
        coord.db.close()


def test_heartbeats_and_polls_are_answered_while_a_round_commits(tmp_path: Path) -> None:
    """A round's commit holds the database's write lock (its certificate, no-shows and
    ledger entries); heartbeats and /v1/round read the last committed state on a second
    connection, so they are answered while it is held, not after."""
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    coord = Coordinator(load_run_config(spec), tmp_path / "coord")
    try:
        http = TestClient(create_app(coord))
        key = Identity.generate()
        join = signed(key, join_body(key, coord.run_id), "/v1/join")
        assert http.post("/v1/join", json=join).status_code == 200
        beat = signed(key, {"run_id": coord.run_id, "peer_id": key.peer_id}, "/v1/heartbeat")
        assert http.post("/v1/heartbeat", json=beat).status_code == 200  # liveness loaded
        held, answered, released = threading.Event(), threading.Event(), threading.Event()

        def writer() -> None:  # a long commit: holds the lock until both are answered
            with coord.db.transaction() as c:
                c.execute("UPDATE peers SET name = 'renamed' WHERE peer_id = ?", (key.peer_id,))
                held.set()
                answered.wait(30)
            released.set()

        threading.Thread(target=writer, daemon=True).start()
        assert held.wait(10)
        beat = signed(key, {"run_id": coord.run_id, "peer_id": key.peer_id}, "/v1/heartbeat")
        assert http.post("/v1/heartbeat", json=beat).status_code == 200
        poll = http.get("/v1/round", params={"peer_id": key.peer_id})
        assert poll.status_code == 200 and poll.json()["phase"] in ("waiting", "open")
        assert not released.is_set(), "the answers waited for the writer"
        answered.set()
        assert released.wait(10)
    finally:
        coord.membership._stop.set()  # the liveness flusher ends before its database does
        coord.db.close()


def test_a_commit_wakes_the_waiters_at_once() -> None:
    """`notify` from another thread wakes an asyncio waiter within milliseconds; without a
    commit the wait ends at its timeout, not done."""
    signal_ = CommitSignal()
    committed = threading.Event()

    async def scenario() -> tuple[bool, float, bool]:
        notifier = threading.Timer(0.2, lambda: (committed.set(), signal_.notify()))
        notifier.start()
        done = await signal_.wait(committed.is_set, 5.0)
        woke = time.monotonic()
        start = time.monotonic()
        expired = await signal_.wait(lambda: False, 0.1)
        assert time.monotonic() - start >= 0.1
        return done, woke, expired

    start = time.monotonic()
    done, woke, expired = asyncio.run(scenario())
    assert done and not expired
    assert woke - start < 0.2 + 0.1, f"woke {woke - start:.3f} s after a commit at 0.2 s"


# -- real processes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp: Path = tmp_path_factory.mktemp("scale")
    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    with LocalCluster(spec, tmp) as c:
        c.start_coordinator()
        yield c


class Peer:
    def __init__(self, cluster: LocalCluster) -> None:
        self.http = httpx.Client(base_url=cluster.url, timeout=10, trust_env=False)
        self.run_id = cluster.run_id
        self.key = Identity.generate()
        join = signed(self.key, join_body(self.key, self.run_id), "/v1/join")
        assert self.http.post("/v1/join", json=join).status_code == 200

    def beat(self) -> httpx.Response:
        body = {"run_id": self.run_id, "peer_id": self.key.peer_id}
        return self.http.post("/v1/heartbeat", json=signed(self.key, body, "/v1/heartbeat"))


@pytest.mark.network
def test_the_certificate_long_poll_returns_at_the_commit(cluster: LocalCluster) -> None:
    """A long-poll held before the only member submits returns within ~100 ms of the
    round's commit (the certificate's closed_at), not at a timer's next tick."""
    peer = Peer(cluster)
    give_up = time.monotonic() + 60
    while True:  # the first round opens with this peer, or the next one does
        assert peer.beat().status_code == 200
        info = peer.http.get("/v1/round", params={"peer_id": peer.key.peer_id}).json()
        if info["phase"] == "open" and info["member"]:
            break
        assert time.monotonic() < give_up, info
        time.sleep(0.2)
    rnd = info["round"]
    returned: dict[str, Any] = {}

    def long_poll() -> None:
        url = f"/v1/rounds/{rnd}/certificate"
        resp = peer.http.get(url, params={"wait": 30, "peer_id": peer.key.peer_id}, timeout=40)
        returned.update(at=time.time(), status=resp.status_code, body=resp.json())

    poller = threading.Thread(target=long_poll)
    poller.start()
    numel = cluster.get("/v1/run")["parameters"]
    payload = get_codec("fp32").encode(torch.full((numel,), 1e-4))
    cid = content_id(payload)
    headers = upload_headers(peer.key, peer.run_id, cid, len(payload))
    assert peer.http.put(f"/v1/blobs/{cid}", content=payload, headers=headers).status_code == 200
    steps = info["assignment"]["inner_steps"]
    body = {
        "run_id": peer.run_id,
        "round": rnd,
        "attempt": info["attempt"],
        "peer_id": peer.key.peer_id,
        "cid": cid,
        "start_hash": info["start_hash"],
        "size": len(payload),
        "tokens": 4 * 64 * steps,
        "inner_steps": steps,
    }
    path = f"/v1/rounds/{rnd}/contributions"
    resp = peer.http.post(path, json=signed(peer.key, body, path, rnd))
    assert resp.status_code == 200, resp.text
    poller.join(40)
    assert returned.get("status") == 200, returned
    late = returned["at"] - returned["body"]["closed_at"]
    assert late < 0.25, f"the long-poll returned {late:.3f} s after the commit"


@pytest.mark.network
@pytest.mark.long  # ~11 s: a SIGKILL and a restart; the flush itself is tested above
def test_a_crash_loses_at_most_the_flush_interval_of_liveness(cluster: LocalCluster) -> None:
    """Heartbeats for a few flush intervals, then SIGKILL: SQLite holds a last_seen no
    older than the flush interval before the last accepted heartbeat; after a restart a
    flushed heartbeat replayed is still refused, and the peer heartbeats on."""
    peer = Peer(cluster)
    sent: list[tuple[float, dict[str, Any]]] = []
    stop = time.monotonic() + 3 * FLUSH_S
    while time.monotonic() < stop:
        body = signed(
            peer.key, {"run_id": peer.run_id, "peer_id": peer.key.peer_id}, "/v1/heartbeat"
        )
        start = time.time()
        assert peer.http.post("/v1/heartbeat", json=body).status_code == 200
        sent.append((start, body))
        time.sleep(0.1)
    cluster.signal("coordinator", signal.SIGKILL)
    cluster.wait_exit("coordinator", 30)
    db = sqlite3.connect(cluster.data_dir / "coordinator.db")
    try:
        (seen,) = db.execute(
            "SELECT last_seen FROM peers WHERE peer_id = ?", (peer.key.peer_id,)
        ).fetchone()
    finally:
        db.close()
    last = sent[-1][0]
    flush_s = min(FLUSH_S, 1.0)  # heartbeat_s of SPEC: heartbeats flush at least that often
    slack = 1.0  # the flusher thread's scheduling on a loaded machine
    assert seen >= last - flush_s - slack, f"lost {last - seen:.2f} s of liveness"
    cluster.start_coordinator()
    first_at, old = sent[0]  # ~3 flush intervals before the kill: flushed
    assert first_at < seen - 1.0
    replay = peer.http.post("/v1/heartbeat", json=old)
    assert replay.status_code == 401 and "replayed" in replay.text
    assert peer.beat().status_code == 200


@pytest.mark.network
@pytest.mark.long  # a benchmark's smoke run (~18 s)
def test_bench_coordinator_smoke(tmp_path: Path) -> None:
    """20 simulated peers for ~10 s: every operation answered, none refused, and every
    peer's round long-poll woken by the round's commit (deadline_max_s = 8)."""
    rows = run_coordinator_bench(
        tmp_path, peers=20, duration_s=10, warmup_s=0, submitters=2, procs=1, echo=lambda _: None
    )
    by_op = {r["op"]: r for r in rows}
    assert set(by_op) == {"heartbeat", "round", "round wake", "upload", "submit", "coordinator"}
    for op in ("heartbeat", "round", "submit"):
        assert by_op[op]["requests"] > 0, by_op[op]
        assert by_op[op]["p99_ms"] is not None
    assert by_op["coordinator"]["errors"] == 0, by_op["coordinator"]["error_reasons"]
    assert by_op["heartbeat"]["requests"] >= 20 * 5 * 0.8  # ~5 heartbeats each in 10 s
    assert 0 < by_op["coordinator"]["cpu_share"] < 2.5
    assert by_op["coordinator"]["rounds"] >= 1
    assert by_op["round wake"]["requests"] >= 20, by_op["round wake"]


def test_bench_coordinator_refuses_an_out_directory_holding_a_run(tmp_path: Path) -> None:
    """Reusing --out resumed the earlier run's coordinator: its seeded submissions met their
    own earlier ones (409s counted as errors). Refused before anything starts."""
    from typer.testing import CliRunner

    from covey.cli import app

    (tmp_path / "coordinator").mkdir()
    with pytest.raises(ValueError, match="holds an earlier bench run"):
        run_coordinator_bench(tmp_path, peers=2, submitters=1, echo=lambda _: None)
    result = CliRunner().invoke(
        app, ["bench", "coordinator", "--peers", "2", "--submitters", "1", "--out", str(tmp_path)]
    )
    assert result.exit_code == 2 and "give a new --out directory" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coordinator"]  # nothing written
