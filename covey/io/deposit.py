"""The run owner's side of the treasury: a deposit of credits to a key, signed with the
owner's key for POST /v1/ledger/deposit (covey.trust.treasury). `covey ledger deposit`,
`covey demo` and the local cluster call it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from covey.trust.identity import Identity, request_purpose
from covey.trust.treasury import DEPOSIT_PATH

HTTP_TIMEOUT_S = 30.0


class DepositRefused(RuntimeError):
    """The coordinator refused the deposit (its status and error) or could not be asked."""


def deposit(
    url: str, owner: Identity, to: str, amount: float, run_id: str, timeout_s: float = 30.0
) -> dict[str, Any]:
    """Credit public key `to` with `amount` in run `run_id` served at `url`, as its owner.
    The reply: {"ok", "peer_id", "held" (the key's balance now), "ledger_head"} (keep the
    head: it is the receipt). DepositRefused naming the coordinator's reason otherwise."""
    import httpx

    body = {"run_id": run_id, "owner_key": owner.public_key, "to": to, "amount": amount}
    signed = owner.sign_request(body, purpose=request_purpose(DEPOSIT_PATH))
    try:
        with httpx.Client(base_url=url, timeout=timeout_s, trust_env=False) as client:
            reply = client.post(DEPOSIT_PATH, json=signed)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise DepositRefused(f"cannot reach {url}: {e}") from None
    if reply.status_code != 200:
        try:
            error = reply.json().get("error", reply.text)
        except ValueError:
            error = reply.text
        raise DepositRefused(f"{reply.status_code}: {str(error)[:300]}")
    return dict(reply.json())


def top_up(
    url: str,
    owner: Identity,
    key: Identity,
    stake: float,
    run_id: str,
    balances: Callable[[], dict[str, Any]],
) -> None:
    """As the owner, deposit what `key` lacks of `stake` (what it holds and has bonded
    counted, from `balances()`, the run's GET /v1/ledger/balances), nothing when it has
    it: what a house worker does before each house key joins. DepositRefused as
    `deposit`."""
    account = balances()["accounts"].get(key.peer_id)
    has = 0.0 if account is None else float(account["held"]) + float(account["stake"])
    if stake > has:
        deposit(url, owner, key.public_key, stake - has, run_id)


def fund_key(
    url: str, owner_key: Path, peer_key: Path, amount: float, timeout_s: float = 30.0
) -> Identity:
    """As the owner of the run served at `url` (its key file `owner_key`: the
    coordinator's, where the spec names no other owner), deposit `amount` credits to the
    key in `peer_key` (created when absent), so that a peer started with that key can
    bond them. The peer's identity. What the demos and benches do before they start a
    staked peer; DepositRefused as `deposit`."""
    import httpx

    owner, peer = Identity.load_or_create(owner_key), Identity.load_or_create(peer_key)
    try:
        run_id = httpx.get(f"{url}/v1/run", timeout=timeout_s, trust_env=False).json()["run_id"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise DepositRefused(f"cannot read the run id from {url}: {e}") from None
    if amount > 0:
        deposit(url, owner, peer.public_key, amount, run_id, timeout_s)
    return peer
