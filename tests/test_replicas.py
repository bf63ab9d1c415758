"""Coordinator replicas on one PostgreSQL database (covey.coordinator.lease): the driver's
lease is held by one at a time and taken over once it expires, every writing transaction
of a holder that lost it is rolled back (fencing), and, with real processes, a leader
SIGKILLed again and again is replaced by the other replica with no round lost, doubled or
certified twice."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from covey.coordinator.db import Database
from covey.coordinator.lease import DRIVER, Lease, LeaseLost, leader
from tests.services import FailoverProxy, Postgres, S3Server, free_port, nano_diloco_spec, stop_all


def test_one_holder_at_a_time_and_takeover_after_expiry(postgres: Postgres, tmp_path: Path) -> None:
    url = postgres.database()
    a, b = Lease(Database(url), "a", ttl_s=1.0), Lease(Database(url), "b", ttl_s=1.0)
    assert a.try_take() and not b.try_take()
    assert a.try_take()  # a renewal
    deadline = time.monotonic() + 10
    while not b.try_take():  # a stops renewing: b takes it once it expires
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.1)
    assert not a.try_take()
    row = a.db.one("SELECT holder FROM leases WHERE name = ?", (DRIVER,))
    assert row is not None and row["holder"] == "b"
    with pytest.raises(ValueError, match="postgresql"):
        Lease(Database(tmp_path / "x.db"), "c")  # SQLite: no replicas


def test_a_deposed_holder_cannot_write(postgres: Postgres) -> None:
    url = postgres.database()
    lease_a = Lease(Database(url), "a", ttl_s=0.5)
    assert lease_a.try_take()
    mode_db = Database(url)  # the mode's database of replica a, fenced by its lease
    mode_db.fence = lease_a.fence
    with mode_db.transaction() as c:
        c.execute("INSERT INTO meta VALUES ('written by', 'a')")
    time.sleep(0.6)  # a was paused past its lease...
    assert Lease(Database(url), "b", ttl_s=5.0).try_take()  # ...and b took over
    with pytest.raises(LeaseLost), mode_db.transaction() as c:
        c.execute("UPDATE meta SET value = 'a again' WHERE key = 'written by'")
    assert mode_db.get_meta("written by") == "a"  # rolled back
    mode_db.close()


def test_the_keeper_gives_up_when_another_holds_it(postgres: Postgres) -> None:
    url = postgres.database()
    a = Lease(Database(url), "a", ttl_s=0.6)
    assert a.try_take()
    lost, stop = threading.Event(), threading.Event()
    a.keep(stop, lost.set)
    with a.db.transaction() as c:  # another holder, as after a partition
        c.execute("UPDATE leases SET holder = 'b', expires = expires + 60")
    assert lost.wait(10)
    stop.set()


SPEC = nano_diloco_spec("test-replicas")
KILLS = 20  # leaders SIGKILLed in one run


def _leader_port(db: Database) -> int | None:
    row = db.one("SELECT holder FROM leases WHERE name = ?", (DRIVER,))
    return None if row is None else int(str(row["holder"]).split(":")[1])


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.long  # minutes: KILLS takeovers
def test_leaders_killed_again_and_again_lose_and_double_no_round(
    postgres: Postgres, s3: S3Server, tmp_path: Path
) -> None:
    from covey.io import audit
    from covey.local.cluster import LocalCluster

    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    url, blobs, key = postgres.database(), f"s3://{s3.bucket()}/run", tmp_path / "c.key"
    ports = [free_port(), free_port()]
    proxy = FailoverProxy(ports)
    cluster = LocalCluster(spec, tmp_path, port=proxy.port, env=s3.env, key=key)
    procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(port: int) -> None:
        procs[port] = cluster._spawn(
            f"replica-{port}",
            ["coordinator", str(spec), "--port", str(port), "--threads", "1",
             "--data-dir", str(tmp_path / f"cache-{port}"), "--db", url, "--blobs", blobs,
             "--key", str(key), "--replica"],
        )  # fmt: skip

    lease_db = Database(url)
    takeovers: list[float] = []
    try:
        for port in ports:
            start(port)
        cluster.wait_for(lambda s: True, 120, "a replica to serve")
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        done = 0
        for _ in range(KILLS):
            status = cluster.wait_for(
                lambda s, n=done: s["committed_rounds"] > n and s["phase"] == "open",
                180,
                "a round committed since the last takeover, and the next one open",
            )
            done = status["committed_rounds"]
            leader = _leader_port(lease_db)
            assert leader in procs, leader
            procs[leader].send_signal(signal.SIGKILL)
            procs[leader].wait(10)
            t0 = time.monotonic()
            # the follower serves reads all along: the takeover is the lease changing hands
            _wait(
                "the other replica to take over", 120,
                lambda old=leader: _leader_port(lease_db) not in (None, old)
                and leader_held(lease_db),
            )  # fmt: skip
            # ... and it serves the run: the open round's view is the leader's own (a
            # follower relays it, and answers 503 while nobody leads)
            _wait("the new leader to serve", 120, lambda: _answers(cluster.url + "/v1/round"))
            takeovers.append(time.monotonic() - t0)
            start(leader)  # back as the standby
        final = cluster.wait_for(
            lambda s, n=done: s["committed_rounds"] > n, 180, "a round after the last kill"
        )
        # the ledger first (rounds go on committing meanwhile), then a certificate for each
        # round it certifies
        entries, _, _ = audit.load(cluster.url)
        certified = [e.payload["round"] for e in entries if e.type == "round certificate"]
        assert len(certified) >= final["committed_rounds"]
        certs = [cluster.get(f"/v1/rounds/{r}/certificate") for r in range(len(certified))]
        verify = subprocess.run(
            [sys.executable, "-m", "covey", "ledger", "verify", cluster.url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        cluster.stop()
        stop_all(procs)
        proxy.close()
        lease_db.close()
    print(f"takeovers (s): {[round(t, 1) for t in takeovers]}")
    (tmp_path / "takeovers.json").write_text(str([round(t, 2) for t in takeovers]))
    assert len(takeovers) == KILLS
    # no round lost or doubled: certificates 0..n, each certified once in the ledger
    assert [c["round"] for c in certs] == list(range(len(certs)))
    assert sorted(certified) == list(range(len(certs))), certified
    # every worker's weights matched every certificate it applied, each applied once
    for w in ("w0", "w1"):
        records: list[dict[str, Any]] = _applied(tmp_path, w)
        assert records and all(r["matched"] for r in records), w
        rounds = [r["round"] for r in records]
        assert len(rounds) == len(set(rounds)), f"{w} applied a round twice: {rounds}"


def _leader_holder(db: Database) -> str | None:
    """The holder of the run's unexpired lease, as a follower reads it."""
    held = leader(db)
    return None if held is None else held[0]


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def leader_held(db: Database) -> bool:
    return leader(db) is not None


