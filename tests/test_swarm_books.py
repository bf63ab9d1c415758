"""The SWARM coordinator's books in tables (covey.swarm.books): a data directory written
with the books as one JSON meta row (`swarm.state`, covey before the tables) opens, its
books moved into the tables; books of a newer covey, or a row that does not read, are
refused and left as they were; and a real coordinator process, SIGKILLed and restarted,
keeps them, from the tables and from a legacy row alike."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.coordinator.db import SchemaError
from covey.swarm import books
from covey.swarm.launch import Swarm, status
from covey.trust.identity import Identity
from tests.swarm_helpers import SETTINGS, corpus_text

P1, P2, P3, T = ("1" * 32, "2" * 32, "3" * 32, "7" * 32)
SEED, AGREED = "5" * 64, "a" * 64


def _round(rid: int, step: int, status: str, reports: dict[str, Any]) -> dict[str, Any]:
    return {"stage": 0, "id": rid, "step": step, "members": sorted([P1, P2]),
            "opened": 50.0 + rid, "reports": reports, "status": status, "dropped": []}  # fmt: skip


def _report(cid: str, samples: int, **more: Any) -> dict[str, Any]:
    return {"cid": cid, "samples": samples, "url": "", **more}


# the books of a 2-stage run as the coordinator wrote them in its meta row before the
# tables: one committed round on stage 0 (its history, keyed by step as JSON text), one
# open with a report in, votes, misses and benches, a trainer, queued pay, vouched samples
LEGACY: dict[str, Any] = {
    "averaging": {"next_id": 3, "stages": [
        {"stage": 0, "step": 1, "agreed": AGREED, "states": {P1: AGREED, P2: AGREED},
         "round": _round(2, 1, "open", {P1: _report("c" * 64, 4, norm=1.5, vouched=4)}),
         "last": _round(0, 0, "committed", {P1: _report("d" * 64, 4, norm=1.0, vouched=4),
                                             P2: _report("e" * 64, 4)}),
         "committed_at": 100.0,
         "history": {"0": _round(0, 0, "committed", {P1: _report("d" * 64, 4, norm=1.0,
                                                                 vouched=4),
                                                     P2: _report("e" * 64, 4)})},
         "rounds": 1, "aborted": 1, "samples": 8, "norms": [1.0, 2.5], "voters": [P1, P2],
         "seeded": SEED, "missed": {P2: 1}, "benched": {P3: 123.5}},
        {"stage": 1, "step": 0, "agreed": None, "states": {}, "round": None, "last": None,
         "committed_at": 0.0, "history": {}, "rounds": 0, "aborted": 0, "samples": 0,
         "norms": [], "voters": [], "seeded": None, "missed": {}, "benched": {}},
    ]},
    "trainers": {T: {"name": "t", "samples": 8, "loss": 3.0, "reroutes": 1,
                     "banned": {P3: "invalid reply"}, "next": 17}},
    "unpaid": {P1: 96},
    "known_states": [[SEED, AGREED], []],
    "vouched": {P1: 4},
}  # fmt: skip


def _coordinator(path: Path) -> Any:
    from covey.swarm.config import SwarmConfig
    from covey.swarm.service import SwarmCoordinator

    cfg = SwarmConfig(n_layer=2, n_embd=16, n_head=2, seq_len=8, stages=2)
    return SwarmCoordinator(cfg, path)


def _close(coord: Any) -> None:
    coord._stop.set()
    coord.db.close()


def _as_legacy(db_path: Path, snap: dict[str, Any]) -> None:
    """Rewrite a closed coordinator's database in the layout covey kept before the books'
    tables: only swarm_checks among them, the books as one JSON meta row."""
    with sqlite3.connect(db_path) as c:
        for sql in books.SCHEMA:
            table = sql.split()[5]
            if table != "swarm_checks":
                c.execute(f"DROP TABLE {table}")
        c.execute("DELETE FROM meta WHERE key = ?", (books.VERSION_KEY,))
        c.execute(
            "INSERT INTO meta VALUES (?, ?)", (books.LEGACY_KEY, json.dumps(snap, sort_keys=True))
        )
    c.close()


def _books(coord: Any) -> dict[str, Any]:
    """The coordinator's books in memory, as JSON reads them."""
    with coord.lock:
        return json.loads(json.dumps(coord._snapshot(), sort_keys=True))


