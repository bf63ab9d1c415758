"""The coordinator's durable state: one SQLite database in WAL mode.

Everything a restarted coordinator needs is here (the blobs it names are on disk beside
it): the run spec, peers, rounds with their members, assignments, contributions and
certificates, rejections, checkpoints and an event log. A round is committed by one
transaction that writes its certificate and marks it committed, so a SIGKILL at any point
leaves each round either committed once or not at all.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from covey.trust.ledger import LEDGER_SCHEMA

SCHEMA = """
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
"""


class Database:
    """A thread-safe handle: one connection, serialized by a lock. The coordinator's
    handlers are short; the heavy work (the outer step, evaluation) runs outside it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(SCHEMA + LEDGER_SCHEMA)
        self.lock = threading.RLock()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception."""
        with self.lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self.lock:
            return self._conn.execute(sql, args).fetchall()

    def one(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Row | None:
        rows = self.query(sql, args)
        return rows[0] if rows else None

    def get_meta(self, key: str) -> str | None:
        row = self.one("SELECT value FROM meta WHERE key = ?", (key,))
        return None if row is None else row["value"]

    def event(self, conn: sqlite3.Connection, at: float, kind: str, peer: str, detail: Any) -> None:
        conn.execute(
            "INSERT INTO events (at, kind, peer_id, detail) VALUES (?, ?, ?, ?)",
            (at, kind, peer, json.dumps(detail)),
        )

    def close(self) -> None:
        with self.lock:
            self._conn.close()
