"""The run's treasury: stake is credits a key holds, never a number it declares.

Credits reach a key two ways, both ledger entries:

- a "deposit" by the run's owner (the spec's `owner_key`, else the coordinator's key, the
  same key that may HALT the run: covey.trust.halt.owner_of). `source: "owner"` carries the
  owner's signed request to POST /v1/ledger/deposit (`covey ledger deposit`), which the
  replay verifies; `source: "spec"` credits a key the run spec's `[trust.funds]` table
  names, with exactly the amount it names, once (the spec is hashed into the run id, so
  every peer was shown it);
- pay the key earned ("reward" entries).

A key's held balance is deposited + earned + released - bonded. A "stake" entry (a bond)
may not exceed it: a key bonds only credits it holds (`Policy.held_stake`; 0 in ledgers
written before this rule, which replay as declared). Leaving starts an unbonding: an
"unbond" entry names the whole stake and `release_at`, at least `Policy.unbonding_s` after
the entry; the stake stays in the account meanwhile, so a slash, penalty or claw-back that
reaches the key before then takes from it, and an unbonding validator is not drawn. A
"release" entry returns what is left to the held balance, never before `release_at`. A
key that joins again before its release "rebond"s: the unbonding is cancelled.

Pure: no I/O. `Treasury` is mixed into covey.trust.incentives.Book.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from covey.trust.identity import (
    NO_ROUND,
    IdentityError,
    peer_id_of,
    request_message,
    request_purpose,
    verify,
)
from covey.trust.ledger import LedgerError

if TYPE_CHECKING:
    from covey.trust.policy import Account, Policy

DEPOSIT_PATH = "/v1/ledger/deposit"
DEPOSIT_PURPOSE = request_purpose(DEPOSIT_PATH)
EPSILON = 1e-9  # amounts are sums of floats: a bond of exactly the balance must pass


#: where a mode's "run created" spec holds its own table, in which `trust.funds` is: the
#: RL mode's {"rl": RLSpec, ...} and the serving mode's {"serve": ServeConfig, ...}; the
#: rounds and SWARM specs hold `trust` at the top
MODE_TABLES = ("rl", "serve")


def mode_table(entries: Sequence[Any], table: str) -> tuple[dict[str, Any], Any] | None:
    """For a mode's `ledger_terms` (`covey ledger verify`): the "run created" payload of
    `entries` and its spec's `table` (one of MODE_TABLES, still unchecked), None for a
    ledger of another mode (its spec has no such table)."""
    created = entries[0].payload
    spec = created.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get(table), dict):
        return None
    return created, spec[table]


def check_spec_hash(created: dict[str, Any], got: str) -> None:
    """LedgerError unless `got`, what the run's spec hashes to (covey.rl.runspec.run_id_of,
    covey.serve.config.run_id_of), is the run id of the "run created" payload `created`: a
    coordinator cannot write other terms or other funds than the spec peers were shown."""
    if got != created.get("run_id"):
        why = f"its spec hashes to {got}, not run id {created.get('run_id')}"
        raise LedgerError(0, f"run created: {why}")


def spec_funds(spec: dict[str, Any]) -> dict[str, float]:
    """The credits a run spec grants at start: its `trust.funds` table (public key hex ->
    credits), {} when it has none. Entries that are not a key and a positive finite
    number are left out (the config refuses them before a run starts)."""
    table = next((spec[m] for m in MODE_TABLES if isinstance(spec.get(m), dict)), spec)
    trust = table.get("trust")
    funds = trust.get("funds") if isinstance(trust, dict) else None
    if not isinstance(funds, dict):
        return {}
    return {
        k: float(v)
        for k, v in funds.items()
        if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v) and v > 0
    }  # fmt: skip


def spec_deposits(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The "deposit" payloads of a spec's `trust.funds`, written right after "run created"
    (sorted by key, so two coordinators of one spec write the same ledger)."""
    return [
        {"peer_id": peer_id_of(key), "public_key": key, "amount": amount, "source": "spec"}
        for key, amount in sorted(spec_funds(spec).items())
    ]


def deposit_problem(
    p: dict[str, Any], run_id: str | None, owner_key: str | None, funds: dict[str, float]
) -> str | None:
    """What is wrong with a "deposit" payload, or None. `spec`: the key and amount the
    spec's funds name. `owner`: the request is this run's deposit to this key of this
    amount, signed for POST /v1/ledger/deposit by the owner."""
    key, amount = p["public_key"], p["amount"]
    try:
        derived = peer_id_of(key)
    except IdentityError as e:
        return str(e)
    if derived != p["peer_id"]:
        return f"peer_id {p['peer_id']} is not the id of key {key} ({derived})"
    if amount <= 0:
        return f"amount {amount} is not positive"
    if p["source"] == "spec":
        if funds.get(key) != amount:
            return f"the spec's funds grant key {key[:16]}... {funds.get(key, 0.0)}, not {amount}"
        return None
    request = p.get("request")
    if not owner_key:
        return "the run names no owner"
    if not isinstance(request, dict):
        return "no signed request"
    if request.get("owner_key") != owner_key:
        return f"signed by {str(request.get('owner_key'))[:16]}..., not the owner {owner_key}"
    if request.get("run_id") != run_id:
        return f"the request is for run {request.get('run_id')!r}, not {run_id!r}"
    if request.get("to") != key or request.get("amount") != amount:
        return "the key or amount differs from the owner's signed request"
    signature, message = (
        request.get("signature"),
        request_message(request, NO_ROUND, DEPOSIT_PURPOSE),
    )
    if not isinstance(signature, str) or not verify(owner_key, message, signature):
        return "the owner's signature does not verify"
    return None


