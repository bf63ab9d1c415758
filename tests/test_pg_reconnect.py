"""A coordinator's PostgreSQL connection lost and made again (covey.coordinator.pg): a
real server stopped and started, and a backend terminated in the middle of a
transaction. A read or a new transaction reconnects; a transaction the server dropped
raises DatabaseUnavailable and leaves nothing behind; the apps answer it with 503."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from covey.coordinator.db import Database
from covey.coordinator.pg import DatabaseUnavailable
from tests.services import Postgres, nano_diloco_spec


def test_a_restarted_server_is_reconnected_and_a_write_while_down_is_refused(
    postgres: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    from covey.coordinator import pg

    monkeypatch.setattr(pg, "RECONNECT_S", 2.0)  # the bound, shorter: the same path
    db = Database(postgres.database())
    try:
        with db.transaction() as c:
            c.execute("INSERT INTO meta VALUES ('before', '1')")
        assert db.read_one("SELECT value FROM meta WHERE key = 'before'") is not None
        postgres.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(DatabaseUnavailable), db.transaction() as c:
                c.execute("INSERT INTO meta VALUES ('while down', '1')")
            assert 1.0 <= time.monotonic() - t0 < 2.0 + 10  # tried about the bound, no more
            with pytest.raises(DatabaseUnavailable):
                db.read_one("SELECT value FROM meta WHERE key = 'before'")
        finally:
            # the server comes back while a reader is retrying: it gets its answer
            threading.Timer(1.0, postgres.resume).start()
            got = db.query("SELECT value FROM meta WHERE key = 'before'")
        assert [r["value"] for r in got] == ["1"]
        assert db.get_meta("while down") is None  # refused, and nothing was written
        with db.transaction() as c:  # writes go on on a new connection
            c.execute("INSERT INTO meta VALUES ('after', '1')")
        assert db.read_one("SELECT value FROM meta WHERE key = 'after'") is not None
    finally:
        db.close()


def test_a_backend_killed_mid_transaction_rolls_it_back_and_the_next_one_writes(
    postgres: Postgres,
) -> None:
    url = postgres.database()
    db, admin = Database(url), Database(url)
    try:
        with pytest.raises(DatabaseUnavailable), db.transaction() as c:
            c.execute("INSERT INTO meta VALUES ('half', '1')")
            pid = c.execute("SELECT pg_backend_pid() AS p").fetchone()["p"]
            admin.query("SELECT pg_terminate_backend(?)", (pid,))
            c.execute("INSERT INTO meta VALUES ('other half', '1')")
        assert admin.get_meta("half") is None and admin.get_meta("other half") is None
        with db.transaction() as c:
            c.execute("INSERT INTO meta VALUES ('next', '1')")
        assert admin.get_meta("next") == "1"
        # a reader's own connection killed between reads: the next read reconnects
        pid = db.read_one("SELECT pg_backend_pid() AS p")["p"]  # type: ignore[index]
        admin.query("SELECT pg_terminate_backend(?)", (pid,))
        assert db.read_one("SELECT value FROM meta WHERE key = 'next'")["value"] == "1"  # type: ignore[index]
    finally:
        db.close()
        admin.close()


SPEC = nano_diloco_spec("test-pg-reconnect", seed=5)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.long  # ~45 s; the tests above run the reconnect itself by default
def test_a_coordinator_serves_on_across_a_database_restart(
    postgres: Postgres, tmp_path: Path
) -> None:
    """A rounds run on PostgreSQL, the server stopped for seconds and started again: a
    signed join while it is down is a 503 (the coordinator process lives on), the worker
    retries through it, and the run commits rounds again afterwards; the ledger verifies."""
    import httpx

    from covey.local.cluster import LocalCluster
    from covey.trust.identity import Identity, request_purpose

    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    cluster = LocalCluster(spec, tmp_path, coordinator_args=["--db", postgres.database()])
    newcomer = Identity.generate()
    try:
        cluster.start_coordinator()
        cluster.start_worker("w0")
        before = cluster.wait_for(lambda s: s["committed_rounds"] >= 1, 180, "a round")
        join = dict(
            run_id=cluster.run_id, peer_id=newcomer.peer_id, public_key=newcomer.public_key,
            name="late", step_time_s=0.1,
        )  # fmt: skip
        postgres.pause()
        try:
            reply = httpx.post(
                cluster.url + "/v1/join",
                json=newcomer.sign_request(join, purpose=request_purpose("/v1/join")),
                timeout=30,
            )
            assert reply.status_code == 503, reply.text
            assert "database is unavailable" in reply.json()["error"]
            assert reply.headers["retry-after"] == "1"
            assert cluster.coordinator is not None and cluster.coordinator.poll() is None
        finally:
            postgres.resume()
        after = cluster.wait_for(
            lambda s: s["committed_rounds"] >= before["committed_rounds"] + 2,
            180,
            "two more rounds after the database came back",
        )
        assert cluster.workers["w0"].poll() is None, cluster.tail("w0")
        reply = httpx.post(
            cluster.url + "/v1/join",
            json=newcomer.sign_request(join, purpose=request_purpose("/v1/join")),
            timeout=30,
        )
        assert reply.status_code == 200, reply.text  # the refused join, retried, is taken
        certs = [
            cluster.get(f"/v1/rounds/{r}/certificate") for r in range(after["committed_rounds"])
        ]
        assert [c["round"] for c in certs] == list(range(len(certs)))
        verify = subprocess.run(
            [sys.executable, "-m", "covey", "ledger", "verify", cluster.url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert verify.returncode == 0, verify.stdout + verify.stderr
        # every request while it was down got an answer (503), none an unhandled error
        assert "Exception in ASGI application" not in cluster.tail("coordinator", 100000)
    finally:
        cluster.stop()
