"""Checks: what every coordinator mode's verification shares (rounds' contributions in
covey.coordinator.verification, RL's rollout batches in covey.rl.verdicts).

- The referee's interface: `Referee.judge(item) -> Verdict` (convicted, cleared or
  inconclusive), implemented by rounds' disputes (covey.coordinator.disputes.Disputes.judge:
  one disputed segment recomputed) and RL's verdicts (covey.rl.verdicts.Judge.judge: a
  batch's samples recomputed). A referee that fails convicts nobody: `judge_safely` turns
  a raise into "inconclusive"; rounds retry a raising judge `trust.dispute_attempts` times
  and then close the dispute inconclusive, RL leaves the batch undecided.
- Who checks an item: covey.trust.draws.draw_validators, one rule for both modes, each
  passing its candidates, its beacon's rank, the item's worker, load and cap.
- Missed-fraud accounting (`Checks.convict`): when an item is convicted, every validator
  that reported "agree" on it loses validator_slash_fraction of its stake (a "penalty" of
  kind "missed fraud") and the check reward it was paid for it (a "clawback"), and the
  worker's work reward for it, if paid, is clawed back from its stake. The amounts are the
  book's (covey.trust.convictions), so `covey ledger verify` recomputes every one.
- A check's pay (`Checks.pay_check`): a "check" reward naming the item's worker, which is
  what lets a conviction find it again.

The caller writes the conviction itself (a "dispute" with outcome "fraud" and the worker's
"slash", or RL's "contribution rejected") and then calls `convict` in the same transaction.
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Literal, Protocol, TypeVar

if TYPE_CHECKING:
    from .accounts import Accounts

log = logging.getLogger("covey.coordinator")

Outcome = Literal["convicted", "cleared", "inconclusive"]
Item = TypeVar("Item", contravariant=True)


@dataclass(frozen=True)
class Verdict:
    """A referee's decision on one item. `detail` says why, for the ledger; `finding` is
    the mode's own word for it (rounds' dispute outcome: "fraud", "validator wrong",
    "honest drift", "inconclusive"; RL's batch problem); `evidence` the part at fault
    when one is (rounds' segment, RL's sample)."""

    outcome: Outcome
    detail: str
    finding: str = ""
    evidence: int | None = None

    @property
    def convicted(self) -> bool:
        return self.outcome == "convicted"


class Referee(Protocol, Generic[Item]):
    """Decides whether an item (a contribution, a rollout batch) is what its worker claims.
    `judge` may raise: `judge_safely` turns that into an inconclusive verdict."""

    def judge(self, item: Item) -> Verdict: ...


def judge_safely(referee: Referee[Item], item: Item) -> Verdict:
    """The referee's verdict, or "inconclusive" when judging raises: a referee that fails
    convicts nobody."""
    try:
        return referee.judge(item)
    except Exception as e:  # a bug in judging must not convict (nor kill the caller)
        log.exception("the referee failed")
        detail = f"the referee failed: {type(e).__name__}: {e}"[:500]
        return Verdict("inconclusive", detail, "inconclusive")


class Checks:
    """Pay for checks and the cost of a conviction, written to the ledger through the
    run's `Accounts` (inside the caller's transaction)."""

    def __init__(self, accounts: Accounts) -> None:
        self.accounts = accounts

    def pay_check(
        self,
        c: sqlite3.Connection,
        round_: int,
        worker_id: str,
        validator_id: str,
        amount: float,
        now: float,
    ) -> None:
        """A completed check's reward to its validator (nothing when amount is 0)."""
        if amount <= 0:
            return
        self.accounts.append(
            c,
            "reward",
            {
                "round": round_,
                "peer_id": validator_id,
                "amount": amount,
                "kind": "check",
                "tokens": 0,
                "worker_id": worker_id,
            },
            now,
        )

    def convict(
        self, c: sqlite3.Connection, round_: int, worker_id: str, reason: str, now: float
    ) -> list[str]:
        """After the conviction of worker_id's item of round_ is on the ledger: a "missed
        fraud" penalty and a claw-back of its check pay for each validator that agreed on
        it, and a claw-back of the worker's pay for it. Returns the validators penalised."""
        book = self.accounts.book
        penalised = []
        for v in book.agreed_with(round_, worker_id):
            if book.missed_fraud_due(round_, v):
                self.accounts.append(
                    c,
                    "penalty",
                    {
                        "round": round_,
                        "peer_id": v,
                        "amount": book.penalty_amount(v),
                        "kind": "missed fraud",
                        "reason": f"missed fraud: agreed on {worker_id[:12]}'s round-{round_} "
                        f"item, convicted: {reason}"[:500],
                    },
                    now,
                )
                penalised.append(v)
            self._claw_back(c, round_, worker_id, v, "check", reason, now)
        self._claw_back(c, round_, worker_id, worker_id, "work", reason, now)
        return penalised

    def _claw_back(
        self,
        c: sqlite3.Connection,
        round_: int,
        worker_id: str,
        payee: str,
        kind: Literal["work", "check"],
        reason: str,
        now: float,
    ) -> None:
        book = self.accounts.book
        if not book.pay_to_claw_back(round_, worker_id, payee):
            return
        self.accounts.append(
            c,
            "clawback",
            {
                "round": round_,
                "peer_id": payee,
                "worker_id": worker_id,
                "amount": book.clawback_amount(round_, worker_id, payee),
                "kind": kind,
                "reason": f"{worker_id[:12]}'s round-{round_} item was convicted: {reason}"[:500],
            },
            now,
        )
