"""No party clears its own work: the book's validator draw (covey.trust.draws) is weighted
by stake counted up to a per-key cap, and every drawn set holds a validator with an
established record when one is eligible; `covey bench trust --only finality` measures
what a party holding a share of the stake can clear (covey.bench.finality). Pure."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from covey.bench.finality import book_for, clear_probability, stated
from covey.trust.certify import audit_message
from covey.trust.draws import weighted_rank
from covey.trust.identity import Identity
from covey.trust.ledger import LedgerError
from covey.trust.policy import Account
from tests.test_ledger import POLICY, Run


def test_draws_follow_capped_stake() -> None:
    book, _ = book_for(0.2, party_established=True)
    book.accounts["whale"] = Account("whale", "whale", "validator", "", stake=10_000.0,
                                     checks=50)  # fmt: skip
    first = Counter(book.draw(r, "cheater", 1)[0] for r in range(4000))
    # weights: 5 honest x 20, the party's 2 x 12.5, the whale capped at 100 (of 10,000)
    assert first["whale"] / 4000 == pytest.approx(100 / 225, abs=0.03)
    assert first["honest0"] / 4000 == pytest.approx(20 / 225, abs=0.02)
    assert weighted_rank("f" * 64, 0.0, 100.0) == float("inf")  # no stake, never first


def test_fresh_keys_cannot_hold_every_check_of_an_item() -> None:
    book, party = book_for(0.4, party_established=False)
    for r in range(500):
        for checks in (1, 2):
            drawn = book.draw(r, "cheater", checks)
            assert len(drawn) == checks and any(book.established(v) for v in drawn)
            assert not set(drawn) <= party


@pytest.mark.parametrize("share", [0.2, 0.4])
def test_a_party_with_established_keys_clears_what_is_stated(share: float) -> None:
    book, party = book_for(share, party_established=True)
    for checks in (1, 2):
        for audit in (0.0, 0.5):
            assert clear_probability(book, party, checks, 3000, audit) == pytest.approx(
                stated(share, checks, audit), abs=0.03
            )


def test_a_ledger_without_the_rules_draws_as_before() -> None:
    """An older run's policy (no cap, no established rule): ranked by the hash alone."""
    book, _ = book_for(0.4, party_established=False)
    book.policy = book.policy.__class__.from_dict(
        {**book.policy.to_dict(), "validator_stake_cap": 0.0, "established_checks": 0}
    )
    from covey.trust.draws import draw_rank

    ranked = sorted(
        (v for v, a in book.accounts.items() if a.role == "validator"),
        key=lambda v: draw_rank(book.beacon(3), 3, "cheater", v),
    )
    assert book.draw(3, "cheater", 2) == ranked[:2]


def test_an_audit_of_cleared_work_is_drawn_by_the_coordinator_and_holds_its_pay(
    tmp_path: Path,
) -> None:
    """The book's side of an audit: only of a contribution cleared by its checks, with the
    coordinator's draw below audit_rate, once; its pay waits for the audit's check."""
    run = Run(tmp_path, dataclasses.replace(POLICY, audit_rate=1.0, validators_per_check=1))
    worker = run.join("ada", stake=10.0)
    for name in ("v1", "v2", "v3"):
        run.join(name, role="validator", stake=5.0)
    run.accept(0, worker, 100)
    drawn = run.assign(0, worker).payload["validators"]
    audit = {"round": 0, "peer_id": worker, "beacon": run.book.beacon(0), "reason": "audit"}
    draw = run.coord.sign(audit_message("r" * 16, 0, worker))
    with pytest.raises(LedgerError, match="not complete and all agreeing"):
        run.add("assignment", validators=drawn, draw=draw, **audit)
    check = {"round": 0, "peer_id": worker, "validator_id": drawn[0]}
    run.add("verification", outcome="agree", distance=0.0, exact=True, **check)
    assert run.book.cleared(0, worker)
    with pytest.raises(LedgerError, match="draw is not the coordinator's"):
        forged = Identity.generate().sign(audit_message("r" * 16, 0, worker))
        run.add("assignment", validators=run.book.draw(0, worker, 1), draw=forged, **audit)
    auditor = run.book.draw(0, worker, 1)
    assert auditor and auditor[0] not in drawn
    run.add("assignment", validators=auditor, draw=draw, **audit)
    with pytest.raises(LedgerError, match="checks were skipped"):
        run.pay(0, worker, 100)  # the audit's check is not in yet
    run.add("verification", outcome="agree", distance=0.0, exact=True,
            **{**check, "validator_id": auditor[0]})  # fmt: skip
    run.pay(0, worker, 100)
    with pytest.raises(LedgerError, match="audited before"):
        run.add("assignment", validators=run.book.draw(0, worker, 1), draw=draw, **audit)
