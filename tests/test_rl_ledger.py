"""The RL audit's penalty kind on the ledger: a "missed fraud" penalty must follow the
validator's "agree" on a contribution that was then rejected in the same round (the
trainer's audit found it bad); the book refuses one that does not, so a run owner cannot
penalize a validator at will. (Canaries: tests/test_rl_validators.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from covey.io import audit
from covey.trust.incentives import Book
from covey.trust.ledger import LedgerError
from tests.test_ledger import Run, _unchecked


def _setup(dir: Path) -> tuple[Run, str, str]:
    run = Run(dir)
    return run, run.join("w"), run.join("v", role="validator")


def _verification(run: Run, round: int, worker: str, validator: str, outcome: str) -> None:
    run.add(
        "verification",
        round=round,
        peer_id=worker,
        validator_id=validator,
        outcome=outcome,
        distance=None,
        exact=True,
    )


def _missed(run: Run, round: int, validator: str) -> None:
    run.add(
        "penalty",
        round=round,
        peer_id=validator,
        amount=run.book.penalty_amount(validator),
        kind="missed fraud",
        reason="accepted a batch the audit rejected",
    )


def test_a_missed_fraud_penalty_follows_an_agree_on_a_rejected_contribution(
    tmp_path: Path,
) -> None:
    run, w, v = _setup(tmp_path)
    _verification(run, 3, w, v, "agree")
    run.add("contribution rejected", round=3, peer_id=w, reason="proof: audit")
    _missed(run, 3, v)
    with pytest.raises(LedgerError, match="missed fraud"):  # one penalty per miss
        _missed(run, 3, v)
    assert Book.replay(run.entries()).summary() == run.book.summary()
    assert audit.verify(tmp_path).summary["accounts"][v]["stake"] < 10.0


@pytest.mark.parametrize("case", ["no agree", "agree, not rejected", "another round"])
def test_a_missed_fraud_penalty_without_a_miss_is_refused(tmp_path: Path, case: str) -> None:
    run, w, v = _setup(tmp_path)
    if case != "no agree":
        _verification(run, 3, w, v, "agree")
    if case == "another round":
        run.add("contribution rejected", round=4, peer_id=w, reason="proof")
    with pytest.raises(LedgerError, match="agreed on no contribution rejected in round 3"):
        _missed(run, 3, v)
    run.add = _unchecked(run)  # type: ignore[method-assign] -- a dishonest trainer writes it
    _missed(run, 3, v)
    with pytest.raises(LedgerError, match="missed fraud"):
        audit.verify(tmp_path)
