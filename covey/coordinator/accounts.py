"""The coordinator's side of the ledger: entries are appended inside the same SQLite
transaction as the state change they record, so a crash leaves both or neither; the
in-memory `Book` (covey.trust.incentives) follows the ledger entry by entry, after each
commit, and is what the coordinator reports (`/v1/ledger/balances`, `ledger-balances.json`).
Nothing here is a side table: every balance is the ledger replayed.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from covey.trust import ledger
from covey.trust.heads import Head, sign_head
from covey.trust.identity import Identity
from covey.trust.incentives import Book
from covey.trust.treasury import spec_deposits

from .db import Database

log = logging.getLogger("covey.coordinator")


class Accounts:
    def __init__(self, db: Database, identity: Identity, data_dir: Path) -> None:
        self.db = db
        self.identity = identity
        self.balances_path = data_dir / "ledger-balances.json"
        self._local = threading.local()
        self._head: Head | None = None  # the last head signed, reused until the ledger grows
        if 0 < db.opened_version < 2:  # covey 0.1.0 signed entries without the prefix
            with db.transaction() as c:
                if n := ledger.resign_legacy(c, identity):
                    log.info("re-signed %d ledger entries of covey 0.1.0 with the prefix", n)
        with db.lock:
            self.book = Book.replay(ledger.read_entries(db._conn))
        self._write_balances()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A database transaction in which `append` may write ledger entries. Each entry
        goes through the book as it is written, so an entry that breaks the ledger's rules
        rolls the whole transaction back; after any rollback the book is replayed from
        the ledger again."""
        with self.db.lock:
            if getattr(self._local, "open", False):  # nested: part of the enclosing one
                yield self.db._conn
                return
            self._local.open, self._local.wrote = True, False
            try:
                with self.db.transaction() as c:
                    yield c
            except BaseException:
                if self._local.wrote:
                    self.book = Book.replay(ledger.read_entries(self.db._conn))
                raise
            finally:
                self._local.open = False
            if self._local.wrote:
                self._write_balances()

    def append(self, c: sqlite3.Connection, type: str, payload: dict[str, Any], at: float) -> None:
        if not getattr(self._local, "open", False):
            raise RuntimeError("ledger entries are appended inside Accounts.transaction()")
        self._local.wrote = True
        self.book.apply(ledger.append(c, self.identity, type, payload, at))
        if type == "run created":  # the spec's grants to keys: the treasury at start
            for deposit in spec_deposits(payload["spec"]):
                self.book.apply(ledger.append(c, self.identity, "deposit", deposit, at))

    def entries(self, start: int, limit: int) -> list[dict[str, Any]]:
        with self.db.lock:
            rows = ledger.read_entries(self.db._conn, start=start, limit=limit)
        return [json.loads(ledger.to_line(e)) for e in rows]

    def head(self) -> dict[str, Any]:
        """The ledger's current head, signed (covey.trust.heads): (run id, length, hash of
        the last entry). What receipts and certificates carry and GET /v1/ledger/head
        returns; peers keep it as evidence against a ledger cut short or rolled back."""
        # the reading connection: the last COMMITTED entry, even when called inside an
        # open transaction, so no head ever names an entry a rollback or crash could undo
        row = self.db.read_one("SELECT idx, hash FROM ledger ORDER BY idx DESC LIMIT 1")
        if row is None:
            raise RuntimeError("the ledger has no entry yet: no head to sign")
        length, digest = int(row[0]) + 1, str(row[1])
        head = self._head
        if head is None or head.length != length or head.hash != digest:
            run_id = self.book.run_id
            if run_id is None:
                raise RuntimeError("the ledger names no run yet: no head to sign")
            head = self._head = sign_head(self.identity, run_id, length, digest)
        return head.to_dict()

    def find(self, type: str, **match: Any) -> dict[str, Any] | None:
        """The latest entry of `type` whose payload has these values (receipts), found by
        SQLite's JSON functions rather than by reading entries one by one."""
        where = "".join(f" AND json_extract(payload, '$.{key}') = ?" for key in match)
        row = self.db.one(
            f"SELECT idx FROM ledger WHERE type = ?{where} ORDER BY idx DESC LIMIT 1",
            (type, *match.values()),
        )
        return None if row is None else self.entries(row["idx"], 1)[0]

    def _write_balances(self) -> None:
        tmp = self.balances_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.book.summary(), indent=1, sort_keys=True))
        tmp.replace(self.balances_path)
