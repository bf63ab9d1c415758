"""A PostgreSQL connection that speaks `sqlite3`'s connection API, so every part of the
coordinator runs its SQL unchanged on either database (the rewriting: covey.coordinator.
dialect). Only what covey uses is here: `execute`, `executemany`, `executescript`, rows by
position and by name, `fetchone`, `fetchall`, iteration, `rowcount`, `lastrowid`; and the
schema version (`user_version`, SQLite's PRAGMA of that name, kept in the table
`covey_schema`).

Errors come back as `sqlite3`'s classes (IntegrityError for a broken constraint,
OperationalError for a missing table, DatabaseError otherwise), so the callers' handling
(a replayed nonce, a second submission) is the same on both databases.

A lost connection (the server restarted, a failover of a managed database, a backend
terminated) is made again: a statement outside a transaction, and a transaction's BEGIN,
reconnect for up to RECONNECT_S and run again; a statement inside a transaction cannot
(the server dropped the transaction with the connection), so it raises
`DatabaseUnavailable`, the transaction is rolled back whole, and the next one reconnects.
The coordinator's apps answer `DatabaseUnavailable` with 503 (covey.coordinator.host_app):
the peer retries, nothing was written, nothing is lost.

psycopg (3) is imported here only: `pip install 'covey[scale]'` brings it; a coordinator
on SQLite never imports this module.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Iterator, Sequence
from decimal import Decimal
from typing import Any

from . import dialect

log = logging.getLogger("covey.db")

# the one lock every writing transaction takes (pg_advisory_xact_lock): PostgreSQL's
# BEGIN IMMEDIATE, shared by every process on the database
WRITE_LOCK = 0x636F766579  # "covey"
SCHEMA_TABLE = "CREATE TABLE IF NOT EXISTS covey_schema (version BIGINT NOT NULL)"
RECONNECT_S = 5.0  # how long one statement waits for a lost server to answer again
CONNECT_TIMEOUT_S = 2  # one connection attempt (libpq's connect_timeout)


class DatabaseUnavailable(sqlite3.OperationalError):
    """The database server cannot be reached now (a 503 to the peer: retry); what the
    failed transaction wrote was rolled back."""


def is_url(location: object) -> bool:
    """Whether a --db value names a PostgreSQL server rather than a SQLite file."""
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


def redact(url: str) -> str:
    """`url` without its password, for messages and logs."""
    head, sep, tail = url.partition("://")
    if "@" in tail:
        cred, _, rest = tail.rpartition("@")
        tail = f"{cred.split(':', 1)[0]}:***@{rest}" if ":" in cred else tail
    return head + sep + tail


class Row(tuple):  # type: ignore[type-arg]
    """A result row, by position (`row[0]`, `tuple(row)`) and by column name (`row["x"]`),
    like `sqlite3.Row`."""

    _names: dict[str, int]

    def __new__(cls, names: dict[str, int], values: Sequence[Any]) -> Row:
        row = super().__new__(cls, values)
        row._names = names
        return row

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        if isinstance(key, str):
            return super().__getitem__(self._names[key])
        return super().__getitem__(key)

    def keys(self) -> list[str]:
        return list(self._names)


def _value(v: Any) -> Any:
    if isinstance(v, Decimal):  # SUM over integers: numeric
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, memoryview):
        return bytes(v)
    return v


def _arg(v: Any) -> Any:
    return int(v) if isinstance(v, bool) else v  # SQLite stores booleans as integers


class Result:
    """What `execute` returns: the rows (fetched at once), rowcount and lastrowid."""

    def __init__(self, rows: list[Row], rowcount: int, lastrowid: int | None) -> None:
        self._rows, self._next = rows, 0
        self.rowcount, self.lastrowid = rowcount, lastrowid

    def fetchone(self) -> Row | None:
        if self._next >= len(self._rows):
            return None
        self._next += 1
        return self._rows[self._next - 1]

    def fetchall(self) -> list[Row]:
        rest, self._next = self._rows[self._next :], len(self._rows)
        return rest

    def __iter__(self) -> Iterator[Row]:
        return iter(self.fetchall())


def _mapped(e: Exception) -> sqlite3.Error:
    import psycopg

    if isinstance(e, psycopg.IntegrityError):
        return sqlite3.IntegrityError(str(e).strip())
    if isinstance(e, (psycopg.ProgrammingError, psycopg.OperationalError)):
        return sqlite3.OperationalError(str(e).strip())
    return sqlite3.DatabaseError(str(e).strip())


class PgConnection:
    """One psycopg connection in autocommit mode; transactions are the caller's explicit
    BEGIN (IMMEDIATE) / COMMIT / ROLLBACK, as on a `sqlite3` connection opened with
    isolation_level=None."""

    def __init__(self, url: str, *, read_only: bool = False) -> None:
        try:
            import psycopg
        except ImportError as e:  # pragma: no cover - the extra is missing
            raise ValueError(
                "--db postgresql://... needs psycopg: pip install 'covey[scale]'"
            ) from e
        self.url, self.read_only = url, read_only
        self._in_transaction = False
        try:
            self._connect()
        except psycopg.Error as e:
            raise ValueError(f"cannot connect to {redact(url)}: {str(e).strip()}") from None
        self._tables: dict[str, tuple[list[str], list[list[str]], str | None]] = {}

    def _connect(self) -> None:
        import psycopg

        self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
        if self.read_only:
            self._conn.execute("SET default_transaction_read_only = on")

    def _lost(self) -> bool:
        return bool(self._conn.closed or self._conn.broken)

    def _reconnect(self) -> None:
        """Connect again, trying for up to RECONNECT_S; DatabaseUnavailable if it cannot."""
        import psycopg

        deadline, delay = time.monotonic() + RECONNECT_S, 0.1
        while True:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            try:
                self._connect()
                log.warning("reconnected to %s", redact(self.url))
                return
            except psycopg.Error as e:
                if time.monotonic() + delay > deadline:
                    raise DatabaseUnavailable(
                        f"the database {redact(self.url)} does not answer: {str(e).strip()}"
                    ) from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    # -- the sqlite3 API -----------------------------------------------------------------

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        word = sql.lstrip()[:6].upper()
        if word == "PRAGMA":
            return self._pragma(sql)
        if word.rstrip() == "BEGIN":
            self._run("BEGIN", None)  # outside a transaction still: reconnects if it must
            self._in_transaction = True
            return self._run("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
        if word in ("COMMIT", "ROLLBA"):
            try:
                return self._run(sql, None)
            except DatabaseUnavailable:
                if word == "COMMIT":
                    raise  # whether it committed is unknown: the peer's retry will tell
                return Result([], -1, None)  # the server dropped it with the connection
            finally:
                self._in_transaction = False
        st = dialect.translate(sql, bool(args))
        text = st.sql
        if st.replace_table is not None:
            columns, keys, _ = self._table(st.replace_table)
            text = dialect.upsert(text, columns, keys)
        params = [_arg(a) for a in args] if args else None
        if params is not None:
            for i in st.limit_args:
                if isinstance(params[i], int) and params[i] < 0:
                    params[i] = None
            for i in st.json_args:
                params[i] = json.dumps(params[i])
        identity = None
        if word == "INSERT" and " RETURNING " not in text.upper():
            table = text.split(None, 3)[2].split("(")[0]
            identity = self._table(table)[2]
            if identity is not None:
                text += f" RETURNING {identity}"
        result = self._run(text, params)
        if word in ("CREATE", "ALTER ", "DROP T"):
            self._tables.clear()
        if identity is not None:
            rows = result.fetchall()
            result = Result([], result.rowcount, rows[-1][0] if rows else None)
        return result

    def executemany(self, sql: str, seq: Sequence[Sequence[Any]]) -> Result:
        st = dialect.translate(sql, True)
        if st.replace_table is not None or st.limit_args or st.json_args:
            total = 0
            for args in seq:  # statements that need their arguments looked at, one by one
                total += max(self.execute(sql, args).rowcount, 0)
            return Result([], total, None)
        import psycopg

        try:  # one round of the pipeline for every row (no lastrowid here, as in sqlite3)
            with self._conn.cursor() as cur:
                cur.executemany(st.sql, [[_arg(a) for a in args] for args in seq])
                return Result([], cur.rowcount, None)
        except psycopg.Error as e:
            if self._lost():
                if not self._in_transaction:
                    self._reconnect()
                raise DatabaseUnavailable(f"the connection to the database was lost: {e}") from e
            raise _mapped(e) from e

    def executescript(self, script: str) -> None:
        for statement in dialect.split_script(script):
            self.execute(statement)

    def close(self) -> None:
        self._conn.close()

    # -- the schema version and the table catalogue ---------------------------------------

    @property
    def user_version(self) -> int:
        self._run(SCHEMA_TABLE, None)
        row = self._run("SELECT version FROM covey_schema", None).fetchone()
        return 0 if row is None else int(row[0])

    def set_user_version(self, version: int) -> None:
        self._run(SCHEMA_TABLE, None)
        self._run("DELETE FROM covey_schema", None)
        self._run("INSERT INTO covey_schema VALUES (%s)", (int(version),))

    def tables(self) -> list[str]:
        rows = self._run(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = "
            "current_schema() AND table_name != 'covey_schema' ORDER BY table_name",
            None,
        )
        return [str(r[0]) for r in rows]

    def columns(self, table: str) -> list[str]:
        return self._table(table)[0]

    def _table(self, table: str) -> tuple[list[str], list[list[str]], str | None]:
        """(columns in order, unique keys with the primary key first, identity column)."""
        if table not in self._tables:
            cols = self._run(
                "SELECT column_name, is_identity FROM information_schema.columns WHERE "
                "table_schema = current_schema() AND table_name = %s ORDER BY ordinal_position",
                (table,),
            ).fetchall()
            keys = self._run(
                "SELECT i.indisprimary, array_agg(a.attname::text ORDER BY k.n) FROM pg_index i "
                "JOIN pg_class t ON t.oid = i.indrelid JOIN pg_namespace s ON s.oid = "
                "t.relnamespace AND s.nspname = current_schema() CROSS JOIN LATERAL "
                "unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) JOIN pg_attribute a ON "
                "a.attrelid = t.oid AND a.attnum = k.attnum WHERE i.indisunique AND "
                "t.relname = %s GROUP BY i.indexrelid, i.indisprimary "
                "ORDER BY i.indisprimary DESC, i.indexrelid",
                (table,),
            ).fetchall()
            identity = next((str(c[0]) for c in cols if c[1] == "YES"), None)
            self._tables[table] = ([str(c[0]) for c in cols], [list(k[1]) for k in keys], identity)
        return self._tables[table]

    # -- running ---------------------------------------------------------------------------

    def _pragma(self, sql: str) -> Result:
        body = sql.strip()[6:].strip().rstrip(";")
        name, _, value = body.partition("=")
        if name.strip().lower() == "user_version":
            if value.strip():
                self.set_user_version(int(value))
                return Result([], 0, None)
            return Result([Row({"user_version": 0}, (self.user_version,))], -1, None)
        return Result([], -1, None)  # journal_mode, synchronous, ...: SQLite's own

    def _run(self, sql: str, params: Sequence[Any] | None) -> Result:
        import psycopg

        try:
            cur = self._conn.execute(sql, params)
        except psycopg.Error as e:
            if not self._lost():
                raise _mapped(e) from e
            if self._in_transaction:  # the server dropped the transaction with it
                raise DatabaseUnavailable(
                    f"the connection to {redact(self.url)} was lost in a transaction: "
                    f"{str(e).strip()}"
                ) from e
            self._reconnect()  # nothing of ours was under way: run it again
            try:
                cur = self._conn.execute(sql, params)
            except psycopg.Error as e2:
                raise _mapped(e2) from e2
        rows: list[Row] = []
        if cur.description is not None:
            names = {c.name: i for i, c in enumerate(cur.description)}
            rows = [Row(names, [_value(v) for v in r]) for r in cur.fetchall()]
        return Result(rows, cur.rowcount, None)
