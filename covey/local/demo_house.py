"""The house workers of `covey demo`: the run owner's own workers (`covey worker --house-of`,
covey.peer.house), whose contributions are the canaries that test the demo's validators
(docs/trust.md, "Canaries"), and what became of those canaries at the end.

A house worker is named like any other worker (w0, w1, ...): its name is public, and a name
that said "house" would tell every validator which checks may be canaries. Once one of its
canaries is revealed its key is public and banned, and the worker exits; the demo starts the
next house key under a fresh name, as a run owner would.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

from covey.local.cluster import LocalCluster
from covey.trust.house import HOUSE_KEYS

# what every demo worker is started with; each stakes the run's minimum, which the cluster
# deposits to its key first (covey.local.cluster)
PEER_ARGS = ("--threads", "1")
# verification statuses the demo counts as disputes (covey.coordinator: a dispute's outcome)
DISPUTED = ("fraud", "validator wrong", "inconclusive")


def house_slots(workers: int, adversaries: int, validators: int, house_workers: int) -> int:
    """How many of a demo's `workers` places go to house workers: `house_workers`, but none
    without validators (nobody would check a canary) and never the last plain honest
    worker's place (a house worker leaves at each reveal)."""
    if validators == 0:
        return 0
    return max(0, min(house_workers, workers - adversaries - 1))


def fresh_worker_name(cluster: LocalCluster) -> str:
    """The first w<i> no worker of `cluster` has been called (a cheater's name w<i>-kind
    counts as w<i>)."""
    used = {name.split("-")[0] for name in cluster.workers}
    i = 0
    while f"w{i}" in used:
        i += 1
    return f"w{i}"


class HouseWorkers:
    """The house workers the demo started: name -> house key index. `replace` starts the
    next house key when one is gone (its canary revealed, or a chaos kill)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.index: dict[str, int] = {}
        self.next_index = 0

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def start(self, name: str) -> bool:
        """Start house worker `name` under the next house key; False once all
        covey.trust.house.HOUSE_KEYS of the run are spent."""
        if self.next_index >= HOUSE_KEYS:
            return False
        self.cluster.start_house_worker(name, self.next_index, *PEER_ARGS)
        self.index[name] = self.next_index
        self.next_index += 1
        return True

    def replace(self, name: str, say: Callable[[str], None], why: str) -> str | None:
        """Start a house worker to take the place of house worker `name`, which is gone
        (`why`); its name, or None when no house key is left."""
        fresh = fresh_worker_name(self.cluster)
        if not self.start(fresh):
            say(f"{name} {why}; every house key of the run is spent: no canaries from now on")
            return None
        say(f"{name} {why}: {fresh} (house key {self.index[fresh]}) takes its place")
        return fresh


def canary_counts(coordinator_dir: Path) -> dict[str, Any]:
    """What became of the run's house canaries, from the ledger's "house canary" entries:
    "caught" (a validator disputed it and the referee convicted it), "passed" (no validator
    caught it: the referee convicted it at the reveal, and each validator that agreed with
    it paid a missed fraud) or "unchecked" (the referee found no divergence; or no check was
    drawn for it, kept secret in the database); and "pending": drawn
    but not revealed when the run ended (a check still out), from the coordinator's
    database. `disputes`: the disputed verifications of everything but the canaries."""
    from covey.io import audit

    entries, _, _ = audit.load(coordinator_dir)
    revealed = [e.payload for e in entries if e.type == "house canary"]
    outcomes = {k: sum(p["outcome"] == k for p in revealed) for k in ("caught", "convicted")}
    counts: dict[str, Any] = {
        "drawn": len(revealed),
        "caught": outcomes["caught"],
        "passed": outcomes["convicted"],
        "unchecked": sum(p["outcome"] not in outcomes for p in revealed),
        "pending": 0,
    }
    canaries = {(p["round"], p["peer_id"]) for p in revealed}
    db = coordinator_dir / "coordinator.db"
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        try:  # drawn but not revealed yet: their checks were still out when the run ended
            rows = con.execute("SELECT round, peer_id, status FROM house_canaries").fetchall()
        except sqlite3.OperationalError:  # a coordinator without the canaries' table
            rows = []
        unsampled = {(r, p) for r, p, status in rows if status == "unsampled"}
        pending = {(r, p) for r, p, _ in rows} - canaries - unsampled
        statuses = con.execute("SELECT round, peer_id, status FROM verifications").fetchall()
    counts["pending"] = len(pending)
    counts["unchecked"] += len(unsampled)  # never drawn for a check: kept secret, key kept
    counts["drawn"] += len(pending) + len(unsampled)
    canaries |= pending | unsampled
    counts["disputes"] = sum(s in DISPUTED and (r, p) not in canaries for r, p, s in statuses)
    return counts
