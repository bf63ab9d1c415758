"""The coordinator's durable state: one SQLite database in WAL mode.

Everything a restarted coordinator needs is here (the blobs it names are on disk beside
it): the run spec, peers, rounds with their members, assignments, contributions and
certificates, rejections, checkpoints and an event log. A round is committed by one
transaction that writes its certificate and marks it committed, so a SIGKILL at any point
leaves each round either committed once or not at all.

The schema has a version (``PRAGMA user_version``, `SCHEMA_VERSION`). Opening a database
of an older version migrates it, one transaction per step, after a backup copy beside it
(``coordinator.db.v<N>.bak``); a database of a newer covey, or of a layout older than any
migration knows, is refused with `SchemaError`, which says what to do. To change the schema:
edit `SCHEMA` (what a new run directory gets), bump `SCHEMA_VERSION` and add the step that
brings the previous version there to `MIGRATIONS`; tests/test_migrations.py checks that a
migrated version-1 database has every table and column of `SCHEMA`.

The same database can be a PostgreSQL server instead (`Database("postgresql://...")`, the
`--db` option of every coordinator mode): the same SCHEMA and MIGRATIONS, run through the
dialect seam (covey.coordinator.dialect, covey.coordinator.pg); the version is kept in the
table covey_schema, and a migration runs in one transaction (PostgreSQL's DDL is
transactional: that is its backup; take a pg_dump before upgrading covey all the same).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from covey import __version__
from covey.trust.ledger import LEDGER_SCHEMA

from .pg import DatabaseUnavailable, PgConnection, is_url, redact

log = logging.getLogger("covey.db")

# Version 1 is covey 0.1.0's layout, written before databases carried a version
# (user_version 0 with these tables in it).
SCHEMA_VERSION = 4

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
CREATE INDEX IF NOT EXISTS rejections_reason ON rejections (reason);
CREATE INDEX IF NOT EXISTS events_kind ON events (kind);
CREATE TABLE IF NOT EXISTS local_states (
    round INTEGER, attempt INTEGER, peer_id TEXT, start_cid TEXT, end_cid TEXT,
    end_size INTEGER, rate REAL, evidence TEXT, PRIMARY KEY (round, attempt, peer_id));
"""


class SchemaError(ValueError):
    """A database this covey cannot use as it is; the message says what to do."""


def _v1_to_v2(conn: sqlite3.Connection) -> None:
    # Counting rejections by reason and events by kind (the status page, /metrics) no
    # longer scans whole tables on a long run.
    conn.execute("CREATE INDEX IF NOT EXISTS rejections_reason ON rejections (reason)")
    conn.execute("CREATE INDEX IF NOT EXISTS events_kind ON events (kind)")


def _v2_to_v3(conn: sqlite3.Connection) -> None:
    # contributions commit the worker's local states (start and end) by content id
    conn.execute(
        "CREATE TABLE IF NOT EXISTS local_states (round INTEGER, attempt INTEGER, "
        "peer_id TEXT, start_cid TEXT, end_cid TEXT, end_size INTEGER, "
        "PRIMARY KEY (round, attempt, peer_id))"
    )


def _v3_to_v4(conn: sqlite3.Connection) -> None:
    # a stateful contribution's draw for verification, made at intake: the rate (the
    # commit samples with it) and its evidence: NULL not drawn, "pending" drawn (its
    # validators fetch the states from the worker), "undelivered" once its validators
    # proved it withheld (covey.coordinator.withheld); "secured", "withheld" and "lost"
    # are older runs' (fetched, or refused, at intake)
    conn.execute("ALTER TABLE local_states ADD COLUMN rate REAL")
    conn.execute("ALTER TABLE local_states ADD COLUMN evidence TEXT")


# MIGRATIONS[n] brings a version-n database to version n + 1 (inside one transaction).
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _v1_to_v2,
    2: _v2_to_v3,
    3: _v3_to_v4,
}
# A database without user_version is version 1 if it has these (added late in 0.1.0).
V1_MARKERS = {"peers": "role", "contributions": "commitments", "verifications": "report"}


def _columns(conn: Any, table: str) -> set[str]:
    if isinstance(conn, PgConnection):
        return set(conn.columns(table))
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def _legacy_version(conn: sqlite3.Connection, path: Path) -> int:
    """The version of a database written before versioning: 1, or `SchemaError`."""
    for table, column in V1_MARKERS.items():
        if column not in _columns(conn, table):
            raise SchemaError(
                f"{path} is from a covey older than 0.1.0 ({table} lacks {column}), which no "
                "migration reads: finish that run with the covey that started it, or start "
                "this one in a new --data-dir"
            )
    return 1