def test_a_data_dir_with_the_books_in_one_json_row_opens_with_them_in_tables(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    _close(_coordinator(run))
    _as_legacy(run / "swarm.db", LEGACY)

    again = _coordinator(run)
    try:
        assert _books(again) == LEGACY  # every section, as the old coordinator left it
        assert again.averaging.stages[0].round is not None  # the open round resumes
        assert again.averaging.stages[0].history[0].reports[P2]["samples"] == 4
        assert again.db.get_meta(books.LEGACY_KEY) is None  # moved, not copied
        assert again.db.get_meta(books.VERSION_KEY) == str(books.BOOKS_VERSION)
        counts = {t: again.db.one(f"SELECT COUNT(*) AS n FROM {t}")["n"]
                  for t in ("swarm_rounds", "swarm_reports", "swarm_trainers",
                            "swarm_unpaid", "swarm_known_states", "swarm_stage_peers")}  # fmt: skip
        assert counts == {"swarm_rounds": 2, "swarm_reports": 3, "swarm_trainers": 1,
                          "swarm_unpaid": 1, "swarm_known_states": 2,
                          "swarm_stage_peers": 3}  # fmt: skip
        backup = run / "swarm.db.books-v0.bak"
        with sqlite3.connect(backup) as c:  # the database as it was, beside it
            row = c.execute("SELECT value FROM meta WHERE key = ?", (books.LEGACY_KEY,))
            assert json.loads(row.fetchone()[0]) == LEGACY
        c.close()
        # the books change and are written to the tables, section by section
        with again.lock:
            again.unpaid[P2] = 32
            again.trainers[T]["next"] = 21
            again._save()
        expected = _books(again)
    finally:
        _close(again)
    third = _coordinator(run)  # from the tables now
    try:
        assert _books(third) == expected
        assert third.unpaid == {P1: 96, P2: 32} and third.trainers[T]["next"] == 21
    finally:
        _close(third)


def test_an_older_row_without_known_states_or_vouched_samples_opens(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _close(_coordinator(run))
    older = {k: v for k, v in LEGACY.items() if k not in ("known_states", "vouched")}
    _as_legacy(run / "swarm.db", older)
    again = _coordinator(run)
    try:
        assert _books(again) == {**LEGACY, "known_states": [[], []], "vouched": {}}
    finally:
        _close(again)


def test_books_of_a_newer_covey_or_a_row_that_does_not_read_are_refused_as_they_are(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    _close(_coordinator(run))
    with sqlite3.connect(run / "swarm.db") as c:
        c.execute("UPDATE meta SET value = '2' WHERE key = ?", (books.VERSION_KEY,))
    c.close()
    with pytest.raises(SchemaError, match="version 2"):
        _coordinator(run)

    other = tmp_path / "other"
    _close(_coordinator(other))
    _as_legacy(other / "swarm.db", LEGACY)
    with sqlite3.connect(other / "swarm.db") as c:
        c.execute("UPDATE meta SET value = '{\"averaging\": 1}' WHERE key = ?",
                  (books.LEGACY_KEY,))  # fmt: skip
    c.close()
    with pytest.raises(SchemaError, match="do not read"):
        _coordinator(other)
    with sqlite3.connect(other / "swarm.db") as c:  # rolled back: the row is still there
        kept = c.execute("SELECT value FROM meta WHERE key = ?", (books.LEGACY_KEY,))
        assert kept.fetchone()[0] == '{"averaging": 1}'
    c.close()


# ---- a real coordinator process, SIGKILLed and restarted ----------------------------------


def _post(url: str, who: Identity, path: str, body: dict[str, Any]) -> httpx.Response:
    signed = who.sign_request(body, -1, purpose=f"POST {path}")
    return httpx.post(url + path, json=signed, timeout=30, trust_env=False)


def _trainers(url: str) -> dict[str, Any] | None:
    s = status(url)
    return None if s is None else s["trainers"]


@pytest.mark.network
@pytest.mark.long  # the migration and reopen tests above run by default
def test_a_sigkilled_coordinator_process_keeps_its_books(tmp_path: Path) -> None:
    """A trainer's books written over HTTP survive a SIGKILL of the coordinator, and a
    restart on a data directory whose books are in the legacy JSON row. Refused bodies
    in between leave them as they were."""
    data = tmp_path / "data.txt"
    data.write_text(corpus_text())
    swarm = Swarm(tmp_path, {**SETTINGS, "data_paths": [str(data)]})
    t = Identity.generate()
    try:
        swarm.start_coordinator()
        run_id = httpx.get(swarm.url + "/v1/run", timeout=30, trust_env=False).json()["run_id"]
        join = {"run_id": run_id, "peer_id": t.peer_id, "public_key": t.public_key,
                "role": "trainer", "name": "steady"}  # fmt: skip
        assert _post(swarm.url, t, "/v1/swarm/join", join).status_code == 200
        report = {"run_id": run_id, "peer_id": t.peer_id, "samples": 40, "loss": 2.5,
                  "reroutes": 2, "banned": {}, "next": 10}  # fmt: skip
        assert _post(swarm.url, t, "/v1/swarm/report", report).status_code == 200
        lies = [{**report, "next": -1}, {**report, "samples": 2**60}, {**report, "x": 1},
                {**report, "banned": {"f" * 32: "x" * 500}}]  # fmt: skip
        for lie in lies:
            assert _post(swarm.url, t, "/v1/swarm/report", lie).status_code == 422
        want = {"name": "steady", "samples": 40, "loss": 2.5, "reroutes": 2, "banned": {},
                "next": 10}  # fmt: skip
        assert _trainers(swarm.url) == {t.peer_id: want}

        swarm.kill_coordinator()  # SIGKILL: nothing flushed
        swarm.start_coordinator()
        assert _trainers(swarm.url) == {t.peer_id: want}
        swarm.kill_coordinator()

        db = tmp_path / "run" / "swarm.db"
        from covey.coordinator.db import Database

        held = Database(db)
        try:
            snap = books.read(held, SETTINGS["stages"])
        finally:
            held.close()
        assert snap is not None and snap["trainers"] == {t.peer_id: want}
        _as_legacy(db, snap)  # as a coordinator before the tables left it
        swarm.start_coordinator()
        assert _trainers(swarm.url) == {t.peer_id: want}
        # a restarted trainer of that name resumes after its last reported microbatch
        r = _post(swarm.url, t, "/v1/swarm/join", join)
        assert r.status_code == 200 and r.json()["resume"] == 10
    finally:
        swarm.close()
    with sqlite3.connect(db) as c:
        legacy = c.execute("SELECT value FROM meta WHERE key = ?", (books.LEGACY_KEY,))
        assert legacy.fetchone() is None
        rows = c.execute("SELECT name, next FROM swarm_trainers").fetchall()
    c.close()
    assert rows == [("steady", 10)]
