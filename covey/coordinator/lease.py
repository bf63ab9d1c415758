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
import threading
from collections.abc import Callable
from typing import Any

from .db import Database

log = logging.getLogger("covey.coordinator")

LEASE_TABLE = (
    "CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, "
    "expires REAL NOT NULL)"
)
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

    def __init__(self, db: Database, holder: str, ttl_s: float = 4.0) -> None:
        if not db.is_postgres:
            raise ValueError("--replica needs --db postgresql://...: replicas share one database")
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s ({ttl_s}) must be > 0")
        self.db, self.holder, self.ttl_s = db, holder, ttl_s
        with db.transaction() as c:
            c.execute(LEASE_TABLE)

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
                "INSERT OR REPLACE INTO leases VALUES (?, ?, ?)",
                (DRIVER, self.holder, now + self.ttl_s),
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


def lead(
    url: str, holder: str, ttl_s: float, on_lost: Callable[[], None]
) -> tuple[Lease, threading.Event]:
    """Wait for the lease of the run on `url`, then keep it (renewed by a thread; the
    event stops it); `on_lost()` when it cannot be kept."""
    lease = Lease(Database(url), holder, ttl_s)
    stop = threading.Event()
    lease.wait(stop)
    log.info("%s holds the run's lease", holder)
    lease.keep(stop, on_lost)
    return lease, stop
