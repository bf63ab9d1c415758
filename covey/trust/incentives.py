"""Stakes, rewards, slashes, reputation and ownership, all replayed from the ledger.

Pure: no I/O. `Book.apply` takes ledger entries in order and enforces the run's rules
(docs/trust.md): contributors stake to join and earn
`policy.reward_per_token` per token of accepted work; proven fraud costs
`policy.slash_fraction` of stake and bans; a validator earns `policy.catch_reward` per fraud
it proves. Ownership of the model is each peer's share of the tokens paid for (Pluralis'
Protocol Learning). The coordinator keeps one Book updated entry by entry and reports its
`summary()`; `covey ledger verify` replays the ledger from scratch and must get the same.

The payload of each entry type (its contract with the coordinator) is documented and
checked in covey.trust.entry_schemas; the rules (`Policy`) and a peer's standing
(`Account`) are in covey.trust.policy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from covey.trust import halt
from covey.trust.certify import check_draw, draw_value
from covey.trust.convictions import Convictions
from covey.trust.draws import Draws
from covey.trust.entry_schemas import SCHEMAS, check_payload
from covey.trust.identity import IdentityError, peer_id_of
from covey.trust.ledger import Entry, LedgerError
from covey.trust.policy import Account, Policy
from covey.trust.treasury import Treasury
from covey.trust.withholding import Withholding

# A worker that withholds the local states of this many contributions drawn for
# verification is excluded (its stake untouched): each withholding escapes a check, and
# one may be a crash in mid-submission, two are a pattern.
WITHHELD_BAN = 2

__all__ = ["SCHEMAS", "Account", "Book", "Policy"]


class Book(Draws, Convictions, Withholding, Treasury):
    """The run's accounts as of the entries applied so far. Build with `replay`, or apply
    entries one by one as they are appended."""

    def __init__(self) -> None:
        self.policy: Policy | None = None
        self.run_id: str | None = None
        self.coordinator_key: str | None = None
        self.owner_key: str | None = None  # who may halt the run (covey.trust.halt)
        self.halted: dict[str, Any] | None = None  # the HALT: {index, round, reason}
        self.accounts: dict[str, Account] = {}
        self.entries = 0
        self.certificates = 0
        self.checkpoints = 0
        self.work_rewards = 0.0
        self.catch_rewards = 0.0
        self._keys: set[str] = set()
        self._accepted: dict[tuple[int, str], int] = {}  # (round, peer) -> tokens
        self._paid: set[tuple[int, str]] = set()
        self._catches_due: dict[tuple[int, str], int] = {}  # (round, validator) -> unpaid
        self._checks_due: dict[tuple[int, str], int] = {}  # (round, validator) -> unpaid
        self.check_rewards = 0.0
        self.penalties = 0.0
        # validator assignment (see the "assignment" entry); keys (round, worker)
        self._last_certificate: str | None = None
        self._beacons: dict[int, str] = {}  # round -> its draws' beacon
        self._required: dict[tuple[int, str], int] = {}  # sampled -> checks it needs
        self._open: dict[tuple[int, str], set[str]] = {}  # assigned, not yet reported
        self._tried: dict[tuple[int, str], set[str]] = {}  # ever assigned
        self._done: dict[tuple[int, str], int] = {}  # completed checks
        self._load: dict[tuple[int, str], int] = {}  # (round, validator) -> assigned
        self._canaries: set[tuple[int, str]] = set()  # (round, validator) resolved
        self._audited: set[tuple[int, str]] = set()  # (round, worker) audited once
        # a training coordinator's run (its "run created" names the corpus fingerprint)
        # signs each contribution's sampling draw; None: no contribution seen yet, True:
        # one was accepted at rate 0 (a run whose contributions nobody re-executes)
        self._signed_draws = False
        self._unchecked_run: bool | None = None
        self._init_convictions()  # missed fraud and claw-backs (covey.trust.convictions)
        self._init_withholding()  # attested withheld evidence (covey.trust.withholding)
        self._init_treasury()  # deposits, bonds, unbonding (covey.trust.treasury)

    @classmethod
    def replay(cls, entries: Iterable[Entry]) -> Book:
        """A book of `entries` applied in order; LedgerError naming the first that breaks a
        rule. Checks no hashes or signatures: run `verify_chain` first."""
        book = cls()
        for entry in entries:
            book.apply(entry)
        return book

    def apply(self, entry: Entry) -> None:
        """Account for the next entry. LedgerError naming `entry.index` if it is out of order
        or breaks a rule; the book is then unchanged (every check precedes every change)."""
        i = entry.index
        if i != self.entries:
            raise LedgerError(i, f"applied out of order: the book holds {self.entries} entries")
        if self.policy is None and entry.type != "run created":
            raise LedgerError(i, f"{entry.type!r} before the 'run created' entry")
        if self.policy is not None and entry.type == "run created":
            raise LedgerError(i, "a second 'run created' entry")
        if entry.type not in SCHEMAS:
            raise LedgerError(i, f"unknown type {entry.type!r}")
        check_payload(entry)
        if self.halted is not None and entry.type in halt.AFTER_HALT_FORBIDDEN:
            raise LedgerError(i, f"{entry.type!r} after the HALT (entry {self.halted['index']})")
        self._at = entry.at
        getattr(self, "_" + entry.type.replace(" ", "_"))(i, entry.payload)
        self.entries += 1

    # -- what the coordinator asks while writing entries -------------------------------

    def sampling_rate(self, peer_id: str) -> float:
        """Share of this peer's contributions validators re-execute: new_peer_rate while it
        has fewer than new_peer_contributions accepted or reputation below low_reputation
        (or is unknown), else sample_rate."""
        policy = self._policy()
        acc = self.accounts.get(peer_id)
        if acc is None or acc.contributions < policy.new_peer_contributions:
            return policy.new_peer_rate
        return (
            policy.new_peer_rate if acc.reputation < policy.low_reputation else policy.sample_rate
        )

    def work_reward(self, tokens: int) -> float:
        """The amount a "work" reward for `tokens` verified tokens must carry."""
        return tokens * self._policy().reward_per_token

    def slash_amount(self, peer_id: str) -> float:
        """The amount a slash of this peer must carry now (KeyError if unknown)."""
        return self._policy().slash_fraction * self.accounts[peer_id].stake

    def penalty_amount(self, peer_id: str) -> float:
        """The amount a validator's "penalty" must carry now (KeyError if unknown)."""
        return self._policy().validator_slash_fraction * self.accounts[peer_id].stake

    def min_stake_of(self, role: str) -> float:
        """The stake a peer of `role` must hold: min_stake (worker), min_validator_stake."""
        policy = self._policy()
        return policy.min_validator_stake if role == "validator" else policy.min_stake

    def ownership(self) -> dict[str, float]:
        """Each account's share of all tokens paid for (all 0.0 before the first reward)."""
        total = sum(a.tokens_paid for a in self.accounts.values())
        return {p: (a.tokens_paid / total if total else 0.0) for p, a in self.accounts.items()}

    def summary(self) -> dict[str, Any]:
        """JSON-able standing of every account (sorted by peer id) and the totals."""
        share = self.ownership()
        accounts = {}
        for peer_id in sorted(self.accounts):
            a = self.accounts[peer_id]
            accounts[peer_id] = {
                "name": a.name,
                "role": a.role,
                "stake": a.stake,
                "balance": a.balance,
                "tokens_paid": a.tokens_paid,
                "ownership": share[peer_id],
                "reputation": a.reputation,
                "banned": a.banned,
                "slashed": a.slashed,
                "held": self.held(peer_id),
                "release_at": a.release_at,
                "counts": {
                    "contributions": a.contributions,
                    "rejected": a.rejected,
                    "agreed": a.agreed,
                    "frauds": a.frauds,
                    "false_accusations": a.false_accusations,
                    "catches": a.catches,
                    "checks": a.checks,
                    "refused_reports": a.refused_reports,
                    "missed_checks": a.missed_checks,
                    "canaries_passed": a.canaries_passed,
                    "no_shows": a.no_shows,
                    "withheld": a.withheld,
                },
            }
        ordered = [self.accounts[p] for p in sorted(self.accounts)]
        policy = self.policy
        return {
            "run_id": self.run_id,
            "coordinator_key": self.coordinator_key,
            # what a key must hold to join (a peer started without --stake bonds this)
            "min_stake": {
                "worker": policy.min_stake if policy else 0.0,
                "validator": policy.min_validator_stake if policy else 0.0,
            },
            "entries": self.entries,
            "certificates": self.certificates,
            "checkpoints": self.checkpoints,
            "halted": self.halted,
            "totals": {
                "accounts": len(ordered),
                "banned": sum(a.banned for a in ordered),
                "stake": math.fsum(a.stake for a in ordered),
                "balance": math.fsum(a.balance for a in ordered),
                "tokens_paid": sum(a.tokens_paid for a in ordered),
                "slashed": math.fsum(a.slashed for a in ordered),
                "work_rewards": self.work_rewards,
                "catch_rewards": self.catch_rewards,
                "check_rewards": self.check_rewards,
                "penalties": self.penalties,
                "clawbacks": self.clawbacks,
                "deposited": self.deposited,
            },
            "accounts": accounts,
        }

    # -- one handler per entry type; `_check` has validated the payload's fields --------

    def _run_created(self, i: int, p: dict[str, Any]) -> None:
        try:
            self.policy = Policy.from_dict(p["policy"])
        except ValueError as e:
            raise LedgerError(i, f"run created: {e}") from None
        self.run_id, self.coordinator_key = p["run_id"], p["coordinator_key"]
        self.owner_key = halt.owner_of(p["spec"], p["coordinator_key"])
        self._signed_draws = "corpus_fingerprint" in p  # RL and SWARM draw otherwise
        self._start_treasury(p["spec"])

    def _join(self, i: int, p: dict[str, Any]) -> None:
        peer_id, key = p["peer_id"], p["public_key"]
        if key in self._keys or peer_id in self.accounts:
            raise LedgerError(i, f"join: a second join of public key {key} (peer {peer_id})")
        try:
            derived = peer_id_of(key)
        except IdentityError as e:
            raise LedgerError(i, f"join: {e}") from None
        if derived != peer_id:
            raise LedgerError(i, f"join: peer_id {peer_id} is not the id of key {key} ({derived})")
        self._keys.add(key)
        self.accounts[peer_id] = Account(peer_id, p["name"], p["role"], key)

    def _stake(self, i: int, p: dict[str, Any]) -> None:
        acc, amount = self._peer(i, p), p["amount"]
        min_stake = self.min_stake_of(acc.role)
        if acc.stake + amount < min_stake:
            raise LedgerError(
                i,
                f"stake: {amount} leaves peer {acc.peer_id} with {acc.stake + amount}, "
                f"below the minimum stake {min_stake} of a {acc.role}",
            )
        self._bond(i, acc, amount)
        acc.stake += amount
        acc.bonded += amount

    def _leave(self, i: int, p: dict[str, Any]) -> None:
        self._peer(i, p)

    def _contribution_accepted(self, i: int, p: dict[str, Any]) -> None:
        acc, key = self._peer(i, p), (p["round"], p["peer_id"])
        if p["rate"] > 1:
            raise LedgerError(i, f"contribution accepted: rate {p['rate']} is above 1")
        if key in self._accepted:
            raise LedgerError(
                i, f"contribution accepted: a second one of peer {key[1]} in round {key[0]}"
            )
        if acc.stake < self._policy().min_stake:
            raise LedgerError(
                i,
                f"contribution accepted: peer {acc.peer_id} has stake {acc.stake}, below "
                f"min_stake {self._policy().min_stake}",
            )
        if self._signed_draws:
            self._check_sampling(i, p, acc)
        if p["sampled"]:  # new or low-reputation peers need k checks, the others one
            policy = self._policy()
            new = acc.contributions < policy.new_peer_contributions
            low = acc.reputation < policy.low_reputation
            self._required[key] = policy.validators_per_check if new or low else 1
        self._accepted[key] = p["tokens"]
        acc.contributions += 1

    def _check_sampling(self, i: int, p: dict[str, Any], acc: Account) -> None:
        """A training run's sampling draw: the coordinator's signature over (run, round,
        peer, cid), `sampled` exactly when it falls below `rate`, and a rate the policy
        gives this peer: the new-peer rate while it is new, else the new-peer or the base
        rate (which of the two turns on its reputation when the contribution was taken in,
        before this entry: not pinned here), or 0 throughout a run nobody re-executes."""
        where = f"contribution accepted: peer {p['peer_id']}'s round-{p['round']} draw"
        key, run_id = self.coordinator_key or "", self.run_id or ""
        if not check_draw(key, run_id, p["round"], p["peer_id"], p["cid"], p["draw"]):
            raise LedgerError(i, f"{where} is not the coordinator's signature of its cid")
        policy, rate = self._policy(), p["rate"]
        new = acc.contributions < policy.new_peer_contributions
        rates = {policy.new_peer_rate} if new else {policy.new_peer_rate, policy.sample_rate}
        unchecked = rate == 0 and rate not in rates
        if rate not in rates and not unchecked:
            raise LedgerError(i, f"{where} is at rate {rate}; the policy's are {sorted(rates)}")
        if self._unchecked_run is not None and self._unchecked_run != unchecked:
            others = "all at rate 0" if self._unchecked_run else "drawn at the policy's rates"
            raise LedgerError(i, f"{where} is at rate {rate}; the run's others were {others}")
        self._unchecked_run = unchecked
        if p["sampled"] != (draw_value(p["draw"]) < rate):
            raise LedgerError(
                i,
                f"{where} says sampled={p['sampled']}, but {draw_value(p['draw']):.3g} "
                f"against rate {rate} says otherwise",
            )

    def _contribution_rejected(self, i: int, p: dict[str, Any]) -> None:
        acc = self._peer(i, p)
        acc.rejected += 1
        if p.get("withheld") is True:  # drawn for verification; its evidence never came
            acc.withheld += 1
            acc.banned = acc.banned or acc.withheld >= WITHHELD_BAN
        if (p["round"], p["peer_id"]) in self._agreed_by:  # rejected after a check passed it
            self._convict(p["round"], p["peer_id"])

    def _verification(self, i: int, p: dict[str, Any]) -> None:
        acc = self._peer(i, p)
        validator = self._peer(i, p, "validator_id") if p["validator_id"] else None
        key = (p["round"], p["peer_id"])
        if validator is not None and key in self._required:
            if validator.peer_id not in self._open.get(key, set()):
                raise LedgerError(
                    i,
                    f"verification: validator {validator.peer_id} holds no assignment to check "
                    f"{key[1]}'s round-{key[0]} contribution",
                )
            self._open[key].discard(validator.peer_id)
        if p["outcome"] == "expired":  # names the validator that missed it, or "" (older)
            if validator is not None:
                validator.missed_checks += 1
            return
        if validator is None:
            raise LedgerError(i, "verification: an outcome names its validator")
        if p["outcome"] == "withheld":  # attested non-delivery: not a completed check
            self._attest_withheld(i, p, validator)
            return
        validator.checks += 1
        self._done[key] = self._done.get(key, 0) + 1
        due = (p["round"], validator.peer_id)
        self._checks_due[due] = self._checks_due.get(due, 0) + 1
        if p["outcome"] == "agree":
            acc.agreed += 1
            self._agreed(p["round"], p["peer_id"], validator.peer_id)

    def _report_refused(self, i: int, p: dict[str, Any]) -> None:
        self._peer(i, p).refused_reports += 1
        self._open.get((p["round"], p["worker_id"]), set()).discard(p["peer_id"])

    def _penalty(self, i: int, p: dict[str, Any]) -> None:
        acc, amount = self._peer(i, p), p["amount"]
        expected = self.penalty_amount(acc.peer_id)
        # a missed fraud may be a SWARM server's: the second server of a duplicated hop
        # is that hop's check (covey.swarm.payouts); its grounds are checked below
        if acc.role != "validator" and p["kind"] != "missed fraud":
            raise LedgerError(i, f"penalty: peer {acc.peer_id} is a {acc.role}, not a validator")
        if amount != expected:
            raise LedgerError(
                i,
                f"penalty: {amount} is not validator_slash_fraction "
                f"{self._policy().validator_slash_fraction} x stake {acc.stake} = {expected}",
            )
        if p["kind"] == "missed fraud":  # it agreed on an item convicted since
            self._missed_fraud_penalty(i, acc, p["round"])
        acc.stake -= amount
        acc.slashed += amount
        self.penalties += amount
        if p["kind"] == "canary":
            acc.canaries_passed += 1

    def _dispute(self, i: int, p: dict[str, Any]) -> None:
        acc, validator = self._peer(i, p), self._peer(i, p, "validator_id")
        if p["outcome"] == "fraud":
            acc.frauds += 1
            self._convict(p["round"], p["peer_id"])
            key = (p["round"], validator.peer_id)
            self._catches_due[key] = self._catches_due.get(key, 0) + 1
        elif p["outcome"] == "validator wrong":
            validator.false_accusations += 1

    def _slash(self, i: int, p: dict[str, Any]) -> None:
        acc, amount = self._peer(i, p), p["amount"]
        expected = self.slash_amount(acc.peer_id)
        if amount != expected:
            raise LedgerError(
                i,
                f"slash: {amount} is not slash_fraction {self._policy().slash_fraction} x "
                f"stake {acc.stake} = {expected}",
            )
        if p.get("withheld") is True:  # its drawn validators attested its evidence withheld
            self._slash_withheld(i, p)
        evidence = p.get("evidence")
        if isinstance(evidence, dict) and evidence.get("kind") == "shard":
            # an aggregator's wrong shard (covey.trust.shard_evidence checks the evidence):
            # its round's item is convicted, so a checker that agreed with it missed fraud
            self._convict(p["round"], acc.peer_id)
        acc.stake -= amount
        acc.slashed += amount
        acc.banned = True

    def _reward(self, i: int, p: dict[str, Any]) -> None:
        acc, amount, tokens, rnd = self._peer(i, p), p["amount"], p["tokens"], p["round"]
        key, policy = (rnd, acc.peer_id), self._policy()
        fault = None
        if acc.banned:
            fault = f"a reward to banned peer {acc.peer_id}"
        elif p["kind"] == "work":
            if key not in self._accepted:
                fault = f"no accepted contribution of peer {acc.peer_id} in round {rnd}"
            elif key in self._paid:
                fault = f"peer {acc.peer_id}'s round-{rnd} contribution was already paid"
            elif tokens != self._accepted[key]:
                fault = f"pays for {tokens} tokens, but {self._accepted[key]} were accepted"
            elif not self.checks_complete(*key):
                fault = (
                    f"round {rnd}: peer {acc.peer_id}'s contribution was sampled and needs "
                    f"{self._required[key]} checks, {self._done.get(key, 0)} completed: "
                    f"its required checks were skipped"
                )
            elif amount != self.work_reward(tokens):
                fault = (
                    f"{amount} is not {tokens} tokens x reward_per_token "
                    f"{policy.reward_per_token} = {self.work_reward(tokens)}"
                )
        elif tokens != 0:
            fault = f"a {p['kind']} reward must carry tokens 0, got {tokens}"
        elif p["kind"] == "check":
            if not self._checks_due.get(key):
                fault = f"no unpaid check reported by validator {acc.peer_id} in round {rnd}"
            elif amount != policy.check_reward:
                fault = f"check reward {amount} is not check_reward {policy.check_reward}"
        elif not self._catches_due.get(key):
            fault = f"no unpaid 'fraud' dispute won by validator {acc.peer_id} in round {rnd}"
        elif amount != policy.catch_reward:
            fault = f"catch reward {amount} is not catch_reward {policy.catch_reward}"
        if fault is not None:
            raise LedgerError(i, f"reward ({p['kind']}): {fault}")
        self._record_pay(p)
        if p["kind"] == "work":
            self._paid.add(key)
            acc.tokens_paid += tokens
            self.work_rewards += amount
        elif p["kind"] == "check":
            self._checks_due[key] -= 1
            self.check_rewards += amount
        else:
            self._catches_due[key] -= 1
            acc.catches += 1
            self.catch_rewards += amount
        acc.balance += amount

    def _round_certificate(self, i: int, p: dict[str, Any]) -> None:
        self.certificates += 1
        self._last_certificate = p["certificate_hash"]

    def _checkpoint(self, i: int, p: dict[str, Any]) -> None:
        self.checkpoints += 1

    def _halt(self, i: int, p: dict[str, Any]) -> None:
        if self.halted is not None:
            raise LedgerError(i, f"halt: the run was halted already (entry {self.halted['index']})")
        if (problem := halt.halt_problem(p, self.run_id, self.owner_key)) is not None:
            raise LedgerError(i, f"halt: {problem}")
        self.halted = {"index": i, "round": p["round"], "reason": p["reason"]}

    def _no_show(self, i: int, p: dict[str, Any]) -> None:
        acc = self._peer(i, p)
        if acc.role != "worker":
            raise LedgerError(i, f"no show: peer {acc.peer_id} is a {acc.role}, not a worker")
        if p["consecutive"] < 1:
            raise LedgerError(i, f"no show: consecutive must be at least 1, got {p['consecutive']}")
        if p["consecutive"] >= 2:  # repeated: it sits out rounds and loses reputation
            acc.no_shows += 1

    def _peer(self, i: int, p: dict[str, Any], field: str = "peer_id") -> Account:
        if p[field] not in self.accounts:
            raise LedgerError(i, f"unknown peer {p[field]!r} ({field})")
        return self.accounts[p[field]]

    def _policy(self) -> Policy:
        if self.policy is None:
            raise ValueError("no 'run created' entry applied yet: the run has no policy")
        return self.policy
