"""Stakes, rewards, slashes, reputation and ownership, all replayed from the ledger.

Pure: no I/O. `Book.apply` takes ledger entries in order and enforces the run's rules
(../shared/DESIGN.md, "Incentives"): contributors stake to join and earn
`policy.reward_per_token` per token of accepted work; proven fraud costs
`policy.slash_fraction` of stake and bans; a validator earns `policy.catch_reward` per fraud
it proves. Ownership of the model is each peer's share of the tokens paid for (Pluralis'
Protocol Learning). The coordinator keeps one Book updated entry by entry and reports its
`summary()`; `covey ledger verify` replays the ledger from scratch and must get the same.

The payload of each entry type is the contract between the coordinator and this module:

- "run created": {run_id, name, spec: dict, coordinator_key, policy: Policy.to_dict()}
- "join": {peer_id, public_key, name, role: "worker"|"validator"}  (once per key)
- "stake": {peer_id, amount} (at least min_stake for a worker, min_validator_stake for a
  validator);  "leave": {peer_id, reason}
- "contribution accepted": {round, peer_id, cid, tokens, inner_steps, sampled, rate, draw,
  request_id, nonce, signature};  "contribution rejected": {round, peer_id, reason}
- "verification": {round, peer_id, validator_id, outcome: "agree"|"disagree"|"expired",
  distance: float|null, exact: bool}; "expired" names the validator that held the check
  and did not report in time (a missed check: it counts against it), or "" (older runs)
- "assignment": {round, peer_id, beacon, validators: [ids], reason: "draw"|"reassign"}: which
  validators must check a sampled contribution, drawn from the public beacon (the hash of
  the last round certificate before the round was accepted) with the validator ids: each
  eligible validator (staked at least min_validator_stake, not banned, not the worker, not
  tried on this contribution, under validator_round_cap checks this round) ranks by
  sha256(beacon, round, peer, validator), and the first n are assigned, n = the checks still
  needed. The book recomputes every draw (`Book.draw`); a contribution sampled as new or
  low-reputation needs validators_per_check checks, others one (fewer if fewer validators
  are eligible). A "verification" must come from an assigned validator; a work reward of a
  sampled contribution needs its checks completed (else the round's checks were skipped)
- "canary": {round, peer_id (the validator), worker_id, cid, draw, outcome: "caught"|
  "passed"|"missed"}: a known-bad contribution (the worker's payload sign-flipped) the
  coordinator planted among the validator's checks, revealed once resolved; `draw` is the
  coordinator's signature (covey.trust.certify.canary_message), below canary_rate. Caught:
  a completed check (paid check_reward); passed: a "penalty" (kind canary) follows, no pay;
  missed: a missed check
- "report refused": {round, peer_id (the validator), worker_id, task_id, field, reason}: a
  validator's report that was malformed or unprovable (segment out of range, a blob missing
  or of the wrong size); it counts against the validator's reputation and ends its
  assignment (another validator is drawn)
- "penalty": {round, peer_id, amount, kind: "false accusation"|"canary", reason}: a
  validator loses validator_slash_fraction of its stake (not banned) for a dispute the
  referee found it wrong in, or for passing a canary
- "dispute": {round, peer_id, validator_id, segment, outcome: "fraud"|"validator wrong"|
  "inconclusive", detail}
- "slash": {round, peer_id, amount, reason}
- "reward": {round, peer_id, amount, kind: "work"|"catch"|"check", tokens (0 unless work)};
  a "check" pays check_reward to a validator for a completed assigned check, once per
  reported verification
- "round certificate": {round, new_hash, certificate_hash, accepted: [ids], rejected: [ids]}
- "checkpoint": {round, cid, weights_hash}
- "halt": {round, owner_key, reason, request}: the owner's signed HALT (covey.trust.halt)

Fields beyond these are ignored. Amounts are compared exactly: the coordinator computes
them with the same expressions (`Book.work_reward`, `Book.slash_amount`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from covey.trust import halt
from covey.trust.draws import Draws
from covey.trust.identity import IdentityError, peer_id_of
from covey.trust.ledger import Entry, LedgerError

if TYPE_CHECKING:
    from covey.config import TrustConfig


@dataclass(frozen=True)
class Policy:
    """The incentive rules a run was created with (see covey.config.TrustConfig)."""

    min_stake: float
    reward_per_token: float
    slash_fraction: float
    catch_reward: float
    new_peer_rate: float
    new_peer_contributions: int
    low_reputation: float
    sample_rate: float
    # added later: a "run created" entry without them gets these defaults (older ledgers)
    min_validator_stake: float = 0.0
    validator_slash_fraction: float = 0.0
    check_reward: float = 0.0
    validators_per_check: int = 1
    validator_round_cap: int = 1_000_000
    canary_rate: float = 0.0

    @classmethod
    def from_config(cls, cfg: TrustConfig) -> Policy:
        return cls.from_dict({f.name: getattr(cfg, f.name) for f in fields(cls)})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Policy:
        """ValueError naming the field if one is missing, unknown, or not a non-negative
        finite number (new_peer_contributions: an int)."""
        names = [f.name for f in fields(cls)]
        if isinstance(data, dict):
            data = {**{n: getattr(_DEFAULTS, n) for n in _LATER_FIELDS}, **data}
        if not isinstance(data, dict) or set(data) != set(names):
            got = sorted(data) if isinstance(data, dict) else data
            raise ValueError(f"policy must have exactly the fields {names}, got {got}")
        values: dict[str, Any] = {}
        for name in names:
            v, cast = data[name], int if name in _INT_FIELDS else float
            ok = isinstance(v, int) if cast is int else isinstance(v, (int, float))
            if not ok or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"policy.{name} must be a non-negative {cast.__name__}, got {v!r}")
            values[name] = cast(v)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The "run created" entry's `policy` payload."""
        return asdict(self)


