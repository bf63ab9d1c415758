"""The peers table: the one module that reads and writes it (tests/test_peers_table.py
checks that no other module of covey names it in SQL; db.py creates and migrates it).

One row per key that ever joined: its role (worker, validator, server), its recorded
state (live, dead, left, banned), when it joined and was last heard from, and what it
announced (device, speed, link, its own blob server). Balances, stakes and reputations are
not here: the ledger's book holds them (covey.coordinator.accounts).

`Peers` is stateless over a `Database`, so any part given the database may build one.
Reads use the writer's connection unless `committed=True` (the reading connection: the
last committed state, never waiting for a writer). Writes take the open transaction `c`
of the caller, so they commit, or roll back, with whatever else it writes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .db import Database


class Peers:
    """The repository of the peers table (covey.coordinator.db's SCHEMA)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # -- reads -------------------------------------------------------------------------------

    def row(self, peer_id: str, *, committed: bool = False) -> sqlite3.Row | None:
        """Every column of `peer_id`'s row, or None for a key that never joined."""
        sql, args = "SELECT * FROM peers WHERE peer_id = ?", (peer_id,)
        return self.db.read_one(sql, args) if committed else self.db.one(sql, args)

    def public_key(self, peer_id: str) -> str | None:
        """The key `peer_id` joined with; None for a key that never joined (or has none)."""
        row = self.db.one("SELECT public_key FROM peers WHERE peer_id = ?", (peer_id,))
        return None if row is None or not row["public_key"] else str(row["public_key"])

    def role(self, peer_id: str) -> str | None:
        """`peer_id`'s role, None for a key that never joined."""
        row = self.db.one("SELECT role FROM peers WHERE peer_id = ?", (peer_id,))
        return None if row is None else str(row["role"])

    def name(self, peer_id: str) -> str | None:
        """The display name `peer_id` last joined with, None for a key that never joined."""
        row = self.db.one("SELECT name FROM peers WHERE peer_id = ?", (peer_id,))
        return None if row is None else row["name"]

    def every(self) -> list[sqlite3.Row]:
        """Every row, in the order the peers first joined."""
        return self.db.query("SELECT * FROM peers ORDER BY rowid")

    def by_role(self, role: str) -> list[sqlite3.Row]:
        """Every row of `role`, whatever its state, in the order the peers first joined."""
        return self.db.query("SELECT * FROM peers WHERE role = ? ORDER BY joined_at", (role,))

    def live(self, role: str | None = None, *, committed: bool = False) -> list[sqlite3.Row]:
        """The rows recorded live (of `role`, or of any): the recorded state only; a peer's
        last heartbeat may be in memory still (covey.coordinator.liveness)."""
        sql = "SELECT * FROM peers WHERE state = 'live'"
        args: tuple[str, ...] = ()
        if role is not None:
            sql, args = sql + " AND role = ?", (role,)
        return self.db.read_all(sql, args) if committed else self.db.query(sql, args)

    def live_by_role(self, seen_since: float) -> dict[str, int]:
        """How many peers of each role are recorded live and were heard from since
        `seen_since` (as flushed to SQLite)."""
        rows = self.db.query(
            "SELECT role, COUNT(*) AS n FROM peers WHERE state = 'live' AND last_seen >= ? "
            "GROUP BY role",
            (seen_since,),
        )
        return {str(r["role"]): int(r["n"]) for r in rows}

    def counts(self) -> list[tuple[str, str, int]]:
        """(role, recorded state, how many), ordered by role then state."""
        rows = self.db.query(
            "SELECT role, state, COUNT(*) AS n FROM peers GROUP BY role, state ORDER BY role, state"
        )
        return [(str(r["role"]), str(r["state"]), int(r["n"])) for r in rows]

    def blob_url(self, peer_id: str) -> str | None:
        """The blob server `peer_id` announced, None when it accepts no connections or
        announced none."""
        row = self.db.one(
            "SELECT accepts_connections, blob_url FROM peers WHERE peer_id = ?", (peer_id,)
        )
        if row is None or not row["accepts_connections"] or not row["blob_url"]:
            return None
        return str(row["blob_url"])

    def blob_urls(self, *, live_role: str | None = None) -> dict[str, str]:
        """peer id -> the blob server it announced, for peers that accept connections;
        with `live_role`, only those of that role recorded live."""
        sql = (
            "SELECT peer_id, blob_url FROM peers WHERE accepts_connections = 1 "
            "AND blob_url IS NOT NULL AND blob_url != ''"
        )
        args: tuple[str, ...] = ()
        if live_role is not None:
            sql, args = sql + " AND role = ? AND state = 'live'", (live_role,)
        return {str(r["peer_id"]): str(r["blob_url"]) for r in self.db.query(sql, args)}

    # -- writes, inside the caller's transaction ---------------------------------------------

    def register(
        self, c: sqlite3.Connection, peer_id: str, public_key: str, name: str, role: str, now: float
    ) -> None:
        """A join: a new key's row (live, 1 s/step until measured), or a known key's new
        display name."""
        c.execute(
            "INSERT INTO peers (peer_id, public_key, name, role, joined_at, last_seen, "
            "state, step_time_s) VALUES (?, ?, ?, ?, ?, ?, 'live', 1.0) "
            "ON CONFLICT(peer_id) DO UPDATE SET name = excluded.name",
            (peer_id, public_key, name, role, now, now),
        )

    def announce(
        self,
        c: sqlite3.Connection,
        peer_id: str,
        *,
        device: str,
        step_time_s: float,
        bandwidth_mbps: float | None,
        accepts_connections: bool,
        blob_url: str | None,
        now: float,
    ) -> None:
        """A worker's join: what it announced about itself; it is live from `now`."""
        c.execute(
            "UPDATE peers SET device = ?, step_time_s = ?, bandwidth_mbps = ?, "
            "accepts_connections = ?, blob_url = ?, last_seen = ?, state = 'live' "
            "WHERE peer_id = ?",
            (device, step_time_s, bandwidth_mbps, int(accepts_connections), blob_url, now, peer_id),
        )

    def set_live(
        self, c: sqlite3.Connection, peer_id: str, now: float, step_time_s: float | None = None
    ) -> None:
        """Live again from `now` (a validator's join, a dead peer's heartbeat); its speed
        when one is given."""
        c.execute(
            "UPDATE peers SET last_seen = ?, state = 'live', "
            "step_time_s = COALESCE(?, step_time_s) WHERE peer_id = ?",
            (now, step_time_s, peer_id),
        )

    def set_left(self, c: sqlite3.Connection, peer_id: str, now: float) -> bool:
        """The deathrattle: left at `now`. False for a key that never joined."""
        n = c.execute(
            "UPDATE peers SET state = 'left', last_seen = ? WHERE peer_id = ?", (now, peer_id)
        ).rowcount
        return n > 0

    def set_dead(self, c: sqlite3.Connection, peer_id: str) -> None:
        """Silent past dead_after_s: out of the rounds until a heartbeat revives it."""
        c.execute("UPDATE peers SET state = 'dead' WHERE peer_id = ?", (peer_id,))

    def ban(self, c: sqlite3.Connection, peer_id: str) -> None:
        """Convicted of fraud (the ledger's slash excludes the key; this is its row)."""
        c.execute("UPDATE peers SET state = 'banned' WHERE peer_id = ?", (peer_id,))

    def set_step_time(self, c: sqlite3.Connection, peer_id: str, step_time_s: float) -> None:
        """The speed measured from a contribution: the next round plans with it."""
        c.execute("UPDATE peers SET step_time_s = ? WHERE peer_id = ?", (step_time_s, peer_id))

    def count_contributions(self, c: sqlite3.Connection, peer_ids: Iterable[str]) -> None:
        """One more accepted contribution for each of `peer_ids` (a committed round's)."""
        c.executemany(
            "UPDATE peers SET contributions = contributions + 1 WHERE peer_id = ?",
            [(p,) for p in peer_ids],
        )

    def touch_live(self, c: sqlite3.Connection, now: float) -> None:
        """A restarted coordinator: every live peer counts as heard from at `now`, so it
        has dead_after_s to reconnect before it is declared dead."""
        c.execute("UPDATE peers SET last_seen = ? WHERE state = 'live'", (now,))

    def write_heartbeats(
        self, c: sqlite3.Connection, beats: Iterable[tuple[str, float, float | None]]
    ) -> None:
        """(peer id, heard at, step time or None) of a batch of heartbeats. Only live rows
        change: a peer that left or died meanwhile is not made live again here, and
        last_seen never goes back."""
        c.executemany(
            "UPDATE peers SET last_seen = MAX(COALESCE(last_seen, 0), ?), "
            "step_time_s = COALESCE(?, step_time_s) WHERE peer_id = ? AND state = 'live'",
            [(t, step, peer) for peer, t, step in beats],
        )
