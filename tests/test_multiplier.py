"""The decentralization multiplier (covey.protocol.multiplier) and the rounds mode's reading
of it from a coordinator's database (covey.coordinator.costs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from covey.coordinator.assignment import CHECKS_SCHEMA
from covey.coordinator.costs import run_costs
from covey.coordinator.db import Database
from covey.coordinator.peers import Peers
from covey.protocol.multiplier import PARTS, Costs


def test_a_member_books_its_compute_as_useful_and_the_rest_as_a_part() -> None:
    c = Costs()
    c.add_member(10.0, 6.0, "accepted")
    c.add_member(10.0, None, "rejected")
    c.add_member(4.0, None, "absent")
    c.verification_s = 3.0
    assert (c.useful_s, c.network_s, c.rejected_s, c.churn_s) == (6.0, 4.0, 10.0, 4.0)
    assert c.multiplier() == pytest.approx((6 + 4 + 10 + 4 + 3) / 6)
    d = c.as_dict()
    assert d["multiplier"] == pytest.approx(1 + sum(d["adds"].values()), abs=1e-3)
    assert set(d["parts_s"]) == set(PARTS)
    with pytest.raises(ValueError, match="unknown outcome"):
        c.add_member(1.0, 1.0, "paid")


def test_no_accepted_work_has_no_multiplier() -> None:
    c = Costs()
    c.add_member(5.0, None, "absent")
    assert c.multiplier() is None and c.as_dict()["multiplier"] is None


def test_a_coordinators_database_is_read_into_the_parts(tmp_path: Path) -> None:
    db = Database(tmp_path / "c.db")
    db._conn.executescript(CHECKS_SCHEMA)  # the checks table (covey.coordinator.assignment)
    cert = {"accepted": [{"peer_id": "a"}, {"peer_id": "b"}]}
    with db.transaction() as c:
        for peer, mbps in (("a", 8.0), ("b", None), ("c", 1.0), ("d", 1.0)):
            c.execute(
                "INSERT INTO peers (peer_id, state, bandwidth_mbps) VALUES (?, 'live', ?)",
                (peer, mbps),
            )
        c.execute(
            "INSERT INTO rounds (round, attempt, status, opened_at, closed_at, members, "
            "certificate) VALUES (0, 1, 'committed', 100.0, 110.0, ?, ?)",
            (json.dumps(["a", "b", "c", "d"]), json.dumps(cert)),
        )
        for peer, compute in (("a", 7.0), ("b", 9.0)):
            c.execute(
                "INSERT INTO contributions (round, attempt, peer_id, compute_s) "
                "VALUES (0, 1, ?, ?)",
                (peer, compute),
            )
        # c was refused at intake; d never sent anything
        c.execute(
            "INSERT INTO rejections (round, attempt, peer_id, reason, at) "
            "VALUES (0, 1, 'c', 'nan', 105)"
        )
        # attempt 0 was aborted after 2.5 s with 2 members
        detail = {"round": 0, "attempt": 0, "why": "x", "members": 2, "span_s": 2.5}
        db.event(c, 99.0, "round aborted", "", detail)
        vid = c.execute(
            "INSERT INTO verifications (round, peer_id, status, report) VALUES (0, 'a', "
            "'agree', ?)",
            (json.dumps({"compute_s": 4.0}),),
        ).lastrowid
        c.execute("INSERT INTO checks VALUES (?, 'v', 'done', 101.0)", (vid,))
        # a's drawn start state (its end is recomputed, not fetched), to its one validator:
        # 1 MB at 8 Mbit/s, 1 s; b's never came
        c.execute(
            "INSERT INTO local_states (round, attempt, peer_id, start_cid, end_cid, end_size, "
            "evidence) VALUES (0, 1, 'a', 's', 'e', 1000000, 'pending')"
        )
        c.execute(
            "INSERT INTO local_states (round, attempt, peer_id, start_cid, end_cid, end_size, "
            "evidence) VALUES (0, 1, 'b', 's', 'e', 1000000, 'undelivered')"
        )
    costs = run_costs(db, Peers(db))
    assert costs.useful_s == pytest.approx(16.0)
    assert costs.network_s == pytest.approx(3.0 + 1.0)
    assert costs.rejected_s == pytest.approx(10.0)
    assert costs.churn_s == pytest.approx(10.0 + 2 * 2.5)
    assert costs.verification_s == pytest.approx(4.0)
    assert (costs.evidence_bytes, costs.evidence_s) == (1_000_000, pytest.approx(1.0))
    assert costs.redundant_s == 0.0 and costs.unmeasured == []
    assert costs.multiplier() == pytest.approx((16 + 4 + 10 + 15 + 4 + 1) / 16)


def test_the_incremental_rounds_booking_equals_a_full_scan(tmp_path: Path) -> None:
    """RoundsCosts books each committed round once; after every commit, abort, report and
    evidence delivery its update equals run_costs' full scan of the same database."""
    import random

    from covey.coordinator.costs import RoundsCosts

    db, rng = Database(tmp_path / "c.db"), random.Random(0)
    db._conn.executescript(CHECKS_SCHEMA)
    peers, booking = Peers(db), RoundsCosts()
    with db.transaction() as c:
        for p in "abcd":
            c.execute(
                "INSERT INTO peers (peer_id, state, bandwidth_mbps) VALUES (?, 'live', ?)",
                (p, rng.choice([None, 4.0])),
            )
    for r in range(12):
        members = rng.sample("abcd", rng.randint(1, 4))
        accepted = [m for m in members if rng.random() < 0.6]
        with db.transaction() as c:
            if rng.random() < 0.3:  # an aborted attempt first
                detail = {"round": r, "attempt": 0, "members": 2, "span_s": rng.random()}
                db.event(c, 1.0 * r, "round aborted", "", detail)
            c.execute(
                "INSERT INTO rounds (round, attempt, status, opened_at, closed_at, members, "
                "certificate) VALUES (?, 1, 'open', ?, NULL, ?, NULL)",
                (r, 10.0 * r, json.dumps(members)),
            )
        # an open round is not booked yet
        assert booking.update(db, peers).as_dict() == run_costs(db, peers).as_dict()
        with db.transaction() as c:
            for m in members:
                if m in accepted or rng.random() < 0.5:
                    c.execute(
                        "INSERT INTO contributions (round, attempt, peer_id, compute_s) "
                        "VALUES (?, 1, ?, ?)",
                        (r, m, rng.random() * 5),
                    )
            cert = {"accepted": [{"peer_id": m} for m in accepted]}
            c.execute(
                "UPDATE rounds SET status = 'committed', closed_at = ?, certificate = ? "
                "WHERE round = ?",
                (10.0 * r + 6.0, json.dumps(cert), r),
            )
            for m in accepted[:1]:
                c.execute(
                    "INSERT INTO verifications (round, peer_id, status) VALUES (?, ?, 'claimed')",
                    (r, m),
                )
                c.execute(
                    "INSERT INTO local_states (round, attempt, peer_id, start_cid, end_cid, "
                    "end_size, evidence) VALUES (?, 1, ?, 's', 'e', 1000, NULL)",
                    (r, m),
                )
        assert booking.update(db, peers).as_dict() == run_costs(db, peers).as_dict()
        with db.transaction() as c:  # a report and a delivery land after the commit
            c.execute(
                "UPDATE verifications SET report = ? WHERE round = ?",
                (json.dumps({"compute_s": rng.random()}), r),
            )
            c.execute("UPDATE local_states SET evidence = 'pending' WHERE round = ?", (r,))
            for v in c.execute("SELECT id FROM verifications WHERE round = ?", (r,)).fetchall():
                for k in range(rng.randint(1, 2)):  # its validators' checks, completed
                    c.execute("INSERT INTO checks VALUES (?, ?, 'done', 0.0)", (v[0], f"v{k}"))
        assert booking.update(db, peers).as_dict() == run_costs(db, peers).as_dict()
    assert booking.last_round == 11 and run_costs(db, peers).useful_s > 0
    assert run_costs(db, peers).evidence_bytes > 0