@dataclass
class Account:
    """One peer's standing. `slashed` is the amount of stake lost."""

    peer_id: str
    name: str
    role: str
    public_key: str
    stake: float = 0.0
    balance: float = 0.0
    tokens_paid: int = 0
    contributions: int = 0
    rejected: int = 0
    agreed: int = 0
    frauds: int = 0
    false_accusations: int = 0
    catches: int = 0
    slashed: float = 0.0
    banned: bool = False
    checks: int = 0  # a validator's reports on its checks
    refused_reports: int = 0
    missed_checks: int = 0
    canaries_passed: int = 0

    @property
    def validator_faults(self) -> int:
        """What counts against a validator: false accusations, refused reports, checks it
        held and did not report in time, canaries it agreed with."""
        return (
            self.false_accusations + self.refused_reports + self.missed_checks
            + self.canaries_passed
        )  # fmt: skip

    @property
    def reputation(self) -> float:
        """A worker: (agreed + 1) / (agreed + frauds + 2). A validator: (checks + 1) /
        (checks + faults + 2). 0.5 for a peer with no record."""
        if self.role == "validator":
            good = max(self.checks - self.false_accusations - self.canaries_passed, 0)
            return (good + 1) / (good + self.validator_faults + 2)
        return (self.agreed + 1) / (self.agreed + self.frauds + 2)


