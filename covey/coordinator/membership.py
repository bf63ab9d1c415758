"""Membership: peers join with their key and stake, heartbeat, and leave (the
deathrattle). A first join is recorded in the ledger; an excluded key, a short stake or a
worker key posing as a validator (or the reverse) is refused. Whoever drives the run (the
rounds mode) reads the live peers and records no-shows here (covey.protocol.rounds decides
who is alive). Signed requests are authenticated here too (covey.coordinator.auth).

A component: it owns its state (the liveness overlay, the no-show table, and the peers
table through `peers`, covey.coordinator.peers, the one module that reads and writes it)
and reaches the rest of the coordinator only through what `__init__` is given: its config
(`MembershipConfig`, which every mode derives from its spec). It knows nothing of rounds.
The host (covey.coordinator.host) builds it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from covey.protocol import schemas
from covey.protocol.rounds import PeerView, no_show_backoff
from covey.trust.identity import peer_id_of

from . import treasury
from .auth import Auth
from .liveness import FLUSH_S, Liveness
from .peers import Peers
from .rejected import Rejected

if TYPE_CHECKING:
    from covey.config import MembershipConfig

    from .accounts import Accounts
    from .db import Database

log = logging.getLogger("covey.coordinator")
NO_SHOW_TABLE = (
    "CREATE TABLE IF NOT EXISTS no_shows (peer_id TEXT PRIMARY KEY, "
    "consecutive INTEGER NOT NULL, excluded_until REAL NOT NULL)"
)


class Membership:
    """Who takes part: joins, heartbeats, leaves, no-shows, and the signatures and nonces
    of every signed request."""

    def __init__(
        self,
        db: Database,
        cfg: MembershipConfig,
        accounts: Accounts,
        run_id: str,
        *,
        wake: threading.Event,
        stop: threading.Event,
        check_not_halted: Callable[[], None],
    ) -> None:
        """`wake` is set when a peer leaves (the run's driver looks at once); `stop` ends
        the liveness flusher; `check_not_halted` raises Rejected(410) once the run is
        halted (joins and heartbeats are then refused)."""
        self.db = db
        self.cfg = cfg
        self.accounts = accounts
        self.run_id = run_id
        self._wake = wake
        self._stop = stop
        self.check_not_halted = check_not_halted
        self.peers = Peers(db)  # the peers table's one reader and writer
        self.auth = Auth(db, cfg.nonce_window_s)
        self._liveness: Liveness | None = None
        self._liveness_lock = threading.Lock()
        self._no_show_table = False

    # -- checks every endpoint uses ---------------------------------------------------------

    def authenticate(
        self,
        raw: dict[str, Any],
        round: int,
        peer_id: str,
        public_key: str | None = None,
        nonces: Any = None,
    ) -> None:
        """covey.coordinator.auth.Auth.authenticate: Rejected(401/404) unless `raw` is
        signed by `peer_id` for the receiving endpoint and `round`, with a fresh nonce."""
        self.auth.authenticate(raw, round, peer_id, public_key, nonces)

    def poll_signer(self, headers: Mapping[str, str], round_: int, path: str = "") -> str | None:
        """Auth.poll_signer over the ledger's registered keys (no database read): the
        member that signed this long-poll, None when unsigned, Rejected(401) when forged."""
        accounts = self.accounts.book.accounts

        def key_of(peer_id: str) -> str | None:
            account = accounts.get(peer_id)
            return None if account is None else account.public_key

        return self.auth.poll_signer(headers, round_, self.run_id, key_of, path)

    def prune_nonces(self, now: float) -> None:
        """Forget nonces older than the window: requests that old are refused anyway."""
        self.auth.prune_nonces(now)

    def check_run(self, run_id: str) -> None:
        """Rejected(409) for a request naming another run."""
        if run_id != self.run_id:
            raise Rejected(409, f"run_id {run_id} is not this coordinator's run {self.run_id}")

    def check_not_banned(self, peer_id: str) -> None:
        """Rejected(403) for a key the ledger excluded for fraud."""
        account = self.accounts.book.accounts.get(peer_id)
        if account is not None and account.banned:
            raise Rejected(403, f"peer {peer_id[:12]} was excluded from this run for fraud")

    # -- joins, heartbeats, leaves ------------------------------------------------------------

    def join(self, req: schemas.JoinRequest, raw: dict[str, Any]) -> schemas.JoinReply:
        """Go live; the reply grants the first participation lease. Rejected(410) once the
        run is halted: nobody joins it again."""
        self.check_run(req.run_id)
        self.check_not_halted()
        self.register(req.peer_id, req.public_key, req.name, "worker", req.stake, raw)
        now = time.time()
        with self.db.transaction() as c:
            self.peers.announce(
                c,
                req.peer_id,
                device=req.device,
                step_time_s=req.step_time_s,
                bandwidth_mbps=req.bandwidth_mbps,
                accepts_connections=req.accepts_connections,
                blob_url=req.blob_url,
                now=now,
            )
            self.db.event(
                c, now, "join", req.peer_id, req.model_dump(exclude={"run_id", "signature"})
            )
        log.info(
            "[%s %s] joined: %s, %.3f s/step",
            req.name,
            req.peer_id[:8],
            req.device,
            req.step_time_s,
        )
        m = self.cfg
        return schemas.JoinReply(
            peer_id=req.peer_id,
            run_id=self.run_id,
            heartbeat_s=m.heartbeat_s,
            dead_after_s=m.dead_after_s,
            lease_s=m.lease_s,
        )

    def join_validator(self, req: schemas.ValidatorJoin, raw: dict[str, Any]) -> None:
        """A validator registers with its stake and goes live (RL, serving). Rejected(410)
        once the run is halted; the mode answers with what its validators need."""
        self.check_run(req.run_id)
        self.check_not_halted()
        self.register(req.validator_id, req.public_key, req.name, "validator", req.stake, raw)
        with self.db.transaction() as c:
            self.peers.set_live(c, req.validator_id, time.time())
        log.info("[%s %s] validator joined", req.name, req.validator_id[:8])

    def register(
        self, peer_id: str, public_key: str, name: str, role: str, stake: float, raw: dict
    ) -> None:
        """Authenticate a join with the key it presents; record a first join (and its
        stake) in the ledger. Rejected: an id that is not the key's hash, a bad signature,
        an excluded key, a stake below the run's minimum or above what the key holds
        (covey.trust.treasury), a worker key joining as a validator or the reverse."""
        if peer_id_of(public_key) != peer_id:
            raise Rejected(
                400,
                f"peer id {peer_id} is not the hash of its public key ({peer_id_of(public_key)})",
            )
        self.authenticate(raw, -1, peer_id, public_key)
        account = self.accounts.book.accounts.get(peer_id)
        if account is not None and account.banned:
            raise Rejected(403, f"peer {peer_id[:12]} was excluded from this run for fraud")
        if account is not None and account.role != role:
            raise Rejected(409, f"key {peer_id[:12]} is registered as a {account.role}")
        minimum = self.accounts.book.min_stake_of(role)  # the run's signed policy
        if account is None and stake < minimum:
            raise Rejected(
                403,
                f"stake {stake} is below this run's minimum stake {minimum} for a {role} "
                f"(the key must hold it first: the run's owner deposits credits to it with "
                f"`covey ledger deposit`)",
            )
        now = time.time()
        treasury.release_due(self.accounts, now)  # its own matured unbonding, first
        with self.accounts.transaction() as c:
            self.peers.register(c, peer_id, public_key, name, role, now)
            if account is None:
                self.accounts.append(
                    c,
                    "join",
                    {"peer_id": peer_id, "public_key": public_key, "name": name, "role": role},
                    now,
                )
            # a bond of credits the key holds (covey.coordinator.treasury); refused: nothing
            treasury.bond(self.accounts, c, peer_id, stake, minimum, now)

    @property
    def liveness(self) -> Liveness:
        """Heartbeats in memory, flushed to SQLite every FLUSH_S or heartbeat_s if shorter;
        made on first use, its flusher started with it."""
        with self._liveness_lock:
            live = self._liveness
            if live is None:
                # never staler than a heartbeat period: /metrics counts live peers from SQLite
                flush_s = min(FLUSH_S, self.cfg.heartbeat_s)
                live = Liveness(self.db, self.cfg.nonce_window_s, flush_s)
                self._liveness = live
                live.start(self._stop)
        return live

    def heartbeat(self, req: schemas.HeartbeatRequest, raw: dict[str, Any]) -> dict[str, Any]:
        """Renew the peer's participation lease for `lease_s` (covey.trust.halt): its reply
        is the lease. Rejected(410) with the owner's reason once the run is halted. One
        indexed read and no write: the heartbeat (and its nonce) is kept in memory and
        flushed in batches (covey.coordinator.liveness); only reviving a dead peer writes
        at once (its "revived" event)."""
        self.check_run(req.run_id)
        # committed state: a round's commit does not stall this
        row = self.peers.row(req.peer_id, committed=True)
        if row is None or not row["public_key"]:
            raise Rejected(404, f"unknown peer {req.peer_id}: join first")
        live = self.liveness
        self.authenticate(raw, -1, req.peer_id, row["public_key"], nonces=live)
        self.check_not_banned(req.peer_id)
        self.check_not_halted()
        now = time.time()
        if row["state"] == "left":
            raise Rejected(409, f"peer {req.peer_id} has left: join again")
        if row["state"] == "dead":
            with self.db.transaction() as c:
                self.db.event(c, now, "revived", req.peer_id, {})
                self.peers.set_live(c, req.peer_id, now, req.step_time_s)
        live.beat(req.peer_id, now, req.step_time_s)
        return {"ok": True, "lease_s": self.cfg.lease_s}

    def leave(self, req: schemas.LeaveRequest, raw: dict[str, Any]) -> dict[str, Any]:
        """The deathrattle: the peer is gone now, and no round waits for it."""
        self.check_run(req.run_id)
        self.authenticate(raw, -1, req.peer_id)
        now = time.time()
        with self.accounts.transaction() as c:
            if not self.peers.set_left(c, req.peer_id, now):
                raise Rejected(404, f"unknown peer {req.peer_id}")
            self.db.event(c, now, "leave", req.peer_id, {"reason": req.reason})
            self.accounts.append(c, "leave", {"peer_id": req.peer_id, "reason": req.reason}, now)
            treasury.unbond(self.accounts, c, req.peer_id, now)  # slashable until released
        self._wake.set()
        name = self.peers.name(req.peer_id)
        log.info("[%s %s] left: %s", name or "?", req.peer_id[:8], req.reason)
        return {"ok": True}

    def peer_views(self) -> list[PeerView]:
        rows = self.peers.by_role("worker")
        out, live = self.no_shows(), self.liveness
        return [
            PeerView(
                r["peer_id"],
                r["step_time_s"],
                r["bandwidth_mbps"],
                live.last_seen(r["peer_id"], r["last_seen"]),  # heartbeats not yet flushed
                r["state"],
                out.get(r["peer_id"], (0, 0.0))[1],
            )
            for r in rows
        ]

    # -- no-shows: members that neither submit nor leave ------------------------------------

    def no_shows(self) -> dict[str, tuple[int, float]]:
        """peer id -> (consecutive no-shows, sits out rounds until)."""
        if not self._no_show_table:  # kept beside db.py's schema
            with self.db.transaction() as c:
                c.execute(NO_SHOW_TABLE)
            self._no_show_table = True
        rows = self.db.query("SELECT * FROM no_shows")
        return {r["peer_id"]: (r["consecutive"], r["excluded_until"]) for r in rows}

    def record_no_shows(
        self, round_: int, absent: Iterable[str], submitted: Iterable[str], now: float
    ) -> None:
        """At a round's close: members still alive without an accepted contribution (none
        sent, or refused at intake) are no-shows. Each is recorded (the no_shows table and
        a "no show" event) and, when repeated, sits out rounds for a doubling time
        (rounds.no_show_backoff); a member that submitted starts its count again. Each is a
        "no show" ledger entry (covey.trust.entry_schemas) with its count and backoff, so
        `covey ledger verify` replays it: repeated no-shows lower the worker's reputation,
        and a low reputation has its contributions sampled as a new peer's."""
        treasury.release_due(self.accounts, now)  # unbondings come due as rounds close
        m, known = self.cfg, self.no_shows()
        absent = sorted(set(absent) - set(submitted))
        workers = self.accounts.book.accounts
        with self.accounts.transaction() as c:
            for peer in set(submitted) & set(known):
                c.execute("UPDATE no_shows SET consecutive = 0 WHERE peer_id = ?", (peer,))
            for peer in absent:
                count = known.get(peer, (0, 0.0))[0] + 1
                wait = no_show_backoff(count, m.no_show_backoff_s, m.no_show_backoff_max_s)
                c.execute(
                    "INSERT OR REPLACE INTO no_shows VALUES (?, ?, ?)", (peer, count, now + wait)
                )
                detail = {"round": round_, "consecutive": count, "sits_out_s": wait}
                self.db.event(c, now, "no show", peer, detail)
                if peer in workers and workers[peer].role == "worker":
                    self.accounts.append(c, "no show", {"peer_id": peer, **detail}, now)
                log.warning(
                    "[%s - round %d] no-show (%d in a row): sits out rounds for %.0f s",
                    peer[:8],
                    round_,
                    count,
                    wait,
                )