def test_evidence_is_booked_once_per_validator_that_fetched_it(tmp_path: Path) -> None:
    """A new peer's contribution checked by two validators sent its start state twice, an
    audited one by one more; a check still held, missed or attested withheld fetched
    nothing; a contribution of an aborted attempt, and one with no start state (a first
    round), sends none."""
    db = Database(tmp_path / "c.db")
    db._conn.executescript(CHECKS_SCHEMA)
    size = 1_000_000
    checks = {
        "new": ["done", "done"],  # validators_per_check = 2
        "audited": ["done", "done", "done"],  # two, and the audit's one
        "sampled": ["done"],
        "held": ["done", "assigned", "missed", "withheld"],
    }
    with db.transaction() as c:
        for peer in [*checks, "fresh", "aborted"]:
            c.execute(
                "INSERT INTO peers (peer_id, state, bandwidth_mbps) VALUES (?, 'live', 8.0)",
                (peer,),
            )
        members = [*checks, "fresh"]
        cert = {"accepted": [{"peer_id": m} for m in members]}
        c.execute(
            "INSERT INTO rounds (round, attempt, status, opened_at, closed_at, members, "
            "certificate) VALUES (1, 2, 'committed', 0.0, 10.0, ?, ?)",
            (json.dumps(members), json.dumps(cert)),
        )
        for peer, statuses in [*checks.items(), ("fresh", ["done"]), ("aborted", ["done"])]:
            attempt = 1 if peer == "aborted" else 2
            start = None if peer == "fresh" else "s"
            c.execute(
                "INSERT INTO local_states (round, attempt, peer_id, start_cid, end_cid, "
                "end_size, evidence) VALUES (1, ?, ?, ?, 'e', ?, 'pending')",
                (attempt, peer, start, size),
            )
            if peer == "aborted":
                continue  # its attempt was aborted: no verification
            vid = c.execute(
                "INSERT INTO verifications (round, peer_id, status) VALUES (1, ?, 'agree')",
                (peer,),
            ).lastrowid
            for i, status in enumerate(statuses):
                c.execute("INSERT INTO checks VALUES (?, ?, ?, 1.0)", (vid, f"v{i}", status))
    costs = run_costs(db, Peers(db))
    fetches = 2 + 3 + 1 + 1
    assert costs.evidence_bytes == fetches * size
    assert costs.evidence_s == pytest.approx(fetches * 1.0)  # 1 MB at 8 Mbit/s each