class Book(Draws):
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
        _check(entry)
        if self.halted is not None and entry.type in halt.AFTER_HALT_FORBIDDEN:
            raise LedgerError(i, f"{entry.type!r} after the HALT (entry {self.halted['index']})")
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
                },
            }
        ordered = [self.accounts[p] for p in sorted(self.accounts)]
        return {
            "run_id": self.run_id,
            "coordinator_key": self.coordinator_key,
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
        acc.stake += amount

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
        if p["sampled"]:  # new or low-reputation peers need k checks, the others one
            policy = self._policy()
            new = acc.contributions < policy.new_peer_contributions
            low = acc.reputation < policy.low_reputation
            self._required[key] = policy.validators_per_check if new or low else 1
        self._accepted[key] = p["tokens"]
        acc.contributions += 1

    def _contribution_rejected(self, i: int, p: dict[str, Any]) -> None:
        self._peer(i, p).rejected += 1

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
        validator.checks += 1
        self._done[key] = self._done.get(key, 0) + 1
        due = (p["round"], validator.peer_id)
        self._checks_due[due] = self._checks_due.get(due, 0) + 1
        if p["outcome"] == "agree":
            acc.agreed += 1

    def _report_refused(self, i: int, p: dict[str, Any]) -> None:
        self._peer(i, p).refused_reports += 1
        self._open.get((p["round"], p["worker_id"]), set()).discard(p["peer_id"])

    def _penalty(self, i: int, p: dict[str, Any]) -> None:
        acc, amount = self._peer(i, p), p["amount"]
        expected = self.penalty_amount(acc.peer_id)
        if acc.role != "validator":
            raise LedgerError(i, f"penalty: peer {acc.peer_id} is a {acc.role}, not a validator")
        if amount != expected:
            raise LedgerError(
                i,
                f"penalty: {amount} is not validator_slash_fraction "
                f"{self._policy().validator_slash_fraction} x stake {acc.stake} = {expected}",
            )
        acc.stake -= amount
        acc.slashed += amount
        self.penalties += amount
        if p["kind"] == "canary":
            acc.canaries_passed += 1

    def _dispute(self, i: int, p: dict[str, Any]) -> None:
        acc, validator = self._peer(i, p), self._peer(i, p, "validator_id")
        if p["outcome"] == "fraud":
            acc.frauds += 1
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

    def _peer(self, i: int, p: dict[str, Any], field: str = "peer_id") -> Account:
        if p[field] not in self.accounts:
            raise LedgerError(i, f"unknown peer {p[field]!r} ({field})")
        return self.accounts[p[field]]

    def _policy(self) -> Policy:
        if self.policy is None:
            raise ValueError("no 'run created' entry applied yet: the run has no policy")
        return self.policy


# Each entry type's payload: "field:kind" where kind is id (non-empty text), text, count
# (int >= 0), amount (finite number >= 0), amount? (or null), bool, object, ids (a list of
# ids), or a|b|c (one of these strings). Fields beyond these are ignored.
_SCHEMA_TEXT = {
    "run created": "run_id:text, name:text, spec:object, coordinator_key:text, policy:object",
    "join": "peer_id:id, public_key:text, name:text, role:worker|validator",
    "stake": "peer_id:id, amount:amount",
    "leave": "peer_id:id, reason:text",
    "contribution accepted": "round:count, peer_id:id, cid:text, tokens:count, "
    "inner_steps:count, sampled:bool, rate:amount, draw:text, request_id:text, nonce:text, "
    "signature:text",
    "contribution rejected": "round:count, peer_id:id, reason:text",
    "verification": "round:count, peer_id:id, validator_id:text, outcome:agree|disagree|expired, "
    "distance:amount?, exact:bool",
    "dispute": "round:count, peer_id:id, validator_id:id, segment:count, "
    "outcome:fraud|validator wrong|inconclusive, detail:text",
    "slash": "round:count, peer_id:id, amount:amount, reason:text",
    "reward": "round:count, peer_id:id, amount:amount, kind:work|catch|check, tokens:count",
    "report refused": "round:count, peer_id:id, worker_id:id, task_id:count, field:text, "
    "reason:text",
    "assignment": "round:count, peer_id:id, beacon:text, validators:ids, reason:draw|reassign",
    "canary": "round:count, peer_id:id, worker_id:id, cid:text, draw:text, "
    "outcome:caught|passed|missed",
    "penalty": "round:count, peer_id:id, amount:amount, kind:false accusation|canary, reason:text",
    "round certificate": "round:count, new_hash:text, certificate_hash:text, accepted:ids, "
    "rejected:ids",
    "checkpoint": "round:count, cid:text, weights_hash:text",
    "halt": "round:count, owner_key:text, reason:text, request:object",
}
SCHEMAS: dict[str, dict[str, str]] = {
    t: dict(field.split(":", 1) for field in text.split(", ")) for t, text in _SCHEMA_TEXT.items()
}


def _check(entry: Entry) -> None:
    """LedgerError naming the entry if a payload field is missing or holds the wrong kind."""
    for name, kind in SCHEMAS[entry.type].items():
        if name not in entry.payload:
            raise LedgerError(entry.index, f"{entry.type}: payload lacks field {name!r}")
        if not _holds(entry.payload[name], kind):
            want = f"one of {kind.split('|')}" if "|" in kind else f"{kind}"
            got = repr(entry.payload[name])[:80]
            raise LedgerError(
                entry.index, f"{entry.type}: field {name!r} must be {want}, got {got}"
            )


def _holds(v: Any, kind: str) -> bool:
    if "|" in kind:
        return isinstance(v, str) and v in kind.split("|")
    if kind == "amount?":
        return v is None or _holds(v, "amount")
    if kind in ("amount", "count"):
        number = isinstance(v, int if kind == "count" else (int, float))
        return number and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    if kind == "ids":
        return isinstance(v, list) and all(_holds(x, "id") for x in v)
    if kind == "id":
        return isinstance(v, str) and v != ""
    return isinstance(v, {"text": str, "bool": bool, "object": dict}[kind])


_DEFAULTS = Policy(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 0.0)
_LATER_FIELDS = (
    "min_validator_stake",
    "validator_slash_fraction",
    "check_reward",
    "validators_per_check",
    "validator_round_cap",
    "canary_rate",
)
_INT_FIELDS = ("new_peer_contributions", "validators_per_check", "validator_round_cap")