def _wait(what: str, timeout_s: float, check: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.long  # 30-55 s; the relay itself runs by default (test_a_follower_relays_...)
def test_a_worker_that_talks_only_to_a_follower_trains_with_the_leader(
    postgres: Postgres, s3: S3Server, tmp_path: Path
) -> None:
    """Two replicas on two ports: the leader drives the rounds; a worker given only the
    follower's address joins, beats and contributes through it (forwarded to the leader,
    signatures intact), and its contributions are in the rounds the leader certifies.
    Reads from both replicas agree; the follower's own database writes nothing."""
    import httpx

    from covey.local.cluster import LocalCluster

    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    url, blobs, key = postgres.database(), f"s3://{s3.bucket()}/run", tmp_path / "c.key"
    lead_port, follow_port = free_port(), free_port()
    cluster = LocalCluster(spec, tmp_path, port=follow_port, env=s3.env, key=key)
    procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(port: int) -> None:
        procs[port] = cluster._spawn(
            f"replica-{port}",
            ["coordinator", str(spec), "--port", str(port), "--threads", "1",
             "--data-dir", str(tmp_path / f"cache-{port}"), "--db", url, "--blobs", blobs,
             "--key", str(key), "--replica"],
        )  # fmt: skip

    lease_db = Database(url)
    lead = httpx.Client(base_url=f"http://127.0.0.1:{lead_port}", timeout=10, trust_env=False)
    follow = httpx.Client(base_url=cluster.url, timeout=10, trust_env=False)
    try:
        start(lead_port)
        _wait("the first replica to lead", 120, lambda: _leader_holder(lease_db))
        start(follow_port)
        cluster.wait_for(lambda s: True, 120, "the follower to serve the run's status")
        assert f":{lead_port}:" in str(_leader_holder(lease_db))
        worker = cluster.start_worker("w0")
        status = cluster.wait_for(lambda s: s["committed_rounds"] >= 2, 240, "two rounds")
        assert worker.poll() is None, cluster.tail("w0")
        assert f":{lead_port}:" in str(_leader_holder(lease_db))  # nobody took over
        peer = cluster.ids.get("w0") or status["peers"][0]["peer_id"]
        for r in range(2):  # certified by the leader, with the worker's contribution
            cert = lead.get(f"/v1/rounds/{r}/certificate").json()
            assert peer in [a["peer_id"] for a in cert["accepted"]], cert
            assert follow.get(f"/v1/rounds/{r}/certificate").json() == cert
        # the worker was given the follower's address only
        assert f"127.0.0.1:{lead_port}" not in (tmp_path / "logs" / "w0.log").read_text()

        def agree() -> bool:
            a, b = lead.get("/v1/status").json(), follow.get("/v1/status").json()
            keys = ("run_id", "committed_rounds", "weights_hash", "rounds", "trust")
            return all(a[k] == b[k] for k in keys)

        _wait("the two replicas' status to agree", 30, agree)
        for path in ("/v1/ledger", "/v1/ledger/balances", "/v1/checkpoints", "/v1/run"):
            _wait(f"{path} to agree", 30, lambda p=path: lead.get(p).json() == follow.get(p).json())
        head = follow.get("/v1/ledger/head").json()
        assert head["length"] == len(follow.get("/v1/ledger").json())
        # the state's bytes come from the bucket by presigned URL, from either replica
        cid = lease_db.get_meta("initial_cid")
        got = follow.get(f"/v1/blobs/{cid}")
        assert got.status_code == 307 and "X-Amz-Signature" in got.headers["location"]
        # a write a follower cannot forward (no leader yet) would be a 503; one it can is
        # the leader's answer: an unsigned join is refused by the leader's checks
        refused = follow.post("/v1/join", json={"peer_id": "x"})
        assert refused.status_code == 422, refused.text
    finally:
        cluster.stop()
        stop_all(procs)
        lead.close()
        follow.close()
        lease_db.close()


def _applied(tmp_path: Path, peer: str) -> list[dict[str, Any]]:
    import json

    path = tmp_path / "peers" / peer / "applied.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_follower_writes_nothing_and_relays_nothing_while_nobody_leads(
    postgres: Postgres,
) -> None:
    """A follower's database refuses every writing transaction; with no lease held (or
    only its own), what it would relay is a 503 with Retry-After, not a hang or a 502."""
    from starlette.testclient import TestClient

    from covey.coordinator.replica import NotLeader, RelayFollower

    url = postgres.database()
    follower = RelayFollower(url, "http://127.0.0.1:1", timeout_s=5)
    try:
        with pytest.raises(NotLeader), follower.db.transaction() as c:
            c.execute("INSERT INTO meta VALUES ('follower', 'wrote')")
        assert follower.db.get_meta("follower") is None
        with TestClient(follower.app) as http:
            assert http.get("/healthz").json() == {"ok": True}
            reply = http.post("/v1/join", json={"run_id": "x"})
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
            assert "no replica holds the run's lease" in reply.json()["error"]
            # the lease held by this very replica (its switch is under way): not to itself
            own = Lease(Database(url), "me", ttl_s=30, url="http://127.0.0.1:1")
            assert own.try_take()
            time.sleep(0.6)  # past the follower's cached look at the lease row
            reply = http.get("/v1/status")
            assert reply.status_code == 503 and "no replica holds" in reply.json()["error"]
            # another holder: relayed there (nobody listens at this one: 503, said so)
            with own.db.transaction() as c:
                c.execute("UPDATE leases SET url = 'http://127.0.0.1:9'")
            time.sleep(0.6)
            reply = http.get("/v1/status")
            assert reply.status_code == 503 and "leader did not answer" in reply.json()["error"]
    finally:
        follower.close()


