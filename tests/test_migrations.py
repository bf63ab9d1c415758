"""State that outlives versions: the coordinator's SQLite schema has a version and
migrations; a run directory made by the previous covey is migrated or refused clearly."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from covey.coordinator.db import SCHEMA_VERSION, Database, SchemaError, missing_columns

# covey 0.1.0's schema, copied verbatim before versioning: such databases have
# user_version 0. Never edit this: it is what run directories in the wild hold.
V1_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peers (
    peer_id TEXT PRIMARY KEY, device TEXT, step_time_s REAL, bandwidth_mbps REAL,
    accepts_connections INTEGER, blob_url TEXT, joined_at REAL, last_seen REAL,
    state TEXT NOT NULL, contributions INTEGER NOT NULL DEFAULT 0,
    public_key TEXT, name TEXT, role TEXT NOT NULL DEFAULT 'worker');
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER PRIMARY KEY, attempt INTEGER NOT NULL, status TEXT NOT NULL,
    opened_at REAL, deadline REAL, members TEXT, assignments TEXT,
    start_cid TEXT, start_hash TEXT, certificate TEXT, new_cid TEXT, new_hash TEXT,
    closed_at REAL, val_loss REAL, train_loss REAL, bytes INTEGER, tokens INTEGER,
    utilization REAL);
CREATE TABLE IF NOT EXISTS contributions (
    round INTEGER, attempt INTEGER, peer_id TEXT, cid TEXT, size INTEGER, tokens INTEGER,
    inner_steps INTEGER, fragment INTEGER, train_loss REAL, compute_s REAL, wall_s REAL,
    submitted_at REAL, request_id TEXT, nonce TEXT, signature TEXT, commitments TEXT,
    PRIMARY KEY (round, attempt, peer_id));
CREATE INDEX IF NOT EXISTS contributions_cid ON contributions (cid);
CREATE TABLE IF NOT EXISTS nonces (
    peer_id TEXT, nonce TEXT, at REAL, PRIMARY KEY (peer_id, nonce));
CREATE TABLE IF NOT EXISTS verifications (
    id INTEGER PRIMARY KEY AUTOINCREMENT, round INTEGER NOT NULL, peer_id TEXT NOT NULL,
    status TEXT NOT NULL, validator_id TEXT, claimed_at REAL, report TEXT,
    UNIQUE (round, peer_id));
CREATE TABLE IF NOT EXISTS payouts (
    round INTEGER, peer_id TEXT, tokens INTEGER, status TEXT NOT NULL,
    PRIMARY KEY (round, peer_id));
CREATE TABLE IF NOT EXISTS rejections (
    id INTEGER PRIMARY KEY AUTOINCREMENT, round INTEGER, attempt INTEGER, peer_id TEXT,
    reason TEXT, at REAL);
CREATE TABLE IF NOT EXISTS checkpoints (
    round INTEGER PRIMARY KEY, cid TEXT, size INTEGER, weights_hash TEXT, created_at REAL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL, kind TEXT, peer_id TEXT, detail TEXT);
CREATE TABLE IF NOT EXISTS ledger (idx INTEGER PRIMARY KEY, type TEXT NOT NULL,
    at REAL NOT NULL, payload TEXT NOT NULL, prev_hash TEXT NOT NULL, hash TEXT NOT NULL,
    signature TEXT NOT NULL);
"""

# An older layout still (before identities): no migration reads it.
PRE_V1_PEERS = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE peers (
    peer_id TEXT PRIMARY KEY, device TEXT, step_time_s REAL, bandwidth_mbps REAL,
    accepts_connections INTEGER, blob_url TEXT, joined_at REAL, last_seen REAL,
    state TEXT NOT NULL, contributions INTEGER NOT NULL DEFAULT 0);
