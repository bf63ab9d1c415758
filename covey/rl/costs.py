"""The RL mode's decentralization multiplier (covey.protocol.multiplier), from what the
trainer records: one `rl_costs` row per measured piece of work, joined at read time to its
batch's status (a batch's generation is booked by what became of it).

What each part rests on:
- useful: the generation seconds of batches that passed their checks (accepted, or
  consumed by a step), as their workers report them, and the trainer's own step seconds
  (a centralized process would generate the same rollouts and take the same steps);
- network: each accepted batch's worker wall seconds from its previous submission (or its
  join) to this one, minus its generation: fetching the policy, uploading the batch, and
  waiting for the next policy version;
- verification: the compute seconds validators report for their checks (canaries
  included: a canary is a check of the checker), and the trainer's own re-checks (audits
  of cleared batches, judging a disputed one, deciding one no validator took);
- evidence: the batch each check fetches from the trainer (its bytes, and the seconds the
  validator reports for fetching it and its policy);
- redundant: generation (and its wall seconds) of batches that passed their checks but went
  stale before a step used them (dropped: more rollouts than the trainer could use);
- rejected: generation and wall seconds of batches refused by a check;
- churn: not seen by the trainer (a worker or validator that dies takes its unfinished
  work with it), so listed as unmeasured.

Batches still pending or claimed are not booked yet. Reported seconds are a peer's word: a
worker that understates them makes the run look cheaper, and nothing else rests on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covey.protocol.multiplier import Costs

if TYPE_CHECKING:
    import sqlite3

    from covey.coordinator.db import Database

COSTS_SCHEMA = (
    # what: generate | wait (a batch's, booked by its status) | check | fetch | step
    "CREATE TABLE IF NOT EXISTS rl_costs (id INTEGER PRIMARY KEY AUTOINCREMENT, "
    "cid TEXT, what TEXT NOT NULL, seconds REAL NOT NULL, bytes INTEGER NOT NULL DEFAULT 0)",
)
USEFUL = ("accepted", "consumed")
MAX_REPORTED_S = 86400.0  # one day: the bound on any peer-reported seconds


def record(
    c: sqlite3.Connection, what: str, seconds: float | None, cid: str | None = None, size: int = 0
) -> None:
    """Book one measured piece of work inside the caller's transaction; None seconds (a
    peer that reported none) books nothing."""
    if seconds is None:
        return
    seconds = min(max(0.0, float(seconds)), MAX_REPORTED_S)
    c.execute(
        "INSERT INTO rl_costs (cid, what, seconds, bytes) VALUES (?, ?, ?, ?)",
        (cid, what, seconds, max(0, int(size))),
    )


def record_batch(
    c: sqlite3.Connection, cid: str, compute_s: float | None, wall_s: float | None
) -> None:
    """A submitted batch's generation and the rest of its worker's wall seconds."""
    record(c, "generate", compute_s, cid)
    if wall_s is not None:
        record(c, "wait", max(0.0, wall_s - (compute_s or 0.0)), cid)


def book(rows: list[tuple[str, str | None, float, int]]) -> Costs:
    """Costs from (what, batch status or None, seconds, bytes) sums (pure)."""
    costs = Costs(unmeasured=["churn (unfinished work of peers that left)"])
    for what, status, seconds, size in rows:
        if what == "step":
            costs.useful_s += seconds
        elif what == "check":
            costs.verification_s += seconds
        elif what == "fetch":
            costs.evidence_s += seconds
            costs.evidence_bytes += size
        elif what in ("generate", "wait") and status in USEFUL:
            if what == "generate":
                costs.useful_s += seconds
            else:
                costs.network_s += seconds
        elif what in ("generate", "wait") and status == "rejected":
            costs.rejected_s += seconds
        elif what in ("generate", "wait") and status == "dropped":
            costs.redundant_s += seconds
    return costs


def run_costs(db: Database) -> Costs:
    """The RL run so far (one grouped query over rl_costs)."""
    rows = db.query(
        "SELECT c.what AS what, b.status AS status, SUM(c.seconds) AS s, SUM(c.bytes) AS n "
        "FROM rl_costs c LEFT JOIN rl_batches b ON b.cid = c.cid GROUP BY c.what, b.status"
    )
    return book([(r["what"], r["status"], float(r["s"] or 0), int(r["n"] or 0)) for r in rows])
