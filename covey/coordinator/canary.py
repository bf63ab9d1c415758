"""Canaries: known-bad contributions the coordinator plants among a validator's checks, so
that a validator cannot be paid for not checking (docs/trust.md).

At each commit, each eligible validator gets a canary with probability `canary_rate`,
decided by the coordinator's signature over (run, round, validator)
(covey.trust.certify.canary_draw): secret until revealed, verifiable afterwards. The canary
is one of the round's sampled contributions that this validator was not drawn to check,
its payload sign-flipped: the same task in every other field, so only re-executing it
tells it apart. A validator that disputes it caught it (a completed check, paid); one that
agrees passed it (no pay, a "penalty" of validator_slash_fraction of its stake); one that
does not report in time missed it. The "canary" ledger entry is written only then.

A canary takes its task id from the `verifications` id sequence (a row with status
'canary' and a negative round, which no payout or pruning query matches), so its id is
indistinguishable from a real check's; the `canaries` table holds what it is.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
from typing import TYPE_CHECKING, Any

from covey.algorithms.codec_base import CodecError
from covey.blobs import BlobError
from covey.protocol import schemas
from covey.trust.certify import canary_draw

if TYPE_CHECKING:
    from covey.algorithms import Strategy, TrainState
    from covey.blobs import BlobStore
    from covey.config import RunConfig

    from .accounts import Accounts
    from .db import Database

log = logging.getLogger("covey.coordinator")

CANARY_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS canaries (vid INTEGER PRIMARY KEY, real_vid INTEGER NOT NULL, "
    "round INTEGER NOT NULL, peer_id TEXT NOT NULL, validator_id TEXT NOT NULL, "
    "cid TEXT NOT NULL, draw TEXT NOT NULL, status TEXT NOT NULL, placed_at REAL NOT NULL);"
)


class Canaries:
    # provided by Coordinator / Verification
    cfg: RunConfig
    run_id: str
    db: Database
    accounts: Accounts
    blobs: BlobStore
    strategy: Strategy
    template: TrainState
    _task: Any

    def _create_canary_table(self) -> None:
        with self.db.lock:
            self.db._conn.executescript(CANARY_SCHEMA)

    def _plant_canaries(self, c: sqlite3.Connection, round_: int, now: float) -> None:
        """Inside the commit's transaction, after the round's checks were drawn."""
        trust, book = self.cfg.trust, self.accounts.book
        if trust.canary_rate <= 0:
            return
        sampled = c.execute(
            "SELECT id, peer_id FROM verifications WHERE round = ? AND status = 'pending' "
            "ORDER BY id",
            (round_,),
        ).fetchall()
        for v in sorted(book.accounts.values(), key=lambda a: a.peer_id):
            if v.role != "validator" or v.banned or v.stake < trust.min_validator_stake:
                continue
            planted, draw = canary_draw(
                self.accounts.identity, self.run_id, round_, v.peer_id, trust.canary_rate
            )
            if not planted:
                continue
            candidates = [
                row
                for row in sampled
                if row["peer_id"] != v.peer_id
                and not book.is_assigned(round_, row["peer_id"], v.peer_id)
            ]
            if not candidates:
                continue
            pick = int(hashlib.sha256(bytes.fromhex(draw)).hexdigest(), 16) % len(candidates)
            real = candidates[pick]
            task = self._task(real["id"])
            numel = sum(
                self.template.params[n].numel() for n in self.strategy.fragment_names(task.fragment)
            )
            codec = self.strategy.codec
            try:
                bad = codec.encode(-codec.decode(self.blobs.get(task.cid), numel))
                cid = self.blobs.put(bad)
            except (BlobError, CodecError) as e:  # never fail a commit for a canary
                log.warning("[round %d] no canary for %s: %s", round_, v.peer_id[:8], e)
                continue
            vid = c.execute(
                "INSERT INTO verifications (round, peer_id, status) VALUES (?, ?, 'canary')",
                (-1 - round_, f"canary:{v.peer_id}:{real['peer_id']}"),
            ).lastrowid
            c.execute(
                "INSERT INTO canaries VALUES (?, ?, ?, ?, ?, ?, ?, 'assigned', ?)",
                (vid, real["id"], round_, real["peer_id"], v.peer_id, cid, draw, now),
            )

    def _canary(self, vid: int) -> Any:
        return self.db.one("SELECT * FROM canaries WHERE vid = ?", (vid,))

    def _canary_task(self, row: Any) -> schemas.VerifyTask:
        """The real task, but for this canary's id and its sign-flipped payload."""
        real = self._task(row["real_vid"])
        return real.model_copy(update={"task_id": row["vid"], "cid": row["cid"]})

    def _next_canary(self, c: sqlite3.Connection, validator_id: str) -> int | None:
        row = c.execute(
            "SELECT vid FROM canaries WHERE validator_id = ? AND status = 'assigned' "
            "ORDER BY vid LIMIT 1",
            (validator_id,),
        ).fetchone()
        return None if row is None else int(row["vid"])

    def _resolve_canary(
        self, c: sqlite3.Connection, row: Any, outcome: str, now: float, reason: str = ""
    ) -> None:
        """Inside a transaction: reveal the canary on the ledger with its outcome (caught,
        passed, missed); pay a catch as a completed check, penalize a pass."""
        validator = row["validator_id"]
        c.execute("UPDATE canaries SET status = ? WHERE vid = ?", (outcome, row["vid"]))
        self.accounts.append(
            c,
            "canary",
            {
                "round": row["round"],
                "peer_id": validator,
                "worker_id": row["peer_id"],
                "cid": row["cid"],
                "draw": row["draw"],
                "outcome": outcome,
            },
            now,
        )
        if outcome == "caught" and self.cfg.trust.check_reward > 0:
            self.accounts.append(
                c,
                "reward",
                {
                    "round": row["round"],
                    "peer_id": validator,
                    "amount": self.cfg.trust.check_reward,
                    "kind": "check",
                    "tokens": 0,
                },
                now,
            )
        elif outcome == "passed":
            self.accounts.append(
                c,
                "penalty",
                {
                    "round": row["round"],
                    "peer_id": validator,
                    "amount": self.accounts.book.penalty_amount(validator),
                    "kind": "canary",
                    "reason": reason or "agreed with a planted sign-flipped payload",
                },
                now,
            )
        log.log(
            logging.WARNING if outcome != "caught" else logging.INFO,
            "[round %d] %s %s a canary",
            row["round"],
            validator[:8],
            outcome,
        )

    def _sweep_canaries(self, c: sqlite3.Connection, now: float) -> None:
        late = c.execute(
            "SELECT * FROM canaries WHERE status = 'assigned' AND placed_at < ?",
            (now - self.cfg.trust.verify_timeout_s,),
        ).fetchall()
        for row in late:
            self._resolve_canary(c, row, "missed", now)

    def canary_blobs(self) -> set[str]:
        """Blobs an open canary still needs (its payload and the real task's inputs)."""
        rows = self.db.query(
            "SELECT k.cid, r.start_cid FROM canaries k JOIN rounds r ON r.round = k.round "
            "WHERE k.status = 'assigned'"
        )
        return {r["cid"] for r in rows} | {r["start_cid"] for r in rows}
