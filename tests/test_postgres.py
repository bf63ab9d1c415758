"""The coordinator's database on a real PostgreSQL (one server a session: the `postgres`
fixture, tests/services.py; a new database each test): the same schema and migrations as
SQLite, the peers repository, the host, the ledger, writers serialized across handles,
and a rounds coordinator that creates its run there and, on an empty data dir with its
key given, resumes it."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from covey.config import MembershipConfig, RunConfig, load_run_config
from covey.coordinator.db import SCHEMA_VERSION, Database, SchemaError, missing_columns
from covey.coordinator.host import Host, RunTerms
from covey.coordinator.storage import Storage
from covey.trust import ledger
from covey.trust.identity import Identity
from covey.trust.incentives import Policy
from tests.services import Postgres, S3Server
from tests.test_host import check_peers_repository
from tests.test_migrations import V1_SCHEMA

SPEC = """
name = "pg"
[model]
size = "nano"
[data]
batch_size = 2
seq_len = 16
[algorithm]
method = "diloco"
inner_steps = 2
"""


def test_schema_is_created_once_and_versioned(postgres: Postgres) -> None:
    url = postgres.database()
    db = Database(url)
    assert db.opened_version == 0 and db.is_postgres and "***" not in url
    assert missing_columns(db._conn) == []  # type: ignore[arg-type]
    db.close()
    again = Database(url)
    assert again.opened_version == SCHEMA_VERSION
    with again.transaction() as c:  # a newer covey's database is refused, naming versions
        c.execute("UPDATE covey_schema SET version = ?", (SCHEMA_VERSION + 1,))
    again.close()
    with pytest.raises(SchemaError, match=f"schema version {SCHEMA_VERSION + 1}"):
        Database(url)


def test_a_version_1_database_is_migrated_by_the_same_steps(postgres: Postgres) -> None:
    url = postgres.database()
    from covey.coordinator.pg import PgConnection

    conn = PgConnection(url)
    conn.executescript(V1_SCHEMA)  # covey 0.1.0's tables, in PostgreSQL's types
    conn.set_user_version(1)
    conn.close()
    db = Database(url)
    try:
        assert db.opened_version == 1
        assert missing_columns(db._conn) == []  # type: ignore[arg-type]
        events = db.query("SELECT detail FROM events WHERE kind = 'schema migrated'")
        assert len(events) == SCHEMA_VERSION - 1
    finally:
        db.close()


def test_the_peers_repository_on_postgres(postgres: Postgres) -> None:
    db = Database(postgres.database())
    try:
        check_peers_repository(db)
    finally:
        db.close()


def test_statements_behave_as_on_sqlite(postgres: Postgres) -> None:
    db = Database(postgres.database())
    try:
        with db.transaction() as c:
            first = c.execute(
                "INSERT OR REPLACE INTO verifications (round, peer_id, status) VALUES (?, ?, ?)",
                (1, "p", "pending"),
            ).lastrowid
            c.execute("UPDATE verifications SET report = 'r' WHERE id = ?", (first,))
            second = c.execute(
                "INSERT OR REPLACE INTO verifications (round, peer_id, status) VALUES (?, ?, ?)",
                (1, "p", "pending"),
            ).lastrowid
            c.executemany("INSERT OR IGNORE INTO nonces VALUES (?, ?, ?)", [("a", "n", 1.0)] * 2)
            c.execute("INSERT INTO meta VALUES (?, ?)", ("aggregator/x", "1"))
        # REPLACE made a new row, as SQLite's delete-then-insert does: a new id, no report
        rows = db.query("SELECT id, report FROM verifications")
        assert first is not None and second is not None and second > first
        assert [tuple(r) for r in rows] == [(second, None)]
        assert db.one("SELECT COUNT(*) AS n FROM nonces")["n"] == 1  # type: ignore[index]
        like = db.query("SELECT key FROM meta WHERE key LIKE 'aggregator/%'")
        assert [r["key"] for r in like] == ["aggregator/x"]
        total = db.one("SELECT COALESCE(SUM(round), 0) AS b FROM verifications")
        assert total is not None and total["b"] == 1 and isinstance(total["b"], int)
        with pytest.raises(sqlite3.IntegrityError), db.transaction() as c:  # as on SQLite
            c.execute("INSERT INTO nonces VALUES (?, ?, ?)", ("a", "n", 2.0))
        with pytest.raises(sqlite3.OperationalError):
            db.query("SELECT * FROM no_such_table")
        assert db.one("SELECT COUNT(*) AS n FROM nonces")["n"] == 1  # type: ignore[index]
        with db.transaction() as c:  # SQLite's types: BLOB bytes, 64-bit integers, booleans
            c.execute("CREATE TABLE IF NOT EXISTS kinds (b BLOB, i INTEGER, r REAL, t TEXT)")
            c.execute("INSERT INTO kinds VALUES (?, ?, ?, ?)", (b"\x00\xff", 2**40, 0.5, "x"))
            c.execute("INSERT INTO kinds VALUES (?, ?, ?, ?)", (None, True, None, None))
        rows = db.query("SELECT * FROM kinds ORDER BY r")
        assert [tuple(r) for r in rows] == [(b"\x00\xff", 2**40, 0.5, "x"), (None, 1, None, None)]
    finally:
        db.close()


def test_writers_are_serialized_across_handles(postgres: Postgres) -> None:
    """BEGIN IMMEDIATE's one write lock, across processes (here: two handles, two
    connections): a second writer waits for the first to commit, then sees its write."""
    url = postgres.database()
    a, b = Database(url), Database(url)
    seen: list[str | None] = []
    try:
        with a.transaction() as c:
            c.execute("INSERT INTO meta VALUES ('k', 'first')")

            def second() -> None:
                with b.transaction() as c2:
                    row = c2.execute("SELECT value FROM meta WHERE key = 'k'").fetchone()
                    seen.append(None if row is None else row["value"])

            t = threading.Thread(target=second)
            t.start()
            t.join(0.5)
            assert t.is_alive()  # waiting for the lock, not reading before the commit
        t.join(10)
        assert seen == ["first"]
    finally:
        a.close()
        b.close()


def _terms(run_id: str) -> RunTerms:
    return RunTerms(run_id=run_id, owner_key="00" * 32, membership=MembershipConfig())


def test_the_host_on_postgres_with_an_outside_key(postgres: Postgres, tmp_path: Path) -> None:
    url, key = postgres.database(), tmp_path / "coordinator.key"
    storage = Storage(db=url, key=key)
    host = Host(tmp_path / "one", lambda i, d: _terms("run-a"), position=lambda: 0,
                storage=storage)  # fmt: skip
    now = time.time()
    with host.accounts.transaction() as c:
        c.execute("INSERT INTO meta VALUES ('run_id', 'run-a')")
        policy = Policy.from_config(RunConfig().trust).to_dict()
        payload = {"run_id": "run-a", "name": "pg", "spec": {}, "coordinator_key":
                   host.identity.public_key, "policy": policy}  # fmt: skip
        host.accounts.append(c, "run created", payload, now)
    entries = ledger.read_entries(host.db._conn)  # type: ignore[arg-type]
    assert [e.type for e in entries] == ["run created"]
    assert not (tmp_path / "one" / "coordinator.key").exists()  # the key is the given one
    host.close()
    # a new, empty data dir: the same database and key are the same run
    again = Host(tmp_path / "two", lambda i, d: _terms("run-a"), position=lambda: 0,
                 storage=storage)  # fmt: skip
    assert again.identity.public_key == Identity.load_or_create(key).public_key
    assert again.accounts.book.run_id == "run-a"  # the ledger replayed from PostgreSQL
    assert again.db.get_meta("run_id") == "run-a"
    again.close()
    with pytest.raises(ValueError, match="--db") as e:
        Host(tmp_path / "three", lambda i, d: _terms("run-b"), position=lambda: 0,
             storage=storage)  # fmt: skip
    assert "run-a" in str(e.value) and "run-b" in str(e.value)


def test_a_rounds_coordinator_resumes_on_an_empty_data_dir(
    postgres: Postgres, s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default suite's run of the real path (the end-to-end one with processes and a
    SIGKILL is tests/test_s3.py's, marked long): a rounds coordinator on PostgreSQL and
    S3 creates its run, and another on an empty data dir, with the same key, resumes it;
    its blob route sends a GET to the object store."""
    from starlette.testclient import TestClient

    from covey.coordinator.app import create_app
    from covey.coordinator.service import Coordinator

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    storage = Storage(
        db=postgres.database(), blobs=f"s3://{s3.bucket()}/r", key=tmp_path / "coordinator.key"
    )
    first = Coordinator(load_run_config(spec), tmp_path / "a", storage=storage)
    run_id, state = first.run_id, first.rounds.state_cid
    n = len(first.accounts.entries(0, 100))
    first.stop()
    assert n >= 1
    again = Coordinator(load_run_config(spec), tmp_path / "b", storage=storage)
    try:
        assert again.run_id == run_id and again.rounds.state_cid == state
        assert len(again.accounts.entries(0, 100)) == n  # resumed: nothing re-created
        assert again.accounts.find("run created", run_id=run_id) is not None
        http = TestClient(create_app(again), follow_redirects=False)
        got = http.get(f"/v1/blobs/{state}")
        assert got.status_code == 307 and got.headers["location"].startswith(s3.url)
        head = http.head(f"/v1/blobs/{state}")  # sizes are answered here
        assert head.status_code == 200 and int(head.headers["content-length"]) > 0
        assert http.get(f"/v1/blobs/{'0' * 64}").status_code == 404
    finally:
        again.stop()