@pytest.mark.network
def test_a_follower_relays_a_signed_write_byte_for_byte_to_the_leader(postgres: Postgres) -> None:
    """A follower relays what it does not answer to the address in the lease row, over a
    real socket: the leader (here a server that echoes what it got) receives the body, the
    signature headers and the path exactly as the peer sent them, and its answer, status
    and headers, comes back unchanged."""
    import json

    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from covey.coordinator.replica import RelayFollower

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse(
            {"path": request.url.path, "query": request.url.query,
             "body": (await request.body()).decode(), "headers": dict(request.headers)},
            status_code=409, headers={"x-leader": "yes"},
        )  # fmt: skip

    port = free_port()
    leader_app = Starlette(routes=[Route("/{rest:path}", echo, methods=["GET", "POST", "PUT"])])
    server = uvicorn.Server(uvicorn.Config(leader_app, host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = postgres.database()
    follower = RelayFollower(url, "http://127.0.0.1:1", timeout_s=5)
    try:
        _wait("the echo leader to listen", 30, lambda: server.started)
        assert Lease(Database(url), "leader", ttl_s=30, url=f"http://127.0.0.1:{port}").try_take()
        body = json.dumps(
            {"run_id": "r", "signature": "ab" * 32, "nonce": "n"}, separators=(",", ":")
        )
        with TestClient(follower.app) as http:
            reply = http.post(
                "/v1/rounds/3/contributions?x=1", content=body,
                headers={"content-type": "application/json", "x-covey-signature": "s1"},
            )  # fmt: skip
        assert reply.status_code == 409 and reply.headers["x-leader"] == "yes"
        got = reply.json()
        assert got["path"] == "/v1/rounds/3/contributions" and got["query"] == "x=1"
        assert got["body"] == body  # byte for byte: the signature covers it as sent
        assert got["headers"]["x-covey-signature"] == "s1"
        assert got["headers"]["host"] == f"127.0.0.1:{port}"
    finally:
        follower.close()
        server.should_exit = True
        thread.join(10)


def test_a_replica_needs_a_shared_database_and_key(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from covey.cli import app

    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    args = ["coordinator", str(spec), "--port", str(free_port()), "--replica"]
    result = CliRunner().invoke(app, [*args, "--data-dir", str(tmp_path / "d")])
    assert result.exit_code == 2 and "--replica needs --db" in result.output, result.output
    # on every mode: a SQLite --db is refused before anything is served or built
    sqlite = ["--db", str(tmp_path / "run.db"), "--key", str(tmp_path / "k.key"), "--replica"]
    for command in (
        ["coordinator", str(spec), "--port", str(free_port()), "--data-dir", str(tmp_path / "e")],
        ["rl", "trainer", "--port", str(free_port()), "--data-dir", str(tmp_path / "f")],
        ["swarm", "coordinator", "--port", str(free_port()), "--data-dir", str(tmp_path / "g")],
    ):
        result = CliRunner().invoke(app, [*command, *sqlite])
        assert result.exit_code != 0, (command, result.output)
        assert "--replica needs --db postgresql" in result.output, (command, result.output)
