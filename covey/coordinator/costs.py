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
  (the private state a method keeps between rounds), that its validator fetches from its
  worker (its end state is recomputed and tied to its content id, so it does not travel
  when the re-execution is bit-identical), once a drawn contribution, at the worker's
  measured bandwidth (0 s where the bandwidth is unknown, and the
  part is then listed as unmeasured). Rounds do not wait for it: these are seconds of the
  worker's link, not of the round; evidence never delivered is not counted;
- redundant: none in this mode (no work is done twice but to verify it).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from covey.protocol.multiplier import Costs

if TYPE_CHECKING:
    from .db import Database
    from .peers import Peers


def run_costs(db: Database, peers: Peers) -> Costs:
    """The whole run so far, booked by covey.protocol.multiplier.Costs."""
    costs = Costs()
    compute = {
        (r["round"], r["attempt"], r["peer_id"]): r["compute_s"]
        for r in db.query("SELECT round, attempt, peer_id, compute_s FROM contributions")
    }
    refused = {
        (r["round"], r["attempt"], r["peer_id"])
        for r in db.query("SELECT round, attempt, peer_id FROM rejections")
    }
    for r in db.query(
        "SELECT round, attempt, opened_at, closed_at, members, certificate FROM rounds "
        "WHERE status = 'committed'"
    ):
        accepted = {a["peer_id"] for a in json.loads(r["certificate"])["accepted"]}
        span = (r["closed_at"] or 0.0) - (r["opened_at"] or 0.0)
        for m in json.loads(r["members"] or "[]"):
            key = (r["round"], r["attempt"], m)
            if m in accepted:
                costs.add_member(span, compute.get(key), "accepted")
            elif key in refused or key in compute:
                costs.add_member(span, None, "rejected")
            else:
                costs.add_member(span, None, "absent")
    for e in db.query("SELECT detail FROM events WHERE kind = 'round aborted'"):
        detail = json.loads(e["detail"] or "{}")
        if "span_s" not in detail:  # written before aborts recorded their members
            _unmeasured(costs, "churn of aborted rounds")
            continue
        for _ in range(int(detail.get("members", 0))):
            costs.add_member(float(detail["span_s"]), None, "absent")
    for v in db.query("SELECT report FROM verifications WHERE report IS NOT NULL"):
        try:
            costs.verification_s += max(0.0, float(json.loads(v["report"]).get("compute_s", 0)))
        except (TypeError, ValueError, AttributeError):
            _unmeasured(costs, "verification reports without compute")
    speed = {p["peer_id"]: p["bandwidth_mbps"] for p in peers.every()}
    for s in db.query(
        "SELECT peer_id, start_cid, end_size FROM local_states "
        "WHERE evidence IS NOT NULL AND evidence != 'undelivered'"
    ):
        # the start state when it was a local one (every local state has the end's size)
        size = int(s["end_size"] or 0) if s["start_cid"] else 0
        costs.evidence_bytes += size
        mbps = speed.get(s["peer_id"])
        if mbps and mbps > 0:
            costs.evidence_s += size * 8 / (mbps * 1e6)
        elif size:
            _unmeasured(costs, "evidence time (bandwidth unknown)")
    return costs


def _unmeasured(costs: Costs, what: str) -> None:
    if what not in costs.unmeasured:
        costs.unmeasured.append(what)