def missing_columns(conn: sqlite3.Connection) -> list[str]:
    """`table.column` of the current `SCHEMA` (and the ledger's) absent from `conn`."""
    want = sqlite3.connect(":memory:")
    try:
        want.executescript(SCHEMA + LEDGER_SCHEMA)
        tables = [r[0] for r in want.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return [
            f"{t}.{c}"
            for t in tables
            if not t.startswith("sqlite_")
            for c in sorted(_columns(want, t) - _columns(conn, t))
        ]
    finally:
        want.close()


def prepare(conn: sqlite3.Connection, path: Path) -> int:
    """Create, migrate or refuse the schema of `conn` (the database at `path`); returns the
    version it had (0 for a new database). Raises `SchemaError` for a newer covey's database
    or a layout no migration reads; a failed migration step is rolled back whole."""
    if isinstance(conn, PgConnection):
        return _prepare_pg(conn)
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    has_tables = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table'").fetchone()
    if version == 0 and not has_tables:
        conn.executescript(SCHEMA + LEDGER_SCHEMA)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return 0
    found = version or _legacy_version(conn, path)
    if found > SCHEMA_VERSION:
        raise SchemaError(
            f"{path} was written by a newer covey (schema version {found}; covey {__version__} "
            f"reads up to {SCHEMA_VERSION}): upgrade covey (pip install -U covey) to resume "
            "this run, or start a new --data-dir"
        )
    if found < SCHEMA_VERSION:
        backup = path.with_name(f"{path.name}.v{found}.bak")
        with sqlite3.connect(backup) as copy:
            conn.backup(copy)
        copy.close()
        for step in range(found, SCHEMA_VERSION):
            conn.execute("BEGIN IMMEDIATE")
            try:
                MIGRATIONS[step](conn)
                conn.execute(
                    "INSERT INTO events (at, kind, peer_id, detail) VALUES (?, ?, '', ?)",
                    (time.time(), "schema migrated", json.dumps({"from": step, "to": step + 1})),
                )
                conn.execute(f"PRAGMA user_version = {step + 1}")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        log.info("migrated %s from schema %d to %d (backup: %s)", path, found, step + 1, backup)
    if missing := missing_columns(conn):
        raise SchemaError(
            f"{path} (schema version {SCHEMA_VERSION}) lacks {', '.join(missing)}: covey's "
            "schema changed without a migration; report this as a bug"
        )
    return found


def _prepare_pg(conn: PgConnection) -> int:
    """`prepare` on PostgreSQL: the same schema and migrations, each run (and the first
    creation) in one transaction holding the write lock, so replicas starting together
    create it once."""
    where = redact(conn.url)
    conn.execute("BEGIN IMMEDIATE")
    try:
        found = start = conn.user_version
        if found == 0 and not conn.tables():
            conn.executescript(SCHEMA + LEDGER_SCHEMA)
            conn.set_user_version(start := SCHEMA_VERSION)
        elif found == 0:
            raise SchemaError(
                f"{where} holds tables but no covey schema version: give covey a database "
                "of its own (CREATE DATABASE ...)"
            )
        elif found > SCHEMA_VERSION:
            raise SchemaError(
                f"{where} was written by a newer covey (schema version {found}; covey "
                f"{__version__} reads up to {SCHEMA_VERSION}): upgrade covey to resume this run"
            )
        for step in range(start, SCHEMA_VERSION):
            MIGRATIONS[step](conn)  # type: ignore[arg-type]
            conn.execute(
                "INSERT INTO events (at, kind, peer_id, detail) VALUES (?, ?, '', ?)",
                (time.time(), "schema migrated", json.dumps({"from": step, "to": step + 1})),
            )
            conn.set_user_version(step + 1)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    if missing := missing_columns(conn):  # type: ignore[arg-type]
        raise SchemaError(
            f"{where} (schema version {SCHEMA_VERSION}) lacks {', '.join(missing)}: covey's "
            "schema changed without a migration; report this as a bug"
        )
    return found


class Database:
    """A thread-safe handle: one connection, serialized by a lock. The coordinator's
    handlers are short; the heavy work (the outer step, evaluation) runs outside it.
    Opening creates, migrates or refuses the schema (`prepare`; `SchemaError`).

    On PostgreSQL (a `postgresql://` URL) the writer's connection is the same, but a read
    outside a transaction of its own thread goes over a connection of that thread: a round
    trip to the server is not a function call, and reads queued behind one lock would
    stall every request. Like any read outside a transaction it sees the last committed
    state."""

    # called inside every writing transaction, under the write lock: a replica's lease
    # check (covey.coordinator.lease.Lease.fence); raising rolls the transaction back
    fence: Callable[[Any], None] | None = None

    def __init__(self, path: Path | str) -> None:
        if is_url(path):
            self._open_pg(str(path))
            return
        path = self.path = Path(path)
        self.url: str | None = None
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        try:
            self.opened_version = prepare(self._conn, path)
        except BaseException:
            self._conn.close()
            raise
        self.lock = threading.RLock()
        # a second connection for reads of the last committed state: in WAL mode it never
        # waits for the writer, so a round's commit does not stall heartbeats and polls
        self._reader = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._reader.row_factory = sqlite3.Row
        self._reader.execute("PRAGMA query_only = ON")
        self._read_lock = threading.Lock()

    def _open_pg(self, url: str) -> None:
        self.url = url
        self.path = Path(redact(url))  # what messages name; no file is opened at it
        self._conn = PgConnection(url)  # type: ignore[assignment]
        try:
            self.opened_version = prepare(self._conn, self.path)  # type: ignore[arg-type]
            self._reader = PgConnection(url, read_only=True)  # type: ignore[assignment]
        except BaseException:
            self._conn.close()
            raise
        self.lock = threading.RLock()
        self._read_lock = threading.Lock()
        # reads outside a transaction go to a connection of the reading thread's own, so
        # they neither queue behind each other's round trips nor behind a writer
        self._local = threading.local()
        self._readers: list[PgConnection] = []

    @property
    def is_postgres(self) -> bool:
        return self.url is not None

    def _own(self) -> Any:
        """On PostgreSQL outside a transaction of this thread: this thread's connection;
        else None (the writer's, under the lock, as on SQLite)."""
        if self.url is None or getattr(self._local, "depth", 0):
            return None
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = self._local.conn = PgConnection(self.url)
            except ValueError as e:  # the server is away: a 503 to the peer, not a 500
                raise DatabaseUnavailable(str(e)) from None
            with self._read_lock:
                self._readers.append(conn)
        return conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception."""
        with self.lock:
            self._conn.execute("BEGIN IMMEDIATE")
            if self.fence is not None:  # a replica: write only while holding the lease
                try:
                    self.fence(self._conn)
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
            local = getattr(self, "_local", None)
            if local is not None:  # PostgreSQL: this thread's reads see its writes
                local.depth = getattr(local, "depth", 0) + 1
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            finally:
                if local is not None:
                    local.depth -= 1
            self._conn.execute("COMMIT")

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        if (own := self._own()) is not None:
            return own.execute(sql, args).fetchall()  # type: ignore[no-any-return]
        with self.lock:
            return self._conn.execute(sql, args).fetchall()

    def one(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Row | None:
        rows = self.query(sql, args)
        return rows[0] if rows else None

    def read_one(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Row | None:
        """The first row of a query against the last committed state, on the reading
        connection: it never waits for a writer's transaction. Not for code inside a
        transaction that must see its own uncommitted writes (use `one`)."""
        if (own := self._own()) is not None:
            return own.execute(sql, args).fetchone()  # type: ignore[no-any-return]
        with self._read_lock:
            return self._reader.execute(sql, args).fetchone()

    def read_all(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        """`read_one`, every row."""
        if (own := self._own()) is not None:
            return own.execute(sql, args).fetchall()  # type: ignore[no-any-return]
        with self._read_lock:
            return self._reader.execute(sql, args).fetchall()

    def get_meta(self, key: str) -> str | None:
        row = self.one("SELECT value FROM meta WHERE key = ?", (key,))
        return None if row is None else row["value"]

    def event(self, conn: sqlite3.Connection, at: float, kind: str, peer: str, detail: Any) -> None:
        conn.execute(
            "INSERT INTO events (at, kind, peer_id, detail) VALUES (?, ?, ?, ?)",
            (at, kind, peer, json.dumps(detail)),
        )

    def close(self) -> None:
        with self.lock, self._read_lock:
            self._conn.close()
            self._reader.close()
            for conn in getattr(self, "_readers", ()):
                conn.close()