def test_an_rl_runs_costs_are_booked_by_what_became_of_each_batch(tmp_path: Path) -> None:
    from covey.rl.costs import record, record_batch
    from covey.rl.costs import run_costs as rl_costs
    from covey.rl.intake import RL_SCHEMA

    db = Database(tmp_path / "rl.db")
    with db.transaction() as c:
        for statement in RL_SCHEMA:
            c.execute(statement)
        # generate, wall: accepted and consumed are useful (+ network), rejected and dropped
        # are lost; a pending batch is not booked yet
        for cid, status, gen, wall in (
            ("a", "consumed", 4.0, 5.0),
            ("b", "accepted", 2.0, 2.5),
            ("r", "rejected", 3.0, 4.0),
            ("d", "dropped", 1.0, 1.5),
            ("p", "pending", 9.0, 9.0),
        ):
            c.execute(
                "INSERT INTO rl_batches (step, worker_id, cid, status) VALUES (0, ?, ?, ?)",
                (cid, cid, status),
            )
            record_batch(c, cid, gen, wall)
        record(c, "check", 0.5, "a")  # a validator's check
        record(c, "check", 0.25, "canary")  # a canary's (no batch row)
        record(c, "fetch", 0.1, "a", 1000)  # the batch it fetched
        record(c, "step", 1.0)  # the trainer's step
        record(c, "check", None, "b")  # a validator that reported nothing books nothing
        record(c, "generate", 1e12, "z")  # a peer's seconds are bounded
    d = rl_costs(db).as_dict()
    assert d["useful_s"] == pytest.approx(4 + 2 + 1)
    assert d["parts_s"] == pytest.approx(
        {
            "network": 1.5,
            "verification": 0.75,
            "evidence": 0.1,
            "redundant": 1.5,
            "churn": 0.0,
            "rejected": 4.0,
        }
    )
    assert d["evidence_bytes"] == 1000 and d["unmeasured"]
    assert d["multiplier"] == pytest.approx((7 + 1.5 + 0.75 + 0.1 + 1.5 + 4) / 7, abs=1e-3)


