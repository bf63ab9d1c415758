"""Canaries in the serving mode: known-bad answers the server plants among a validator's
checks, so that a validator that agrees without checking is caught (the RL mode's
covey.rl.canaries, and the rounds mode's covey.coordinator.canary, do the same).

When validator V claims work, the server looks at the oldest drawn answers waiting for a
check that V is not assigned (another live validator is) and was never given, and signs
(run, answer, V) (covey.trust.certify.canary_draw): V gets a canary of that answer when the
draw is below the trust table's `canary_rate`, secret until revealed on the ledger and
verifiable afterwards by anyone (the book's "canary" handler checks the signature and the
rate). The canary is the real answer (its number, job, worker and tokens) with its proof's
coefficients replaced by pseudo-random ones (covey.rl.canaries.scramble_proof: the chunk
layout and moduli kept, so it parses like any proof): only a prefill tells it from the
real one. V joins the real answer's `tried`, so it is not handed the real answer too while
another live validator has not tried it.

Reporting it bad is "caught" (a completed check, paid check_reward); reporting it good is
"passed" (a "penalty" of kind canary: validator_slash_fraction of V's stake); not reporting
within claim_timeout_s is "missed" (a missed check). The "canary" ledger entry is written
only then.

Known leaks, as in the RL mode: the real answer's verdict is public once decided (its
"contribution accepted" names its number), so a validator that waits for it before
reporting can tell the canary apart (claim_timeout_s bounds the wait); and with a single
live validator no canary is planted (it is assigned every real answer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import threading
import time
from typing import Any

from covey.coordinator.accounts import Accounts
from covey.coordinator.db import Database
from covey.rl.canaries import scramble_proof
from covey.serve import assign
from covey.serve.config import ServeConfig
from covey.trust.certify import canary_draw
from covey.trust.identity import Identity

log = logging.getLogger("covey.serve")
CANARY_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS serve_canaries (id INTEGER PRIMARY KEY AUTOINCREMENT, "
    "answer_id INTEGER NOT NULL, validator_id TEXT NOT NULL, worker_id TEXT NOT NULL, "
    "job TEXT NOT NULL, tokens TEXT NOT NULL, proof TEXT NOT NULL, cid TEXT NOT NULL, "
    "draw TEXT NOT NULL, status TEXT NOT NULL, placed_at REAL NOT NULL, "
    "UNIQUE (answer_id, validator_id))",
)
LOOK_AT = 8  # answers drawn for a canary per claim (each draw is one signature)


class ServeCanaries:
    """Planted at a validator's claim, resolved by its report or the claim timeout. The
    methods that take `c` run inside the caller's transaction."""

    def __init__(
        self,
        cfg: ServeConfig,
        run_id: str,
        identity: Identity,
        db: Database,
        accounts: Accounts,
        lock: threading.Lock,
    ) -> None:
        """The server's spec, run, key (it signs the draws), database, ledger, and the lock
        its ledger decisions take one at a time."""
        self.cfg, self.run_id, self.identity = cfg, run_id, identity
        self.db, self.accounts, self.lock = db, accounts, lock

    def plant(
        self, c: sqlite3.Connection, validator: str, live: list[str]
    ) -> dict[str, Any] | None:
        """A canary task for `validator`, planted now if a draw says so; None otherwise (or
        while it holds one)."""
        rate = self.cfg.trust.canary_rate
        if (
            rate <= 0
            or c.execute(
                "SELECT 1 FROM serve_canaries WHERE validator_id = ? AND status = 'assigned'",
                (validator,),
            ).fetchone()
        ):
            return None
        given = {
            r[0]
            for r in c.execute(
                "SELECT answer_id FROM serve_canaries WHERE validator_id = ?", (validator,)
            )
        }
        looked = 0
        for row in c.execute(
            "SELECT * FROM serve_answers WHERE status = 'pending' AND worker_id != ? "
            "ORDER BY id LIMIT 256",
            (validator,),
        ).fetchall():
            tried = json.loads(row["tried"] or "[]")
            if row["id"] in given or validator in tried:
                continue
            other = assign.assigned(row["draw"], row["worker_id"], live, [*tried, validator])
            if other is None or other == validator:  # nobody else would check the real one
                continue
            looked += 1
            planted, draw = canary_draw(self.identity, self.run_id, row["id"], validator, rate)
            if planted:
                return self._make(c, row, validator, tried, draw)
            if looked >= LOOK_AT:
                break
        return None

    def _make(
        self, c: sqlite3.Connection, row: sqlite3.Row, validator: str, tried: list[str], draw: str
    ) -> dict[str, Any]:
        tokens = json.loads(row["tokens"])
        proof = scramble_proof(bytes.fromhex(row["proof"]), len(tokens), bytes.fromhex(draw)[:32])
        cid = hashlib.sha256(f"{row['job']}|{tokens}|{proof.hex()}".encode()).hexdigest()
        c.execute(  # never handed the real answer too: no twin tasks
            "UPDATE serve_answers SET tried = ? WHERE id = ?",
            (json.dumps([*tried, validator]), row["id"]),
        )
        c.execute(
            "INSERT INTO serve_canaries (answer_id, validator_id, worker_id, job, tokens, proof, "
            "cid, draw, status, placed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'assigned', ?)",
            (row["id"], validator, row["worker_id"], row["job"], row["tokens"], proof.hex(),
             cid, draw, time.time()),
        )  # fmt: skip
        log.info("[serve - answer %d] canary %s for %s", row["id"], cid[:12], validator[:8])
        return {  # the same fields as a real check's task
            "answer_id": row["id"],
            "worker_id": row["worker_id"],
            "job": json.loads(row["job"]),
            "tokens": tokens,
            "proof": proof.hex(),
        }

    def of_report(self, c: sqlite3.Connection, validator: str, answer: int) -> sqlite3.Row | None:
        return c.execute(
            "SELECT * FROM serve_canaries WHERE validator_id = ? AND answer_id = ? AND "
            "status = 'assigned'",
            (validator, answer),
        ).fetchone()

    def resolve(self, c: sqlite3.Connection, row: sqlite3.Row, outcome: str, now: float) -> None:
        """Reveal the canary on the ledger: caught (a paid check), passed (a penalty),
        missed (a missed check)."""
        s, validator = self, row["validator_id"]
        c.execute("UPDATE serve_canaries SET status = ? WHERE id = ?", (outcome, row["id"]))
        base = {"round": row["answer_id"], "peer_id": validator}
        entry = {**base, "worker_id": row["worker_id"], "cid": row["cid"], "draw": row["draw"]}
        s.accounts.append(c, "canary", entry | {"outcome": outcome}, now)
        if outcome == "caught" and s.cfg.trust.check_reward > 0:
            pay = {"amount": s.cfg.trust.check_reward, "kind": "check", "tokens": 0}
            s.accounts.append(c, "reward", base | pay, now)
        elif outcome == "passed":
            penalty = {
                "amount": s.accounts.book.penalty_amount(validator),
                "kind": "canary",
                "reason": f"accepted canary {row['cid'][:12]} (answer {row['answer_id']} with "
                "its proof made bad)",
            }
            s.accounts.append(c, "penalty", base | penalty, now)
        level = logging.INFO if outcome == "caught" else logging.WARNING
        log.log(level, "[serve - answer %d] canary %s by %s", row["answer_id"], outcome,
                validator[:8])  # fmt: skip

    def sweep(self, now: float) -> None:
        """Canaries not reported within claim_timeout_s are missed."""
        s = self
        for row in s.db.query(
            "SELECT * FROM serve_canaries WHERE status = 'assigned' AND placed_at < ?",
            (now - s.cfg.claim_timeout_s,),
        ):
            with s.lock, s.accounts.transaction() as c:
                if self.of_report(c, row["validator_id"], row["answer_id"]) is not None:
                    self.resolve(c, row, "missed", now)

    def counts(self) -> dict[str, int]:
        rows = self.db.query("SELECT status, COUNT(*) AS n FROM serve_canaries GROUP BY status")
        return {r["status"]: r["n"] for r in rows}
