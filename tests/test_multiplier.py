"""The decentralization multiplier (covey.protocol.multiplier) and the rounds mode's reading
of it from a coordinator's database (covey.coordinator.costs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
        c.execute(
            "INSERT INTO verifications (round, peer_id, status, report) VALUES (0, 'a', "
            "'agree', ?)",
            (json.dumps({"compute_s": 4.0}),),
        )
        # a's drawn local states: start and end, 1 MB each, at 8 Mbit/s: 2 s; b's never came
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
    assert (costs.evidence_bytes, costs.evidence_s) == (2_000_000, pytest.approx(2.0))
    assert costs.redundant_s == 0.0 and costs.unmeasured == []
    assert costs.multiplier() == pytest.approx((16 + 4 + 10 + 15 + 4 + 2) / 16)


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