def test_a_swarm_microbatchs_hops_are_booked_by_what_became_of_it() -> None:
    from covey.swarm.costs import Spent, book_microbatch

    c = Costs()
    hops = [Spent("hop", 2.0, 1.5), Spent("check", 2.5, 1.5), Spent("failed", 0.5)]
    book_microbatch(c, [*hops, Spent("invalid", 0.25, 0.2), Spent("hop", 1.0, 9.0)], "trained")
    # a server claiming more compute than the hop's wall time is held to the wall time; a
    # failed hop's compute is its wall time (the dead server reports none)
    assert (c.useful_s, c.redundant_s, c.churn_s, c.rejected_s) == (2.5, 1.5, 0.5, 0.2)
    assert c.network_s == 0.0  # the servers' idle time is the coordinator's to add
    book_microbatch(c, hops, "dropped")  # could not finish: all of it lost to churn
    assert c.churn_s == 0.5 + 3.5 and c.useful_s == 2.5
    book_microbatch(c, hops, "disputed")  # its duplicated replies disagreed
    assert c.rejected_s == pytest.approx(0.2 + 3.5)
    book_microbatch(c, [Spent("hop", 1.0)], "trained")  # no compute header: all useful
    assert c.useful_s == 3.5 and c.unmeasured
    with pytest.raises(ValueError, match="unknown outcome"):
        book_microbatch(c, hops, "paid")


def test_swarm_trainers_reports_are_bounded_and_summed() -> None:
    from pydantic import ValidationError

    from covey.protocol.multiplier import CostsReport
    from covey.swarm.costs import RunCosts, TrainerCosts

    t = TrainerCosts()
    t.begin()
    t.hop("hop", 2.0, 1.0)
    t.hop("check", 2.0, 1.0)
    t.end(trained=True)
    t.evidence(0.5, 300)
    report = CostsReport.model_validate(t.report())
    run = RunCosts()
    run.note("a", report)
    run.note("a", report)  # cumulative: a later report replaces the earlier one
    run.note("b", CostsReport(useful_s=1.0))
    # servers: 10 s in the run, 4 computing; 3 s booked by trainers, so 1 s no one booked
    run.server("s1", 6.0, 3.0)
    run.server("s2", 4.0, 9.0)  # a claim over its uptime is held to it
    run.server("s2", 4.0, 1.0)  # heartbeats are cumulative: the latest replaces
    total = run.total()
    assert (total.useful_s, total.redundant_s, total.network_s) == (2.0, 1.0, 6.0)
    assert total.churn_s == pytest.approx(1.0) and total.evidence_bytes == 300
    assert total.multiplier() == pytest.approx((2 + 1 + 6 + 1 + 0.5) / 2)
    for bad in ({"useful_s": -1.0}, {"churn_s": float("inf")}, {"network_s": 1e12},
                {"unmeasured": ["x"] * 9}, {"surprise": 1}):  # fmt: skip
        with pytest.raises(ValidationError):
            CostsReport.model_validate(bad)
