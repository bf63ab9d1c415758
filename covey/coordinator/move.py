"""Moving a run off its data dir: `covey db migrate DATA_DIR --to postgresql://...`
copies a coordinator's SQLite database into an empty PostgreSQL database, table by table in
one transaction, and checks that every table has the same rows and the ledger the same
entries; with `--blobs s3://...` it copies the data dir's blobs into the bucket too. The
coordinator is then started with `--db`, `--blobs` and `--key` (docs/operations.md).

Every table goes, whichever part of covey made it (the host's, a mode's, the checks'):
each is created on PostgreSQL from its SQLite definition through the dialect seam
(covey.coordinator.dialect), then filled; identity columns continue after the largest id.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from covey.blobs import BlobStore, open_store
from covey.trust import ledger

from .db import Database
from .dialect import ddl
from .pg import PgConnection, is_url

BATCH = 1000


@dataclass
class Moved:
    """What a migration copied: rows per table, ledger entries, blobs."""

    rows: dict[str, int] = field(default_factory=dict)
    entries: int = 0
    blobs: int = 0


def migrate(
    source: Path,
    to: str,
    blobs: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> Moved:
    """Copy the SQLite database `source` (a data dir's coordinator.db, migrated to this
    covey's schema first, as the coordinator would) into the empty PostgreSQL database
    `to`, and with `blobs` the blobs beside it into that bucket. ValueError, with nothing
    copied, when `to` is not a PostgreSQL URL or already holds a run; the copy is one
    transaction, so a failure leaves `to` as it was (but for the empty schema)."""
    if not is_url(to):
        raise ValueError(f"--to {to!r}: give postgresql://user:password@host/dbname")
    if not source.is_file():
        raise ValueError(f"no coordinator database at {source}")
    src = Database(source)  # migrated to SCHEMA_VERSION (with its .bak) if it is older
    try:
        dst = Database(to)
        try:
            moved = _copy(src, dst, progress)
        finally:
            dst.close()
    finally:
        src.close()
    if blobs is not None:
        local = BlobStore(source.parent / "blobs")
        store = open_store(blobs, source.parent / "blobs")
        for cid in local.cids():
            store._landed(cid, local.path(cid))
            moved.blobs += 1
        progress(f"{moved.blobs} blobs copied to {blobs}")
    return moved


def _copy(src: Database, dst: Database, progress: Callable[[str], None]) -> Moved:
    target: PgConnection = dst._conn  # type: ignore[assignment]
    if dst.get_meta("run_id") is not None or dst.one("SELECT 1 FROM ledger LIMIT 1"):
        raise ValueError(f"{dst.path} holds a run already: migrate into an empty database")
    conn: sqlite3.Connection = src._conn
    tables = conn.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "ORDER BY name"
    ).fetchall()
    indexes = conn.execute(
        "SELECT sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
    ).fetchall()
    moved = Moved()
    with dst.transaction() as c:
        for _, sql in tables:
            c.execute(ddl(sql.replace("CREATE TABLE ", "CREATE TABLE IF NOT EXISTS ", 1)))
        for (sql,) in indexes:
            c.execute(sql.replace("CREATE INDEX ", "CREATE INDEX IF NOT EXISTS ", 1))
        for name, _ in tables:
            columns = [r[1] for r in conn.execute(f"PRAGMA table_info({name})")]
            c.execute(f"DELETE FROM {name}")  # the empty schema's own rows (none but events)
            insert = (
                f"INSERT INTO {name} ({', '.join(columns)}) "
                f"VALUES ({', '.join('?' for _ in columns)})"
            )
            cursor = conn.execute(f"SELECT {', '.join(columns)} FROM {name}")
            n = 0
            while rows := cursor.fetchmany(BATCH):
                c.executemany(insert, rows)
                n += len(rows)
            moved.rows[name] = n
            identity = target._table(name)[2]
            if identity is not None:
                c.execute(
                    f"SELECT setval(pg_get_serial_sequence('{name}', '{identity}'), "
                    f"COALESCE(MAX({identity}), 0) + 1, false) FROM {name}"
                )
            progress(f"{name}: {n} rows")
    for name, n in moved.rows.items():  # what was committed is what was read
        got = dst.one(f"SELECT COUNT(*) AS n FROM {name}")
        if got is None or got["n"] != n:
            raise RuntimeError(f"{name}: {n} rows copied, {got and got['n']} found")
    theirs = ledger.read_entries(target)  # type: ignore[arg-type]
    if theirs != ledger.read_entries(conn):
        raise RuntimeError("the copied ledger differs from the source's")
    moved.entries = len(theirs)
    return moved
