"""Which validator checks which contribution: drawn from the public beacon, not first come
(docs/trust.md).

A sampled contribution needs `validators_per_check` checks when its peer is new or has a
low reputation, one otherwise (`Book.checks_needed`). Its validators are drawn by
`Book.draw`: every eligible validator (staked, not banned, not the worker, not tried on it,
under `validator_round_cap` checks this round) ranks by sha256(beacon, round, peer,
validator), where the beacon is the hash of the round certificate before the round was
accepted; the first ones are assigned. Each draw is an "assignment" ledger entry that the
book checks by recomputing it, so `covey ledger verify` recomputes every draw.

A validator sees only its own assigned checks (`/v1/verify/claim`). One it does not report
within `check_timeout_s` (covey.trust.policy: verify_timeout_s plus the evidence a check
may fetch at the worker's paced trust.evidence_mbps) is a missed check ("verification"
outcome "expired", naming it: counts against it), and the next validator in beacon order
is drawn in its place. A contribution is paid only once its checks are complete
(`Book.checks_complete`): a key that claims and never reports delays nothing but its own
standing, is never paid for it, and cannot take checks away from an honest validator.

The `checks` table is this module's own: one row per (verification, validator).
"""

from __future__ import annotations

import functools
import logging
import sqlite3
from typing import TYPE_CHECKING, Any

from covey.trust.certify import audit_draw
from covey.trust.policy import check_timeout_s

if TYPE_CHECKING:
    from covey.algorithms.base import Strategy
    from covey.config import RunConfig

    from .accounts import Accounts
    from .db import Database

log = logging.getLogger("covey.coordinator")

CHECKS_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS checks (vid INTEGER NOT NULL, validator_id TEXT NOT NULL, "
    "status TEXT NOT NULL, assigned_at REAL NOT NULL, PRIMARY KEY (vid, validator_id));"
    "CREATE TABLE IF NOT EXISTS audits (vid INTEGER PRIMARY KEY, audited INTEGER NOT NULL);"
)
OPEN = ("pending", "claimed")  # verification statuses still waiting for checks
AUDIT_WAIT_ROUNDS = 10  # an audit drawn with no validator left to take it waits this long