class Treasury:
    """Mixed into `Book`, which calls `_init_treasury`, sets `_at` (the applied entry's
    time) and applies the entries."""

    accounts: dict[str, Account]
    run_id: str | None
    owner_key: str | None
    policy: Policy | None

    def _init_treasury(self) -> None:
        self.deposits: dict[str, float] = {}  # peer id -> credits deposited
        self.deposited = 0.0
        self._funds: dict[str, float] = {}  # the spec's grants (public key -> credits)
        self._spec_funded: set[str] = set()
        self._deposit_signatures: set[str] = set()
        self._at = 0.0

    def _peer(self, i: int, p: dict[str, Any], field: str = "peer_id") -> Account:
        raise NotImplementedError

    def _policy(self) -> Policy:
        raise NotImplementedError

    # -- what the coordinator asks while writing entries -------------------------------

    def held(self, peer_id: str) -> float:
        """Credits the key holds and has not bonded: deposited + earned + released -
        bonded (a key never seen holds what was deposited to it)."""
        base = self.deposits.get(peer_id, 0.0)
        acc = self.accounts.get(peer_id)
        if acc is None:
            return base
        return base + acc.balance + acc.released - acc.bonded

    def bond_problem(self, peer_id: str, amount: float) -> str | None:
        """Why a bond of `amount` by this key is refused, or None."""
        if not self._policy().held_stake:
            return None
        held = self.held(peer_id)
        if amount > held + EPSILON:
            return (
                f"stake {amount} is more than key {peer_id[:12]} holds ({held:g} credits: "
                f"deposited by the run's owner or earned, less what is bonded)"
            )
        return None

    def unbonding(self, peer_id: str) -> bool:
        acc = self.accounts.get(peer_id)
        return acc is not None and acc.release_at is not None

    def releases_due(self, now: float) -> list[tuple[str, float]]:
        """(peer id, stake left) of every unbonding whose release time has come."""
        return [
            (a.peer_id, a.stake)
            for a in self.accounts.values()
            if a.release_at is not None and a.release_at <= now
        ]

    # -- entries -------------------------------------------------------------------------

    def _start_treasury(self, spec: dict[str, Any]) -> None:
        self._funds = spec_funds(spec)

    def _deposit(self, i: int, p: dict[str, Any]) -> None:
        problem = deposit_problem(p, self.run_id, self.owner_key, self._funds)
        key = p["public_key"]
        if problem is None and p["source"] == "spec" and key in self._spec_funded:
            problem = f"the spec's funds of key {key[:16]}... were deposited already"
        signature = (p.get("request") or {}).get("signature")
        if problem is None and p["source"] == "owner" and signature in self._deposit_signatures:
            problem = "the owner's signed request was deposited already (a replay)"
        if problem is not None:
            raise LedgerError(i, f"deposit: {problem}")
        if p["source"] == "spec":
            self._spec_funded.add(key)
        else:
            self._deposit_signatures.add(signature)
        self.deposits[p["peer_id"]] = self.deposits.get(p["peer_id"], 0.0) + p["amount"]
        self.deposited += p["amount"]

    def _bond(self, i: int, acc: Account, amount: float) -> None:
        """The treasury's part of a "stake" entry (checked before any change)."""
        if (problem := self.bond_problem(acc.peer_id, amount)) is not None:
            raise LedgerError(i, f"stake: {problem}")
        if acc.release_at is not None:
            raise LedgerError(i, f"stake: peer {acc.peer_id} is unbonding: rebond first")

    def _unbond(self, i: int, p: dict[str, Any]) -> None:
        acc, amount, release_at = self._peer(i, p), p["amount"], p["release_at"]
        if acc.release_at is not None:
            raise LedgerError(i, f"unbond: peer {acc.peer_id} is unbonding already")
        if amount != acc.stake or amount <= 0:
            raise LedgerError(i, f"unbond: {amount} is not peer {acc.peer_id}'s stake {acc.stake}")
        earliest = self._at + self._policy().unbonding_s
        if release_at < earliest:
            raise LedgerError(
                i,
                f"unbond: release_at {release_at} is before the entry's time + unbonding_s "
                f"{self._policy().unbonding_s} ({earliest})",
            )
        acc.release_at = release_at

    def _rebond(self, i: int, p: dict[str, Any]) -> None:
        acc = self._peer(i, p)
        if acc.release_at is None:
            raise LedgerError(i, f"rebond: peer {acc.peer_id} is not unbonding")
        acc.release_at = None

    def _release(self, i: int, p: dict[str, Any]) -> None:
        acc, amount = self._peer(i, p), p["amount"]
        if acc.release_at is None:
            raise LedgerError(i, f"release: peer {acc.peer_id} is not unbonding")
        if self._at < acc.release_at:
            raise LedgerError(
                i,
                f"release: before its time: peer {acc.peer_id}'s stake unbonds at "
                f"{acc.release_at}, the entry is at {self._at}",
            )
        if amount != acc.stake:
            raise LedgerError(
                i, f"release: {amount} is not what is left of peer {acc.peer_id}'s stake "
                f"({acc.stake})"
            )  # fmt: skip
        acc.released += amount
        acc.stake = 0.0
        acc.release_at = None
