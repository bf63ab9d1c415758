"""Funding a key in a coordinator built in the test's own process (any mode: its `host`):
the run's owner (the coordinator's key, when the spec names no other) signs a deposit
request, and the host's treasury takes it as POST /v1/ledger/deposit would
(covey.coordinator.treasury). Over HTTP, `LocalCluster.fund` does the same."""

from __future__ import annotations

from typing import Any

from covey.coordinator.auth import _RECEIVED_AT
from covey.coordinator.treasury import Deposits
from covey.protocol import schemas
from covey.trust.identity import Identity, request_purpose
from covey.trust.treasury import DEPOSIT_PATH


def fund(service: Any, public_key: str, amount: float, owner: Identity | None = None) -> None:
    """Deposit `amount` credits to `public_key` in `service`'s run (a rounds Coordinator,
    an RL trainer, a SWARM or serving coordinator: anything with a `host`)."""
    if amount <= 0:
        return
    host = service.host
    owner = owner or host.identity
    body = {"run_id": host.run_id, "owner_key": owner.public_key, "to": public_key,
            "amount": float(amount)}  # fmt: skip
    purpose = request_purpose(DEPOSIT_PATH)
    raw = owner.sign_request(body, purpose=purpose)
    token = _RECEIVED_AT.set(purpose)
    try:
        Deposits(host.accounts, host.halt).deposit(schemas.DepositRequest.model_validate(raw), raw)
    finally:
        _RECEIVED_AT.reset(token)
