"""The rounds mode's decentralization multiplier (covey.protocol.multiplier), read from the
coordinator's database: what every member of every round spent, what validators report
their checks cost, and what drawn contributions' evidence weighed.

What each part rests on:
- useful and network: the rounds' open and close times, their members, and the compute
  seconds each accepted contribution reports (a worker could overstate its compute; that
  only makes the run look more efficient than it was, never a verdict);
- churn: members of committed rounds without a contribution, and members of aborted
  attempts (their "round aborted" event carries the members and the span);
- rejected: members whose contribution was refused at intake or left out at the close;
- verification: the compute seconds in each validator's report;
- evidence: the local state a drawn contribution started from, where it started from one
  (the private state a method keeps between rounds), that each of its validators fetches
  from its worker (its end state is recomputed and tied to its content id, so it does not
  travel when the re-execution is bit-identical): once per validator that completed a
  check of it (a new peer's contribution is checked by validators_per_check of them, an
  audit adds one), at the worker's measured bandwidth (0 s where the bandwidth is
  unknown, and the part is then listed as unmeasured). Rounds do not wait for it: these
  are seconds of the worker's link, not of the round; evidence never delivered (a check
  attested withheld, or one still held or missed) is not counted;
- redundant: none in this mode (no work is done twice but to verify it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING

from covey.protocol.multiplier import Costs

if TYPE_CHECKING:
    from .db import Database
    from .peers import Peers


def run_costs(db: Database, peers: Peers) -> Costs:
    """The whole run so far, booked by covey.protocol.multiplier.Costs (a full scan)."""
    return RoundsCosts().update(db, peers)


class RoundsCosts:
    """`run_costs`, kept incrementally: a committed round and an aborted attempt's event are
    final once written, so each is booked once (rounds past the last booked one, events past
    the last booked id); checks' reports and evidence (a drawn contribution's start state,
    once per validator that completed a check of it, which can land at any time) are read
    again on every update. An update
    gives the same Costs as a full scan of the same database."""

    def __init__(self) -> None:
        self.booked = Costs()  # committed rounds and aborted attempts so far
        self.last_round = -1
        self.last_event = 0

    def update(self, db: Database, peers: Peers) -> Costs:
        self._rounds(db)
        costs = replace(self.booked, unmeasured=list(self.booked.unmeasured))
        _checks(db, peers, costs)
        return costs

    def _rounds(self, db: Database) -> None:
        rounds = db.query(
            "SELECT round, attempt, opened_at, closed_at, members, certificate FROM rounds "
            "WHERE status = 'committed' AND round > ? ORDER BY round",
            (self.last_round,),
        )
        compute: dict[tuple[int, int, str], float | None] = {}
        refused: set[tuple[int, int, str]] = set()
        if rounds:
            first, last = rounds[0]["round"], rounds[-1]["round"]
            where, args = "WHERE round BETWEEN ? AND ?", (first, last)
            compute = {
                (r["round"], r["attempt"], r["peer_id"]): r["compute_s"]
                for r in db.query(
                    f"SELECT round, attempt, peer_id, compute_s FROM contributions {where}", args
                )
            }
            refused = {
                (r["round"], r["attempt"], r["peer_id"])
                for r in db.query(f"SELECT round, attempt, peer_id FROM rejections {where}", args)
            }
        for r in rounds:
            accepted = {a["peer_id"] for a in json.loads(r["certificate"])["accepted"]}
            span = (r["closed_at"] or 0.0) - (r["opened_at"] or 0.0)
            for m in json.loads(r["members"] or "[]"):
                key = (r["round"], r["attempt"], m)
                if m in accepted:
                    self.booked.add_member(span, compute.get(key), "accepted")
                elif key in refused or key in compute:
                    self.booked.add_member(span, None, "rejected")
                else:
                    self.booked.add_member(span, None, "absent")
            self.last_round = r["round"]
        for e in db.query(
            "SELECT id, detail FROM events WHERE kind = 'round aborted' AND id > ? ORDER BY id",
            (self.last_event,),
        ):
            self.last_event = e["id"]
            detail = json.loads(e["detail"] or "{}")
            if "span_s" not in detail:  # written before aborts recorded their members
                self.booked.mark_unmeasured("churn of aborted rounds")
                continue
            for _ in range(int(detail.get("members", 0))):
                self.booked.add_member(float(detail["span_s"]), None, "absent")


def _checks(db: Database, peers: Peers, costs: Costs) -> None:
    """Validators' reported compute (verification) and drawn contributions' delivered
    evidence, added to `costs`."""
    for v in db.query("SELECT report FROM verifications WHERE report IS NOT NULL"):
        try:
            costs.verification_s += max(0.0, float(json.loads(v["report"]).get("compute_s", 0)))
        except (TypeError, ValueError, AttributeError):
            costs.mark_unmeasured("verification reports without compute")
    speed = {p["peer_id"]: p["bandwidth_mbps"] for p in peers.every()}
    for s in db.query(
        "SELECT l.peer_id, l.start_cid, l.end_size, (SELECT COUNT(*) FROM checks k "
        "JOIN verifications v ON v.id = k.vid WHERE v.round = l.round AND "
        "v.peer_id = l.peer_id AND k.status = 'done') AS fetches FROM local_states l "
        "JOIN rounds r ON r.round = l.round AND r.attempt = l.attempt "
        "WHERE r.status = 'committed' AND l.evidence IS NOT NULL "
        "AND l.evidence != 'undelivered'"
    ):
        # the start state when it was a local one (every local state has the end's size),
        # fetched by each validator that completed a check of it
        size = int(s["end_size"] or 0) * int(s["fetches"]) if s["start_cid"] else 0
        costs.evidence_bytes += size
        mbps = speed.get(s["peer_id"])
        if mbps and mbps > 0:
            costs.evidence_s += size * 8 / (mbps * 1e6)
        elif size:
            costs.mark_unmeasured("evidence time (bandwidth unknown)")