class Assignments:
    # provided by Coordinator
    cfg: RunConfig
    db: Database
    accounts: Accounts
    run_id: str
    strategy: Strategy

    @functools.cached_property
    def check_timeout_s(self) -> float:
        """How long a drawn check may be held before it is missed: verify_timeout_s plus
        its evidence (one published state of this run's model and method, twice) at the
        worker's paced rate (covey.trust.policy.check_timeout_s)."""
        from covey.trust.verify import published_state_nbytes  # torch-heavy: coordinator only

        trust = self.cfg.trust
        size = published_state_nbytes(self.strategy)
        return check_timeout_s(trust.verify_timeout_s, size, trust.evidence_mbps)

    def _create_checks_table(self) -> None:
        with self.db.lock:
            self.db._conn.executescript(CHECKS_SCHEMA)

    def _assign(
        self, c: sqlite3.Connection, vid: int, round_: int, peer_id: str, reason: str, now: float
    ) -> list[str]:
        """Inside a transaction: draw the validators this contribution still needs (none
        when none are eligible: then it waits for one), write the "assignment" entry and
        the checks. Returns the validators drawn."""
        book = self.accounts.book
        chosen = book.draw(round_, peer_id, book.checks_needed(round_, peer_id))
        if not chosen:
            return []
        self.accounts.append(
            c,
            "assignment",
            {
                "round": round_,
                "peer_id": peer_id,
                "beacon": book.beacon(round_),
                "validators": chosen,
                "reason": reason,
            },
            now,
        )
        for validator in chosen:
            c.execute(
                "INSERT OR REPLACE INTO checks VALUES (?, ?, 'assigned', ?)",
                (vid, validator, now),
            )
        return chosen

    def _sweep(self, c: sqlite3.Connection, now: float) -> None:
        """Inside a transaction: checks held past `check_timeout_s` are missed (recorded
        against their validator) and every open contribution short of validators gets
        the next ones in beacon order (validators that joined since included)."""
        timeout = self.check_timeout_s
        late = c.execute(
            "SELECT k.vid, k.validator_id, v.round, v.peer_id FROM checks k "
            "JOIN verifications v ON v.id = k.vid "
            "WHERE k.status = 'assigned' AND k.assigned_at < ?",
            (now - timeout,),
        ).fetchall()
        for row in late:
            c.execute(
                "UPDATE checks SET status = 'missed' WHERE vid = ? AND validator_id = ?",
                (row["vid"], row["validator_id"]),
            )
            self.accounts.append(
                c,
                "verification",
                {
                    "round": row["round"],
                    "peer_id": row["peer_id"],
                    "validator_id": row["validator_id"],
                    "outcome": "expired",
                    "distance": None,
                    "exact": False,
                },
                now,
            )
            log.warning(
                "[round %d] %s did not report its check of %s within %.0f s: reassigned",
                row["round"],
                row["validator_id"][:8],
                row["peer_id"][:8],
                timeout,
            )
        waiting = c.execute(
            f"SELECT id, round, peer_id FROM verifications WHERE status IN {OPEN} ORDER BY id"
        ).fetchall()
        for row in waiting:
            self._assign(c, row["id"], row["round"], row["peer_id"], "reassign", now)
        self._audit_cleared(c, now)

    def _audit_cleared(self, c: sqlite3.Connection, now: float) -> None:
        """Inside a transaction: each contribution cleared by its checks (all agreeing) is
        audited once with probability audit_rate, by the coordinator's signed draw: one
        more validator, not yet tried on it, is drawn ("assignment", reason "audit"), and
        it is open (its pay held) until that check is in."""
        rate = self.cfg.trust.audit_rate
        if rate <= 0:
            return
        book = self.accounts.book
        newest = c.execute("SELECT MAX(round) AS r FROM verifications").fetchone()["r"] or 0
        cleared = c.execute(  # audits.audited: 0 no, 1 assigned, 2 drawn and waiting for a
            # validator not yet tried (AUDIT_WAIT_ROUNDS at most), 3 none came
            "SELECT v.id, v.round, v.peer_id FROM verifications v LEFT JOIN audits a "
            "ON a.vid = v.id WHERE v.status = 'agree' AND (a.vid IS NULL OR a.audited = 2) "
            "ORDER BY v.id"
        ).fetchall()
        for row in cleared:
            rnd, peer = row["round"], row["peer_id"]
            audited, draw = audit_draw(self.accounts.identity, self.run_id, rnd, peer, rate)
            validators = book.draw(rnd, peer, 1) if audited else []
            state = 0 if not (audited and book.cleared(rnd, peer)) else 1 if validators else 2
            if state == 2 and rnd < newest - AUDIT_WAIT_ROUNDS:
                state = 3
            c.execute("INSERT OR REPLACE INTO audits VALUES (?, ?)", (row["id"], state))
            if state != 1:
                continue  # not audited, or drawn with no validator left to take it yet
            self.accounts.append(
                c,
                "assignment",
                {
                    "round": rnd,
                    "peer_id": peer,
                    "beacon": book.beacon(rnd),
                    "validators": validators,
                    "reason": "audit",
                    "draw": draw,
                },
                now,
            )
            c.execute("UPDATE verifications SET status = 'pending' WHERE id = ?", (row["id"],))
            for validator in validators:
                c.execute(
                    "INSERT OR REPLACE INTO checks VALUES (?, ?, 'assigned', ?)",
                    (row["id"], validator, now),
                )
            log.info("[round %d] %s's cleared contribution audited", rnd, peer[:8])

    def _assigned_task(self, c: sqlite3.Connection, validator_id: str) -> int | None:
        """The oldest open check assigned to this validator (its verification id)."""
        row = c.execute(
            "SELECT k.vid FROM checks k JOIN verifications v ON v.id = k.vid "
            "WHERE k.validator_id = ? AND k.status = 'assigned' ORDER BY k.vid LIMIT 1",
            (validator_id,),
        ).fetchone()
        return None if row is None else int(row["vid"])

    def _holds_check(self, vid: int, validator_id: str) -> bool:
        row = self.db.one(
            "SELECT status FROM checks WHERE vid = ? AND validator_id = ?", (vid, validator_id)
        )
        return row is not None and row["status"] == "assigned"

    def _end_check(self, c: sqlite3.Connection, vid: int, validator_id: str, status: str) -> None:
        c.execute(
            "UPDATE checks SET status = ? WHERE vid = ? AND validator_id = ?",
            (status, vid, validator_id),
        )

    def _check_rows(self, vid: int) -> list[Any]:
        return self.db.query("SELECT * FROM checks WHERE vid = ? ORDER BY assigned_at", (vid,))