def test_the_swarm_mode_runs_on_postgres(postgres: Postgres, tmp_path: Path) -> None:
    """--db on the SWARM coordinator: it creates its run there and, on a new data dir
    with its key given, opens the same run again."""
    from covey.swarm.config import SwarmConfig
    from covey.swarm.service import SwarmCoordinator

    storage = Storage(db=postgres.database(), key=tmp_path / "swarm.key")
    cfg = SwarmConfig(n_layer=2, n_embd=16, n_head=2, seq_len=8)
    coord = SwarmCoordinator(cfg, tmp_path / "s1", storage=storage)
    entries = len(coord.accounts.entries(0, 100))
    coord.stop()
    reopened = SwarmCoordinator(cfg, tmp_path / "s2", storage=storage)
    try:
        assert reopened.run_id == cfg.run_id and len(reopened.accounts.entries(0, 100)) == entries
        assert entries >= 1 and not (tmp_path / "s2" / "swarm.db").exists()
    finally:
        reopened.stop()


@pytest.mark.long  # a rollout batch is generated: ~10 s here
def test_the_rl_mode_steps_on_postgres(postgres: Postgres, tmp_path: Path) -> None:
    """--db on the RL trainer: it takes a verified batch, steps, and resumes from the
    database."""
    from covey.rl.trainer import Trainer
    from tests.test_rl_moments import SPEC as RL_SPEC
    from tests.test_rl_moments import _accept, _batch

    storage = Storage(db=postgres.database(), key=tmp_path / "rl.key")
    t = Trainer(tmp_path / "rl", spec=RL_SPEC, policy_dir="covey:nano", storage=storage)
    _accept(t, _batch(t, 0, "w1"))
    assert t.step_if_ready() is not None and t.version == 1
    run_id = t.run_id
    t.stop()
    # its policy blobs and moments are on this dir's disk (no --blobs): the same dir
    again = Trainer(tmp_path / "rl", storage=storage)
    assert again.run_id == run_id and again.version == 1
    rows = again.db.query("SELECT status, COUNT(*) AS n FROM rl_batches GROUP BY status")
    assert {r["status"]: r["n"] for r in rows} == {"consumed": 1}
    assert not (tmp_path / "rl" / "coordinator.db").exists()
    again.stop()