"""


def v1_run_dir(root: Path) -> Path:
    """A run directory as covey 0.1.0 left it: its database with a run, a peer, a
    committed round and a rejection in it."""
    root.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(root / "coordinator.db")
    conn.executescript(V1_SCHEMA)
    conn.executescript(
        """
        INSERT INTO meta VALUES ('run_id', 'abc123');
        INSERT INTO peers (peer_id, state, name, role) VALUES ('p1', 'live', 'alice', 'worker');
        INSERT INTO rounds (round, attempt, status, val_loss) VALUES (0, 0, 'committed', 3.5);
        INSERT INTO rejections (round, attempt, peer_id, reason, at)
            VALUES (0, 0, 'p1', 'nan', 1.0);
        """
    )
    conn.commit()
    conn.close()
    return root


def version_of(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()


def test_a_new_database_has_the_current_version(tmp_path: Path) -> None:
    db = Database(tmp_path / "coordinator.db")
    assert db.opened_version == 0
    db.close()
    assert version_of(tmp_path / "coordinator.db") == SCHEMA_VERSION
    db = Database(tmp_path / "coordinator.db")  # reopened: nothing to do
    assert db.opened_version == SCHEMA_VERSION
    db.close()


def test_a_version_1_run_directory_is_migrated_with_its_data_kept(tmp_path: Path) -> None:
    path = v1_run_dir(tmp_path / "run") / "coordinator.db"
    assert version_of(path) == 0
    db = Database(path)
    assert db.opened_version == 1
    assert db.get_meta("run_id") == "abc123"
    assert db.one("SELECT name FROM peers WHERE peer_id = 'p1'")["name"] == "alice"
    assert db.one("SELECT val_loss FROM rounds WHERE round = 0")["val_loss"] == 3.5
    assert missing_columns(db._conn) == []
    indexes = {r["name"] for r in db.query("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"rejections_reason", "events_kind"} <= indexes
    kinds = [r["kind"] for r in db.query("SELECT kind FROM events")]
    assert kinds == ["schema migrated"] * (SCHEMA_VERSION - 1)
    db.close()
    assert version_of(path) == SCHEMA_VERSION
    # the untouched original sits beside it
    backup = path.with_name("coordinator.db.v1.bak")
    assert version_of(backup) == 0
    conn = sqlite3.connect(backup)
    assert conn.execute("SELECT value FROM meta").fetchone() == ("abc123",)
    conn.close()


def test_a_newer_covey_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"
    Database(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SchemaError, match=r"written by a newer covey.*upgrade covey"):
        Database(path)


def test_a_layout_older_than_any_migration_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"
    conn = sqlite3.connect(path)
    conn.executescript(PRE_V1_PEERS)
    conn.close()
    with pytest.raises(SchemaError, match=r"older than 0\.1\.0 \(peers lacks role.*new --data-dir"):
        Database(path)


def test_the_coordinator_command_refuses_an_old_run_directory_in_one_line(
    tmp_path: Path,
) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text('name = "old"\n')
    data = tmp_path / "data"
    data.mkdir()
    conn = sqlite3.connect(data / "coordinator.db")
    conn.executescript(PRE_V1_PEERS)
    conn.close()
    r = subprocess.run(
        [sys.executable, "-m", "covey.cli", "coordinator", str(spec), "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "older than 0.1.0" in lines[0] and "Traceback" not in r.stderr


def test_a_version_1_ledger_signed_the_old_way_audits_after_opening(tmp_path: Path) -> None:
    """covey 0.1.0 signed each ledger entry over its bare hash; today's entries are signed
    behind the ledger's own prefix. Opening the run directory re-signs the old entries with
    the coordinator's own key (same key, same hashes, same chain), so it audits."""
    from covey.coordinator.accounts import Accounts
    from covey.trust import ledger
    from covey.trust.identity import Identity

    root = v1_run_dir(tmp_path / "run")
    identity = Identity.generate()
    conn = sqlite3.connect(root / "coordinator.db")
    from covey.config import TrustConfig
    from covey.trust.incentives import Policy

    new_fields = {
        "min_validator_stake",
        "validator_slash_fraction",
        "check_reward",
        "validators_per_check",
        "validator_round_cap",
        "canary_rate",
        "validator_stake_cap",
        "established_checks",
        "audit_rate",
    }
    policy = {
        k: v for k, v in Policy.from_config(TrustConfig()).to_dict().items() if k not in new_fields
    }  # the policy 0.1.0 wrote
    created = {
        "run_id": "abc123",
        "name": "old",
        "spec": {},
        "coordinator_key": identity.public_key,
        "policy": policy,
    }
    ledger.append(conn, identity, "run created", created, 1.0)
    for idx, digest in conn.execute("SELECT idx, hash FROM ledger").fetchall():
        old = identity.sign(ledger.legacy_signed_message(digest))  # as 0.1.0 signed it
        conn.execute("UPDATE ledger SET signature = ? WHERE idx = ?", (old, idx))
    conn.commit()
    before = ledger.read_entries(conn)
    conn.close()
    with pytest.raises(ledger.LedgerError, match="signature"):
        ledger.verify_chain(before, identity.public_key)

    db = Database(root / "coordinator.db")
    Accounts(db, identity, root)
    after = ledger.read_entries(db._conn)
    db.close()
    assert [e.hash for e in after] == [e.hash for e in before]  # the chain is unchanged
    assert ledger.verify_chain(after, identity.public_key) == identity.public_key
    # a stranger's signature is not "re-signed" into the coordinator's
    conn = sqlite3.connect(root / "coordinator.db")
    stranger = Identity.generate().sign(ledger.legacy_signed_message(after[0].hash))
    conn.execute("UPDATE ledger SET signature = ? WHERE idx = 0", (stranger,))
    assert ledger.resign_legacy(conn, identity) == 0
    conn.close()
