"""Canaries in the rounds mode: contributions of the run owner's own house workers, bad on
purpose in rounds the coordinator's secret draw picks (covey.trust.house; docs/trust.md,
"Canaries").

A canary here is not a task of its own: it is an accepted contribution like any other, in
the certificate, in the ledger with its sampling draw, checked by the validators the public
beacon draws, its payload served like any other. What makes it a canary is only that its
worker is a house key (derived from the coordinator's key: nobody else can tell) and that
the coordinator's signed draw over (run, round, house key) fell below `canary_rate`, which
the house worker computes too and then trains on other data. So nothing a validator can
read tells it from a real check before it reports.

The reveal comes after every check drawn for it has reported or expired (never earlier: a
validator still holding the check must not learn it): a "house canary" ledger entry with
the draw and the coordinator's proof that the key is its own. When a validator disputed it
and the referee convicted it, the canary was "caught" (the catch is that dispute's). When
none did, the coordinator's referee recomputes its first segment from the committed inputs
(the referee thread, as for a dispute): a divergence convicts it ("convicted"), and every
validator that agreed on it pays for a missed fraud (covey.coordinator.checks.Checks.convict)
and has passed a canary (its agreements are evidence of nothing from then on). No
divergence: "unchecked", nobody penalised. Either way the key is burned (banned), since the
reveal makes it public. A canary the sampling never drew for a check tested nobody: it is
not revealed (its row says "unsampled"), and its key goes on, so the owner does not spend a
house key and a worker's restart on it.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from covey.protocol import schemas
from covey.protocol.checkpoint import state_from_bytes
from covey.trust import referee, verify
from covey.trust.house import house_canary_draw, house_peer_ids, house_proof

from .assignment import OPEN

if TYPE_CHECKING:
    import queue

    from covey.algorithms import Strategy, TrainState
    from covey.blobs import BlobStore
    from covey.config import RunConfig

    from .accounts import Accounts
    from .checks import Checks
    from .db import Database
    from .peers import Peers

log = logging.getLogger("covey.coordinator")

HOUSE_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS house_canaries (round INTEGER NOT NULL, "
    "peer_id TEXT NOT NULL, draw TEXT NOT NULL, status TEXT NOT NULL, "
    "PRIMARY KEY (round, peer_id));"
)
# a planted canary's verification statuses that are not over yet (the reveal waits)
UNDECIDED = (*OPEN, "disputed")


class Canaries:
    # provided by Verification
    cfg: RunConfig
    run_id: str
    db: Database
    accounts: Accounts
    blobs: BlobStore
    strategy: Strategy
    template: TrainState
    peers: Peers
    checks: Checks
    _disputes: queue.Queue[int | None]
    _task: Any
    _batch_fn: Any
    _previous_end: Any
    _referee_strategy_for: Any

    def _create_canary_table(self) -> None:
        with self.db.lock:
            self.db._conn.executescript(HOUSE_SCHEMA)
        self._house = house_peer_ids(self.accounts.identity, self.run_id)
        self._judging: set[int] = set()  # verification ids queued for the referee's reveal

    def _plant_canaries(self, c: sqlite3.Connection, round_: int, now: float) -> None:
        """Inside the commit's transaction, after the round's contributions were recorded:
        note which house contributions of this round are canaries (kept secret)."""
        rate = self.cfg.trust.canary_rate
        if rate <= 0 or not self._house:
            return
        for row in c.execute("SELECT peer_id FROM payouts WHERE round = ?", (round_,)).fetchall():
            peer = row["peer_id"]
            if peer not in self._house:
                continue
            draw = house_canary_draw(self.accounts.identity, self.run_id, round_, peer, rate)
            if draw is not None:
                c.execute(
                    "INSERT OR IGNORE INTO house_canaries VALUES (?, ?, ?, 'planted')",
                    (round_, peer, draw),
                )

    def _sweep_canaries(self, c: sqlite3.Connection, now: float) -> None:
        """Inside a transaction: reveal every planted canary whose checks are over; one that
        no validator convicted goes to the referee thread (`_reveal_by_referee`)."""
        rows = c.execute(
            "SELECT h.round, h.peer_id, h.status, v.id AS vid, v.status AS check_status "
            "FROM house_canaries h LEFT JOIN verifications v "
            "ON v.round = h.round AND v.peer_id = h.peer_id "
            "WHERE h.status IN ('planted', 'judging') ORDER BY h.round"
        ).fetchall()
        for row in rows:
            if row["vid"] is None:  # never drawn for a check: it tested nobody, so it stays
                # secret and its key keeps working (a reveal would burn a key for nothing)
                c.execute(
                    "UPDATE house_canaries SET status = 'unsampled' "
                    "WHERE round = ? AND peer_id = ?",
                    (row["round"], row["peer_id"]),
                )
            elif row["check_status"] == "fraud":
                self._reveal(c, row["round"], row["peer_id"], "caught", "a dispute", now)
            elif (
                row["check_status"] in UNDECIDED
                or c.execute(
                    "SELECT 1 FROM checks WHERE vid = ? AND status = 'assigned'", (row["vid"],)
                ).fetchone()
            ):
                continue  # a validator still holds a check of it: it must not learn yet
            elif row["vid"] not in self._judging:  # (again, after a restart)
                self._judging.add(row["vid"])
                c.execute(
                    "UPDATE house_canaries SET status = 'judging' WHERE round = ? AND peer_id = ?",
                    (row["round"], row["peer_id"]),
                )
                self._disputes.put(-row["vid"])  # the referee thread: a reveal, not a dispute

    def _reveal(
        self,
        c: sqlite3.Connection,
        round_: int,
        peer_id: str,
        outcome: str,
        detail: str,
        now: float,
    ) -> None:
        """Inside a transaction: the "house canary" entry, the key burned, and for a
        conviction by the reveal, the missed fraud of those that agreed."""
        row = c.execute(
            "SELECT draw FROM house_canaries WHERE round = ? AND peer_id = ?", (round_, peer_id)
        ).fetchone()
        c.execute(
            "UPDATE house_canaries SET status = ? WHERE round = ? AND peer_id = ?",
            (outcome, round_, peer_id),
        )
        self.accounts.append(
            c,
            "house canary",
            {
                "round": round_,
                "peer_id": peer_id,
                "draw": row["draw"],
                "proof": house_proof(self.accounts.identity, self.run_id, peer_id),
                "outcome": outcome,
                "detail": detail[:500],
            },
            now,
        )
        self.peers.ban(c, peer_id)
        c.execute(
            "UPDATE payouts SET status = 'forfeit' WHERE peer_id = ? AND status = 'due'",
            (peer_id,),
        )
        if outcome == "convicted":
            penalised = self.checks.convict(c, round_, peer_id, f"house canary: {detail}", now)
            log.warning(
                "[round %d] house canary of %s revealed: convicted, %d validator(s) agreed "
                "on it without catching it",
                round_,
                peer_id[:8],
                len(penalised),
            )
        else:
            log.info("[round %d] house canary of %s revealed: %s", round_, peer_id[:8], outcome)

    def _reveal_by_referee(self, vid: int) -> None:
        """The referee thread: recompute a canary no validator convicted, then reveal it
        ("convicted" on a divergence, else "unchecked"). Raises like a dispute's judging
        (the caller retries it and finally leaves it for a restart)."""
        refusal = getattr(getattr(self, "referee_compute", None), "refusal", None)
        if refusal is not None:  # not judged on another device class: left for a restart
            log.warning("a house canary stays unrevealed: %s", refusal)
            return
        task = self._task(vid)
        finding, detail = self._judge_first_segment(task)
        with self.accounts.transaction() as c:
            row = c.execute(
                "SELECT status FROM house_canaries WHERE round = ? AND peer_id = ?",
                (task.round, task.peer_id),
            ).fetchone()
            if row is None or row["status"] != "judging":
                return
            v = c.execute("SELECT status FROM verifications WHERE id = ?", (vid,)).fetchone()
            held = c.execute(
                "SELECT 1 FROM checks WHERE vid = ? AND status = 'assigned'", (vid,)
            ).fetchone()
            if v["status"] in (*UNDECIDED, "fraud") or held is not None:  # since queued
                # checked again (an audit), or convicted by a dispute: the sweep decides
                c.execute(
                    "UPDATE house_canaries SET status = 'planted' WHERE round = ? AND peer_id = ?",
                    (task.round, task.peer_id),
                )
                self._judging.discard(vid)
                return
            outcome = "convicted" if finding == "fraud" else "unchecked"
            self._reveal(c, task.round, task.peer_id, outcome, detail, time.time())
        self._judging.discard(vid)

    def _judge_first_segment(self, task: schemas.VerifyTask) -> tuple[str, str]:
        """The referee's recomputation of the first segment of `task` from its committed
        inputs, against the worker's claim (covey.trust.referee.judge; the recomputed end
        stands in for a validator's)."""
        strategy = self._referee_strategy_for()
        trust = self.cfg.trust
        start = state_from_bytes(self.blobs.get(task.start_cid), self.template)
        numel = sum(start.params[n].numel() for n in strategy.fragment_names(task.fragment))
        claimed = [verify.Commitment.from_dict(x) for x in task.commitments]
        worker_end = verify.segment_end(claimed, self.blobs.get(task.cid), 0, strategy.codec, numel)
        result = referee.referee(
            strategy,
            start,
            0,
            None,
            self._batch_fn(task.round, task.data_key),
            task.inner_steps,
            trust.commit_every,
            claimed_start=claimed[0],
            tolerance=trust.tolerance,
            **self._previous_end(task, strategy),
        )
        if result.end is None:
            return "inconclusive", result.detail
        judgement = referee.judge(result, worker_end, result.end, trust.tolerance)
        return judgement.outcome, judgement.detail

    def canary_blobs(self) -> set[str]:
        """Blobs an unrevealed canary still needs: its payload, its round's start state and
        its committed local states."""
        rows = self.db.query(
            "SELECT c.cid, r.start_cid, l.start_cid AS l_start, l.end_cid AS l_end "
            "FROM house_canaries h JOIN rounds r ON r.round = h.round "
            "JOIN contributions c ON c.round = h.round AND c.attempt = r.attempt "
            "AND c.peer_id = h.peer_id LEFT JOIN local_states l ON l.round = h.round "
            "AND l.attempt = r.attempt AND l.peer_id = h.peer_id "
            "WHERE h.status IN ('planted', 'judging')"
        )
        return {
            cid
            for r in rows
            for cid in (r["cid"], r["start_cid"], r["l_start"], r["l_end"])
            if cid is not None
        }
