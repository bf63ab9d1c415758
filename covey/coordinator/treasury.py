"""The run's treasury on the coordinator's host (the rules: covey.trust.treasury): the
owner's deposits (POST /v1/ledger/deposit, `covey ledger deposit`), the spec's grants at
creation, and the bonds, unbondings and releases that membership writes at joins and
leaves. Every mode's joins go through membership; where the run's policy holds stakes
(`held_stake`: every mode's ledger written now) a key bonds only what it holds; a ledger
written before the treasury replays its stakes as declared.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from covey.protocol import schemas
from covey.trust.identity import peer_id_of

from .rejected import Rejected

if TYPE_CHECKING:
    from .accounts import Accounts
    from .halt import Halt

log = logging.getLogger("covey.coordinator")


class Deposits:
    """The owner's deposits: a signed request in, a "deposit" entry out."""

    def __init__(self, accounts: Accounts, halt: Halt) -> None:
        self.accounts = accounts
        self.halt = halt  # who the owner is, and how an owner's request is authenticated

    def deposit(self, req: schemas.DepositRequest, raw: dict[str, Any]) -> dict[str, Any]:
        """Credit `req.to` with `req.amount`. Rejected: another run (409), a key that is not
        the owner's (403), a bad signature or a used nonce (401). The reply is the key's
        held balance and the ledger's signed head (the owner's receipt)."""
        self.halt.authenticate_owner(req.run_id, req.owner_key, raw, "deposit to a key")
        peer_id = peer_id_of(req.to)
        payload = {
            "peer_id": peer_id,
            "public_key": req.to,
            "amount": req.amount,
            "source": "owner",
            "request": raw,
        }
        with self.accounts.transaction() as c:
            self.accounts.append(c, "deposit", payload, time.time())
        log.info("[treasury] %s credits deposited to %s", req.amount, peer_id[:8])
        held = self.accounts.book.held(peer_id)
        return {"ok": True, "peer_id": peer_id, "held": held, "ledger_head": self.accounts.head()}


def bond(
    accounts: Accounts,
    c: sqlite3.Connection,
    peer_id: str,
    stake: float,
    minimum: float,
    now: float,
) -> None:
    """Inside a join's ledger transaction, after its "join" entry if it is the first: bond
    what the key declares, if it holds it. A first join (or one after a release, its
    stake returned) bonds `stake`: Rejected(403) below `minimum` or above what the key
    holds, nothing written. A join during an unbonding cancels it ("rebond"); any other
    join of a known key keeps its bond as it is."""
    book = accounts.book
    account = book.accounts.get(peer_id)
    if account is not None and account.release_at is not None:
        accounts.append(c, "rebond", {"peer_id": peer_id}, now)
        return
    if account is not None and (account.stake > 0 or stake == 0):
        return  # still bonded (what slashes left), or bonding nothing again
    if stake < minimum:
        raise Rejected(403, f"stake {stake} is below this run's minimum stake {minimum}")
    if (problem := book.bond_problem(peer_id, stake)) is not None:
        raise Rejected(
            403,
            f"{problem}: the run's owner deposits credits to a key (covey ledger deposit, "
            f"or the spec's trust.funds), and pay earned can be bonded; declare at most "
            f"{book.held(peer_id):g}",
        )
    accounts.append(c, "stake", {"peer_id": peer_id, "amount": stake}, now)


def unbond(accounts: Accounts, c: sqlite3.Connection, peer_id: str, now: float) -> None:
    """Inside a leave's ledger transaction: the key's stake starts unbonding; it returns
    to its held balance `unbonding_s` from now (a "release"), less what slashes take
    meanwhile. Nothing for a key with no stake or one unbonding already."""
    account = accounts.book.accounts.get(peer_id)
    if account is None or account.stake <= 0 or account.release_at is not None:
        return
    policy = accounts.book.policy
    release_at = now + (policy.unbonding_s if policy is not None else 0.0)
    payload = {"peer_id": peer_id, "amount": account.stake, "release_at": release_at}
    accounts.append(c, "unbond", payload, now)


def release_due(accounts: Accounts, now: float) -> int:
    """Write a "release" for every unbonding whose time has come; how many were written."""
    if not accounts.book.releases_due(now):  # the common case: no transaction at all
        return 0
    with accounts.transaction() as c:
        due = accounts.book.releases_due(now)
        for peer_id, amount in due:
            accounts.append(c, "release", {"peer_id": peer_id, "amount": amount}, now)
    for peer_id, amount in due:
        log.info("[treasury] %s: %s credits released after unbonding", peer_id[:8], amount)
    return len(due)
