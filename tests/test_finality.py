"""No party clears its own work: the book's validator draw (covey.trust.draws) is weighted
by stake counted up to a per-key cap, and every drawn set holds a validator with an
established record when one is eligible; `covey bench trust --only finality` measures
what a party holding a share of the stake can clear (covey.bench.finality). Pure."""

from __future__ import annotations

from collections import Counter

import pytest

from covey.bench.finality import book_for, clear_probability, stated
from covey.trust.draws import weighted_rank
from covey.trust.policy import Account


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
        assert clear_probability(book, party, checks, 3000) == pytest.approx(
            stated(share, checks), abs=0.03
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
