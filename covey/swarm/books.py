"""The SWARM coordinator's books in SQLite tables: what a restarted coordinator resumes
(covey.swarm.service). Each stage's averaging book (step, agreed and seeded state, its
servers' states, votes, misses and benches), the rounds it keeps (open, last committed,
the recent history) with their members' reports, the trainers' progress, the pay queued
for the next payout, the samples trainers vouched for, the agreed states whose replies
are still paid, and the ids of paid checks.

The service holds these books in memory as a snapshot dict (`snapshot` sections: the
shapes of `Averaging.to_dict` and of the service's own dicts); `write` stores the sections
that changed inside the caller's transaction, `read` gives the snapshot back. The tables
have a version of their own (the meta row `VERSION_KEY`; the database's schema version is
covey.coordinator.db's, for the host's tables). A data directory written before these
tables kept the same snapshot as one JSON text in the meta row `LEGACY_KEY`: `prepare`
moves it into the tables in one transaction, after a backup copy of the database beside
it (``swarm.db.books-v0.bak``), and removes the row.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Any

from covey.coordinator.db import Database, SchemaError

log = logging.getLogger("covey.swarm")

BOOKS_VERSION = 1
VERSION_KEY = "swarm.books"  # meta row: the version of the tables below
LEGACY_KEY = "swarm.state"  # meta row of the books as one JSON text (before version 1)
SECTIONS = ("averaging", "trainers", "unpaid", "known_states", "vouched")

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS swarm_checks (id TEXT PRIMARY KEY, at REAL)",
    "CREATE TABLE IF NOT EXISTS swarm_counters (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS swarm_stages (stage INTEGER PRIMARY KEY, "
    "step INTEGER NOT NULL, agreed TEXT, seeded TEXT, open_round INTEGER, last_round INTEGER, "
    "committed_at REAL NOT NULL, rounds INTEGER NOT NULL, aborted INTEGER NOT NULL, "
    "samples INTEGER NOT NULL, norms TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS swarm_stage_peers (stage INTEGER NOT NULL, "
    "peer_id TEXT NOT NULL, state TEXT, voter INTEGER NOT NULL, missed INTEGER, "
    "benched REAL, PRIMARY KEY (stage, peer_id))",
    # a round kept by a stage: its open one, its last committed one, or in its history
    # (`history_step`: the step it is kept under)
    "CREATE TABLE IF NOT EXISTS swarm_rounds (id INTEGER PRIMARY KEY, stage INTEGER NOT NULL, "
    "step INTEGER NOT NULL, members TEXT NOT NULL, opened REAL NOT NULL, "
    "status TEXT NOT NULL, dropped TEXT NOT NULL, history_step INTEGER)",
    "CREATE TABLE IF NOT EXISTS swarm_reports (round INTEGER NOT NULL, peer_id TEXT NOT NULL, "
    "cid TEXT NOT NULL, samples INTEGER NOT NULL, url TEXT NOT NULL, norm REAL, "
    "vouched INTEGER, PRIMARY KEY (round, peer_id))",
    "CREATE TABLE IF NOT EXISTS swarm_trainers (peer_id TEXT PRIMARY KEY, name TEXT NOT NULL, "
    "samples INTEGER NOT NULL, loss REAL, reroutes INTEGER NOT NULL, banned TEXT NOT NULL, "
    "next INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS swarm_unpaid (peer_id TEXT PRIMARY KEY, tokens INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS swarm_vouched (peer_id TEXT PRIMARY KEY, samples INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS swarm_known_states (stage INTEGER NOT NULL, "
    "position INTEGER NOT NULL, cid TEXT NOT NULL, PRIMARY KEY (stage, position))",
)
TABLES = {
    "averaging": ("swarm_counters", "swarm_stages", "swarm_stage_peers", "swarm_rounds",
                  "swarm_reports"),
    "trainers": ("swarm_trainers",),
    "unpaid": ("swarm_unpaid",),
    "known_states": ("swarm_known_states",),
    "vouched": ("swarm_vouched",),
}  # fmt: skip


def sections(snap: dict[str, Any]) -> dict[str, str]:
    """Each section of a snapshot as canonical JSON: what `write` compares."""
    return {k: json.dumps(snap[k], sort_keys=True) for k in SECTIONS}


def prepare(db: Database) -> None:
    """Create the tables, and move a data directory's books from their legacy JSON row
    into them (one transaction, after a backup). SchemaError for tables of a newer covey
    or a legacy row that does not read."""
    with db.transaction() as c:
        for sql in SCHEMA:
            c.execute(sql)
        row = c.execute("SELECT value FROM meta WHERE key = ?", (VERSION_KEY,)).fetchone()
        legacy = c.execute("SELECT value FROM meta WHERE key = ?", (LEGACY_KEY,)).fetchone()
        if row is not None:
            if int(row[0]) > BOOKS_VERSION:
                raise SchemaError(
                    f"{db.path} holds SWARM books of version {row[0]}; this covey reads up "
                    f"to {BOOKS_VERSION}: upgrade covey to resume this run"
                )
            return
        if legacy is not None:
            _backup(db)
            try:
                # rows of covey before the known states and vouched samples were kept
                snap = {"known_states": [], "vouched": {}, **json.loads(legacy[0])}
                write(c, snap, {})
            except (ValueError, KeyError, TypeError) as e:
                raise SchemaError(
                    f"{db.path}: the SWARM books in meta {LEGACY_KEY!r} do not read ({e}): "
                    "resume it with the covey that wrote it, or start a new --data-dir"
                ) from None
            c.execute("DELETE FROM meta WHERE key = ?", (LEGACY_KEY,))
            log.info("moved the SWARM books of %s from meta %r into tables", db.path, LEGACY_KEY)
        c.execute("INSERT INTO meta VALUES (?, ?)", (VERSION_KEY, str(BOOKS_VERSION)))


def _backup(db: Database) -> None:
    path = db.path.with_name(f"{db.path.name}.books-v0.bak")
    src = sqlite3.connect(db.path)
    try:
        with sqlite3.connect(path) as copy:
            src.backup(copy)
        copy.close()
    finally:
        src.close()


def write(
    conn: sqlite3.Connection,
    snap: dict[str, Any],
    saved: dict[str, str],
    now: dict[str, str] | None = None,
) -> dict[str, str]:
    """Store the sections of `snap` whose JSON differs from `saved` (inside the caller's
    transaction; `now`: `sections(snap)` when the caller has it); returns the sections as
    now stored."""
    now = sections(snap) if now is None else now
    for key in SECTIONS:
        if now[key] == saved.get(key):
            continue
        for table in TABLES[key]:
            conn.execute(f"DELETE FROM {table}")
        WRITERS[key](conn, snap[key])
    return now


def _averaging(conn: sqlite3.Connection, data: dict[str, Any]) -> None:
    conn.execute("INSERT INTO swarm_counters VALUES ('next_round', ?)", (int(data["next_id"]),))
    rounds: dict[int, tuple[dict[str, Any], int | None]] = {}
    for b in data["stages"]:
        k = int(b["stage"])
        for r in (b["round"], b["last"]):
            if r is not None:
                rounds.setdefault(int(r["id"]), (r, None))
        for step, r in b["history"].items():
            rounds[int(r["id"])] = (r, int(step))
        conn.execute(
            "INSERT INTO swarm_stages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (k, int(b["step"]), b["agreed"], b.get("seeded"),
             None if b["round"] is None else int(b["round"]["id"]),
             None if b["last"] is None else int(b["last"]["id"]),
             float(b["committed_at"]), int(b["rounds"]), int(b["aborted"]),
             int(b["samples"]), json.dumps(b.get("norms", []))),
        )  # fmt: skip
        voters = set(b.get("voters", ()))
        missed, benched = b.get("missed", {}), b.get("benched", {})
        for p in sorted(set(b["states"]) | voters | set(missed) | set(benched)):
            conn.execute(
                "INSERT INTO swarm_stage_peers VALUES (?, ?, ?, ?, ?, ?)",
                (k, p, b["states"].get(p), int(p in voters), missed.get(p), benched.get(p)),
            )
    for rid, (r, step) in rounds.items():
        conn.execute(
            "INSERT INTO swarm_rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (rid, int(r["stage"]), int(r["step"]), json.dumps(r["members"]),
             float(r["opened"]), r["status"], json.dumps(r.get("dropped", [])), step),
        )  # fmt: skip
        for p, x in r["reports"].items():
            conn.execute(
                "INSERT INTO swarm_reports VALUES (?, ?, ?, ?, ?, ?, ?)",
                (rid, p, x["cid"], int(x["samples"]), x["url"], x.get("norm"),
                 x.get("vouched")),
            )  # fmt: skip


def _trainers(conn: sqlite3.Connection, trainers: dict[str, dict[str, Any]]) -> None:
    for p, t in trainers.items():
        conn.execute(
            "INSERT INTO swarm_trainers VALUES (?, ?, ?, ?, ?, ?, ?)",
            (p, t["name"], int(t.get("samples", 0)), t.get("loss"), int(t.get("reroutes", 0)),
             json.dumps(t.get("banned", {})), int(t.get("next", 0))),
        )  # fmt: skip


def _unpaid(conn: sqlite3.Connection, unpaid: dict[str, int]) -> None:
    conn.executemany("INSERT INTO swarm_unpaid VALUES (?, ?)", sorted(unpaid.items()))


def _vouched(conn: sqlite3.Connection, vouched: dict[str, int]) -> None:
    conn.executemany("INSERT INTO swarm_vouched VALUES (?, ?)", sorted(vouched.items()))


def _known_states(conn: sqlite3.Connection, known: list[list[str]]) -> None:
    conn.executemany(
        "INSERT INTO swarm_known_states VALUES (?, ?, ?)",
        [(k, i, cid) for k, states in enumerate(known) for i, cid in enumerate(states)],
    )


WRITERS = {
    "averaging": _averaging,
    "trainers": _trainers,
    "unpaid": _unpaid,
    "known_states": _known_states,
    "vouched": _vouched,
}


def read(db: Database, n_stages: int) -> dict[str, Any] | None:
    """The snapshot the tables hold, None before the first `write` (a new run)."""
    stages = db.query("SELECT * FROM swarm_stages ORDER BY stage")
    if not stages:
        return None
    reports: dict[int, dict[str, dict[str, Any]]] = {}
    for x in db.query("SELECT * FROM swarm_reports ORDER BY round, peer_id"):
        rep = {"cid": x["cid"], "samples": x["samples"], "url": x["url"]}
        for key in ("norm", "vouched"):
            if x[key] is not None:
                rep[key] = x[key]
        reports.setdefault(x["round"], {})[x["peer_id"]] = rep
    rounds = {}
    for r in db.query("SELECT * FROM swarm_rounds"):
        rounds[r["id"]] = (
            {"stage": r["stage"], "id": r["id"], "step": r["step"],
             "members": json.loads(r["members"]), "opened": r["opened"],
             "reports": reports.get(r["id"], {}), "status": r["status"],
             "dropped": json.loads(r["dropped"])},
            r["history_step"],
        )  # fmt: skip
    peers: dict[int, list[Any]] = {}
    for p in db.query("SELECT * FROM swarm_stage_peers ORDER BY stage, peer_id"):
        peers.setdefault(p["stage"], []).append(p)
    books = []
    for s in stages:
        k, mine = s["stage"], peers.get(s["stage"], [])
        books.append({
            "stage": k, "step": s["step"], "agreed": s["agreed"], "seeded": s["seeded"],
            "states": {p["peer_id"]: p["state"] for p in mine if p["state"] is not None},
            "round": None if s["open_round"] is None else rounds[s["open_round"]][0],
            "last": None if s["last_round"] is None else rounds[s["last_round"]][0],
            "committed_at": s["committed_at"], "rounds": s["rounds"], "aborted": s["aborted"],
            "samples": s["samples"], "norms": json.loads(s["norms"]),
            "history": {step: r for r, step in rounds.values()
                        if step is not None and r["stage"] == k},
            "voters": [p["peer_id"] for p in mine if p["voter"]],
            "missed": {p["peer_id"]: p["missed"] for p in mine if p["missed"] is not None},
            "benched": {p["peer_id"]: p["benched"] for p in mine if p["benched"] is not None},
        })  # fmt: skip
    known: list[list[str]] = [[] for _ in range(n_stages)]
    for x in db.query("SELECT * FROM swarm_known_states ORDER BY stage, position"):
        if x["stage"] < n_stages:
            known[x["stage"]].append(x["cid"])
    trainers = {
        t["peer_id"]: {"name": t["name"], "samples": t["samples"], "loss": t["loss"],
                       "reroutes": t["reroutes"], "banned": json.loads(t["banned"]),
                       "next": t["next"]}
        for t in db.query("SELECT * FROM swarm_trainers ORDER BY peer_id")
    }  # fmt: skip
    next_id = db.one("SELECT value FROM swarm_counters WHERE key = 'next_round'")
    return {
        "averaging": {"next_id": 0 if next_id is None else next_id[0], "stages": books},
        "trainers": trainers,
        "unpaid": {r["peer_id"]: r["tokens"] for r in db.query("SELECT * FROM swarm_unpaid")},
        "known_states": known,
        "vouched": {r["peer_id"]: r["samples"] for r in db.query("SELECT * FROM swarm_vouched")},
    }
