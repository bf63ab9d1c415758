"""The book's missed-fraud accounting: what a conviction costs those who passed the item.

An item (a rounds contribution, an RL rollout batch: both are (round, peer) in the ledger)
is convicted by a "dispute" with outcome "fraud" or a "contribution rejected" after it was
accepted by a check. Then every validator that reported "agree" on it may be charged a
"penalty" of kind "missed fraud" (validator_slash_fraction of its stake, once per item it
passed) and a "clawback" of kind "check" (the check reward it was paid for that item,
which a check reward names with `worker_id`); the convicted worker's work reward for the
item, if it was paid, is taken back by a "clawback" of kind "work". A clawback is taken
from stake: its amount is the pay, or the whole stake when less is left (`clawback_amount`).
Pure, like the book: `covey ledger verify` recomputes each of these.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from covey.trust.certify import check_canary_draw, draw_value
from covey.trust.house import check_house_proof
from covey.trust.ledger import LedgerError

if TYPE_CHECKING:
    from covey.trust.policy import Account, Policy


class Convictions:
    """Mixed into `Book`, which calls `_init_convictions` and applies the entries."""

    accounts: dict[str, Account]
    run_id: str | None
    coordinator_key: str | None
    _accepted: dict[tuple[int, str], int]

    def _init_convictions(self) -> None:
        self._agreed_by: dict[tuple[int, str], set[str]] = {}  # (round, peer) -> validators
        self._convicted: set[tuple[int, str]] = set()  # (round, peer)
        self._missed_due: dict[tuple[int, str], int] = {}  # (round, validator) -> unpenalised
        self._work_paid: dict[tuple[int, str], float] = {}  # (round, peer) -> work reward
        self._check_paid: dict[tuple[int, str, str], float] = {}  # (round, worker, validator)
        self._clawed: set[tuple[int, str, str]] = set()  # (round, worker, payee) taken back
        self.clawbacks = 0.0
        self._house_revealed: set[tuple[int, str]] = set()  # (round, house key)

    def _peer(self, i: int, p: dict[str, Any], field: str = "peer_id") -> Account:
        raise NotImplementedError

    def _policy(self) -> Policy:
        raise NotImplementedError

    # -- what the coordinator asks while writing entries -------------------------------

    def agreed_with(self, round_: int, peer_id: str) -> list[str]:
        """The validators that reported "agree" on peer_id's item of round_, sorted."""
        return sorted(self._agreed_by.get((round_, peer_id), set()))

    def missed_fraud_due(self, round_: int, validator_id: str) -> bool:
        """Whether a "missed fraud" penalty of this validator in round_ is now allowed."""
        return self._missed_due.get((round_, validator_id), 0) > 0

    def pay_to_claw_back(self, round_: int, worker_id: str, payee: str) -> float:
        """The pay of `payee` for worker_id's item of round_ that a conviction takes back:
        the worker's work reward (payee = the worker) or a validator's check reward; 0 if
        none was paid (or it was taken back already)."""
        if (round_, worker_id, payee) in self._clawed:
            return 0.0
        if payee == worker_id:
            return self._work_paid.get((round_, worker_id), 0.0)
        return self._check_paid.get((round_, worker_id, payee), 0.0)

    def clawback_amount(self, round_: int, worker_id: str, payee: str) -> float:
        """What a "clawback" must carry now: the pay, at most the payee's stake."""
        pay = self.pay_to_claw_back(round_, worker_id, payee)
        return min(pay, max(self.accounts[payee].stake, 0.0))

    # -- applied by the book ----------------------------------------------------------

    def _agreed(self, round_: int, peer_id: str, validator_id: str) -> None:
        key = (round_, peer_id)
        self._agreed_by.setdefault(key, set()).add(validator_id)
        if key in self._convicted:  # passed after the conviction: missed it all the same
            self._missed(round_, validator_id)

    def _convict(self, round_: int, peer_id: str) -> None:
        """The item is proven bad: every validator that agreed on it missed a fraud."""
        key = (round_, peer_id)
        if key in self._convicted:
            return
        self._convicted.add(key)
        for v in self._agreed_by.get(key, set()):
            self._missed(round_, v)

    def _missed(self, round_: int, validator_id: str) -> None:
        due = (round_, validator_id)
        self._missed_due[due] = self._missed_due.get(due, 0) + 1

    def _record_pay(self, p: dict[str, Any]) -> None:
        """A reward was applied: remember what may be clawed back (work, or a check that
        names the worker whose item it checked)."""
        if p["kind"] == "work":
            self._work_paid[(p["round"], p["peer_id"])] = p["amount"]
        elif p["kind"] == "check" and isinstance(p.get("worker_id"), str):
            self._check_paid[(p["round"], p["worker_id"], p["peer_id"])] = p["amount"]

    def _missed_fraud_penalty(self, i: int, acc: Account, round_: int) -> None:
        """Checks (and consumes) the grounds of a "missed fraud" penalty."""
        if not self.missed_fraud_due(round_, acc.peer_id):
            raise LedgerError(
                i,
                f"penalty (missed fraud): validator {acc.peer_id} agreed on no contribution "
                f"rejected in round {round_} after it (none convicted)",
            )
        self._missed_due[(round_, acc.peer_id)] -= 1

    def _clawback(self, i: int, p: dict[str, Any]) -> None:
        acc, worker = self._peer(i, p), self._peer(i, p, "worker_id")
        rnd, kind = p["round"], p["kind"]
        where = f"clawback ({kind}) of {acc.peer_id} for {worker.peer_id}'s round-{rnd} item"
        if (rnd, worker.peer_id) not in self._convicted:
            raise LedgerError(i, f"{where}: the item was not convicted")
        if kind == "work" and acc.peer_id != worker.peer_id:
            raise LedgerError(i, f"{where}: work pay is clawed back from its worker only")
        if kind == "check" and acc.peer_id not in self._agreed_by.get((rnd, worker.peer_id), ()):
            raise LedgerError(i, f"{where}: the validator did not agree on the item")
        if not self.pay_to_claw_back(rnd, worker.peer_id, acc.peer_id):
            raise LedgerError(i, f"{where}: no {kind} pay for it is left to claw back")
        expected = self.clawback_amount(rnd, worker.peer_id, acc.peer_id)
        if p["amount"] != expected:
            raise LedgerError(
                i, f"{where}: {p['amount']} is not the pay, at most the stake: {expected}"
            )
        self._clawed.add((rnd, worker.peer_id, acc.peer_id))
        acc.stake -= expected
        acc.slashed += expected
        self.clawbacks += expected

    def _house_canary(self, i: int, p: dict[str, Any]) -> None:
        """The reveal of a house worker's canary (covey.trust.house): the draw and the
        house proof are the coordinator's, the draw is below canary_rate, the contribution
        was accepted (rounds) or a validator agreed on it or it was convicted (an RL batch,
        a served answer); a served answer's draw is over its `request` id, not the round;
        "caught" needs it convicted already, "convicted" convicts it now.
        Every validator that agreed on it passed a canary; the key is burned (banned)."""
        acc, rnd = self._peer(i, p), p["round"]
        key, run_id = self.coordinator_key or "", self.run_id or ""
        where = f"house canary of {acc.peer_id} in round {rnd}"
        if not check_house_proof(key, run_id, acc.peer_id, p["proof"]):
            raise LedgerError(i, f"{where}: proof is not the coordinator's signature")
        drawn_at = rnd  # a serving canary's draw is over its request (covey.serve.canaries)
        if isinstance(p.get("request"), str):
            if not re.fullmatch(r"[0-9a-f]{32}", p["request"]):
                raise LedgerError(i, f"{where}: request {p['request'][:40]!r} is not a request id")
            drawn_at = int(p["request"], 16)
        if not check_canary_draw(key, run_id, drawn_at, acc.peer_id, p["draw"]):
            raise LedgerError(i, f"{where}: draw is not the coordinator's signature")
        rate = self._policy().canary_rate
        if draw_value(p["draw"]) >= rate:
            value = draw_value(p["draw"])
            raise LedgerError(i, f"{where}: its draw is {value:.3g}, not below {rate}")
        key = (rnd, acc.peer_id)
        if key not in self._accepted and key not in self._agreed_by and key not in self._convicted:
            # rounds: an accepted contribution; RL: a batch a validator agreed on or convicted
            raise LedgerError(i, f"{where}: no checked contribution of it in that round")
        if (rnd, acc.peer_id) in self._house_revealed:
            raise LedgerError(i, f"{where}: revealed twice")
        convicted = (rnd, acc.peer_id) in self._convicted
        if p["outcome"] == "caught" and not convicted:
            raise LedgerError(i, f"{where}: caught, but no dispute convicted it")
        if p["outcome"] == "convicted":
            if convicted:
                raise LedgerError(i, f"{where}: convicted already (a caught canary)")
            acc.frauds += 1
            self._convict(rnd, acc.peer_id)
        self._house_revealed.add((rnd, acc.peer_id))
        if p["outcome"] != "unchecked":  # agreeing on it proves a validator did not work
            for v in self._agreed_by.get((rnd, acc.peer_id), set()):
                self.accounts[v].canaries_passed += 1
        acc.banned = True
