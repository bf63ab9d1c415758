"""Heartbeats in memory: a heartbeat costs the coordinator no SQLite write.

Each heartbeat updates a dictionary here; a flusher thread writes the changed peers'
`last_seen` (and the heartbeats' nonces, so a replay is still refused after a restart) to
SQLite in one transaction every `flush_s` seconds. A crash therefore loses at most
`flush_s` seconds of liveness, and nothing else: rounds, contributions and certificates
are written by their own transactions, never through here. Whoever plans a round reads
`last_seen` through `overlay` (the later of the database's and the memory's), so liveness
decisions never wait for a flush.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from covey.trust.identity import nonce_time

from .peers import Peers
from .rejected import Rejected

if TYPE_CHECKING:
    from .db import Database

log = logging.getLogger("covey.coordinator")
FLUSH_S = 2.0  # a crash loses at most this much liveness (a heartbeat interval by default)


class Liveness:
    """Peers' latest heartbeats and the heartbeats' used nonces, flushed in batches.
    Thread-safe; every method but `flush` is O(1) and touches no database."""

    def __init__(self, db: Database, nonce_window_s: float, flush_s: float = FLUSH_S) -> None:
        self.db = db
        self.peers = Peers(db)
        self.flush_s = flush_s
        self.nonce_window_s = nonce_window_s
        self.started_at = time.time()
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # peer id -> latest heartbeat (kept: the overlay)
        self._dirty: dict[str, tuple[float, float | None]] = {}  # not yet in SQLite
        self._used: dict[tuple[str, str], float] = {}  # (peer, nonce) -> when, since start
        self._unwritten: list[tuple[str, str, float]] = []  # nonces not yet in SQLite
        self._pruned_at = time.time()
        self._preload()
        self._thread: threading.Thread | None = None
        self.flushes = 0  # write transactions made, for tests and the bench
        self.beats = 0

    # -- the request path ---------------------------------------------------------------------

    def _preload(self) -> None:
        """Remember the nonces a previous process spent within twice the window (a replay
        older than the window is refused as stale anyway): one read at start, so that no
        heartbeat looks a nonce up in SQLite. Only heartbeats' nonces matter here: another
        endpoint's nonce is signed for that endpoint, never valid as a heartbeat's."""
        cutoff = time.time() - 2 * self.nonce_window_s
        rows = self.db.query("SELECT peer_id, nonce, at FROM nonces WHERE at >= ?", (cutoff,))
        self._used = {(r["peer_id"], r["nonce"]): r["at"] for r in rows}

    def use_nonce(self, peer_id: str, nonce: str, now: float) -> None:
        """Spend a heartbeat's nonce: Rejected(401) if it was used before, by this process
        or (within twice the window) by the one before it (`_preload`). O(1), in memory."""
        nonce_time(nonce)  # IdentityError for a malformed one (auth checked its age)
        key = (peer_id, nonce)
        with self._lock:
            if key in self._used:
                raise Rejected(401, f"replayed request: nonce {nonce} was already used")
            self._used[key] = now
            self._unwritten.append((peer_id, nonce, now))

    def beat(self, peer_id: str, now: float, step_time_s: float | None) -> None:
        """Record a heartbeat; it reaches SQLite with the next flush."""
        with self._lock:
            self._last[peer_id] = max(now, self._last.get(peer_id, 0.0))
            self._dirty[peer_id] = (self._last[peer_id], step_time_s)
            self.beats += 1

    def last_seen(self, peer_id: str, stored: float | None) -> float:
        """The later of `stored` (the database's last_seen) and the latest heartbeat."""
        return max(stored or 0.0, self._last.get(peer_id, 0.0))

    # -- the batch writer ---------------------------------------------------------------------

    def flush(self) -> int:
        """Write the heartbeats and nonces gathered since the last flush in one transaction;
        returns how many peers it updated. A peer that left or died meanwhile is not made
        live again here (its next heartbeat revives it, with its event). On failure the
        batch is put back for the next flush."""
        with self._lock:
            dirty, self._dirty = self._dirty, {}
            nonces, self._unwritten = self._unwritten, []
        if not dirty and not nonces:
            return 0
        try:
            with self.db.transaction() as c:
                self.peers.write_heartbeats(c, [(p, t, s) for p, (t, s) in dirty.items()])
                c.executemany("INSERT OR IGNORE INTO nonces VALUES (?, ?, ?)", nonces)
        except BaseException:
            with self._lock:
                for peer, value in dirty.items():
                    self._dirty.setdefault(peer, value)
                self._unwritten[:0] = nonces
            raise
        self.flushes += 1
        self._prune(time.time())
        return len(dirty)

    def _prune(self, now: float) -> None:
        """Forget used nonces older than twice the window (refused as stale anyway)."""
        if now - self._pruned_at < 60:
            return
        cutoff = now - 2 * self.nonce_window_s
        with self._lock:
            self._used = {k: t for k, t in self._used.items() if t >= cutoff}
            self._pruned_at = now

    def start(self, stop: threading.Event) -> None:
        """Start the flusher thread (once); it flushes every `flush_s` until `stop`."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, args=(stop,), name="liveness-flush", daemon=True
            )
        self._thread.start()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.flush_s):
            try:
                self.flush()
            except Exception:  # a busy or closing database: the batch waits for the next
                log.exception("liveness flush failed")
