"""The driver's lease: which of several coordinator processes on one PostgreSQL database
(replicas, `covey coordinator --replica`) serves the run. One row of the table `leases`
names the holder and when its lease ends, by the database server's clock (so replicas on
machines whose clocks differ agree). A replica waits until the row is free or expired,
takes it, and then builds its mode from the database as a restarted coordinator does;
it renews the row every third of `ttl_s`, and a replica that cannot renew in time stops
(its process exits; a supervisor starts it again as a standby).

Fencing: every writing transaction of the holder's database checks, under the database's
one write lock, that the row still names it and has not expired (`fence`), so a holder
that was paused past its lease (a stalled VM, a long GC) cannot commit a round after
another replica took over: its transaction is rolled back with `LeaseLost`. A round is
committed by one transaction, so across any number of takeovers each round is committed
once.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

from .db import Database

log = logging.getLogger("covey.coordinator")

LEASE_TABLE = (
    "CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, "
    "expires REAL NOT NULL)"
)
# where the holder serves: the other replicas forward what they do not answer there
# (covey.coordinator.replica); added to lease tables of covey before replicas forwarded
LEASE_URL = "ALTER TABLE leases ADD COLUMN IF NOT EXISTS url TEXT"
DRIVER = "driver"


class LeaseLost(RuntimeError):
    """This process no longer holds the run's lease: it must not write."""


def server_now(c: Any) -> float:
    """The database server's clock, in seconds since the epoch."""
    row = c.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp()) AS t").fetchone()
    return float(row[0])


class Lease:
    """`holder`'s claim on the run's driver lease in `db` (its own handle: the mode's
    database gets `fence`)."""

    def __init__(
        self, db: Database, holder: str, ttl_s: float = 4.0, url: str | None = None
    ) -> None:
        """`url`: where this replica serves the run once it holds the lease (what the
        others forward writes to; `leader`)."""
        if not db.is_postgres:
            raise ValueError("--replica needs --db postgresql://...: replicas share one database")
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s ({ttl_s}) must be > 0")
        self.db, self.holder, self.ttl_s, self.url = db, holder, ttl_s, url
        self.held = False  # set by `lead` once it holds the lease
        with db.transaction() as c:
            c.execute(LEASE_TABLE)
            c.execute(LEASE_URL)

    def try_take(self) -> bool:
        """Take or renew the lease if it is free, expired or ours; whether we hold it."""
        with self.db.transaction() as c:
            now = server_now(c)
            row = c.execute(
                "SELECT holder, expires FROM leases WHERE name = ?", (DRIVER,)
            ).fetchone()
            if row is not None and row["holder"] != self.holder and row["expires"] > now:
                return False
            if row is not None and row["holder"] != self.holder:
                log.warning("taking over the run from %s (lease expired)", row["holder"])
            c.execute(
                "INSERT OR REPLACE INTO leases (name, holder, expires, url) VALUES (?, ?, ?, ?)",
                (DRIVER, self.holder, now + self.ttl_s, self.url),
            )
            return True

    def wait(self, stop: threading.Event, poll_s: float = 0.25) -> bool:
        """Block until we hold the lease (True) or `stop` is set (False)."""
        while not stop.is_set():
            if self.try_take():
                return True
            stop.wait(poll_s)
        return False

    def fence(self, c: Any) -> None:
        """Inside a writing transaction: LeaseLost unless the lease is still ours."""
        row = c.execute("SELECT holder, expires FROM leases WHERE name = ?", (DRIVER,)).fetchone()
        if row is None or row["holder"] != self.holder or row["expires"] <= server_now(c):
            raise LeaseLost(f"{self.holder} no longer holds the run's lease")

    def keep(self, stop: threading.Event, on_lost: Callable[[], None]) -> threading.Thread:
        """A thread renewing the lease every ttl_s / 3 until `stop`; `on_lost()` once a
        renewal fails (another holder, or no answer from the database in time)."""

        def run() -> None:
            while not stop.wait(self.ttl_s / 3):
                try:
                    held = self.try_take()
                except Exception as e:  # the database is unreachable: we cannot hold it
                    log.error("cannot renew the run's lease: %s", e)
                    held = False
                if not held:
                    on_lost()
                    return

        thread = threading.Thread(target=run, name="lease", daemon=True)
        thread.start()
        return thread


def leader(db: Database) -> tuple[str, str | None] | None:
    """(holder, url) of the run's unexpired lease on `db`, by the server's clock; None
    while nobody holds it (a takeover under way) or before any replica started."""
    try:
        row = db.read_one(
            "SELECT holder, url FROM leases WHERE name = ? AND "
            "expires > EXTRACT(EPOCH FROM clock_timestamp())",
            (DRIVER,),
        )
    except sqlite3.OperationalError:  # no lease table yet: no replica has started
        return None
    return None if row is None else (str(row["holder"]), row["url"])


def lead(
    url: str,
    holder: str,
    ttl_s: float,
    on_lost: Callable[[], None],
    *,
    serves_at: str | None = None,
    stop: threading.Event | None = None,
) -> tuple[Lease, threading.Event]:
    """Wait for the lease of the run on `url`, then keep it (renewed by a thread; the
    event stops it); `on_lost()` when it cannot be kept. `serves_at`: this replica's URL,
    recorded in the lease for the others to forward to. With `stop` set before the lease
    is held, it returns without holding it (`lease.held` False)."""
    lease = Lease(Database(url), holder, ttl_s, serves_at)
    stop = stop or threading.Event()
    if not lease.wait(stop):
        return lease, stop
    lease.held = True
    log.info("%s holds the run's lease", holder)
    lease.keep(stop, on_lost)
    return lease, stop
