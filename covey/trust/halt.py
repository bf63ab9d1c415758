"""HALT: the run owner stops a run.

The owner (the key in the spec's `owner_key`, else the coordinator's key) signs a request
to POST /v1/halt (`covey halt`). The coordinator writes it, signature and all, into the
ledger as a "halt" entry, opens no round after it and aborts the one that is open; workers
learn of it from their next heartbeat or /v1/round and exit (their participation lease,
renewed by heartbeats, stops them even when they cannot hear). Anyone replaying the ledger
checks that the HALT was signed by the owner named in the run's spec, that there is at
most one, and that no round was certified and no contribution accepted after it.
"""

from __future__ import annotations

from typing import Any

from covey.trust.identity import NO_ROUND, request_message, request_purpose, verify

HALT_PATH = "/v1/halt"
HALT_PURPOSE = request_purpose(HALT_PATH)
# what a halted run must not record: the rounds stopped at the HALT
AFTER_HALT_FORBIDDEN = ("round certificate", "contribution accepted")
EXIT_HALTED = 3  # a worker's exit status when the run was halted by its owner


def owner_of(spec: dict[str, Any], coordinator_key: str) -> str:
    """The key that may halt the run: the spec's owner_key, else the coordinator's."""
    owner = spec.get("owner_key")
    return owner if isinstance(owner, str) and owner else coordinator_key


def halt_problem(payload: dict[str, Any], run_id: str | None, owner_key: str | None) -> str | None:
    """What is wrong with a "halt" ledger payload ({round, owner_key, reason, request}), or
    None: the request must be this run's HALT, signed for POST /v1/halt by `owner_key`,
    and say what the payload says."""
    request = payload.get("request")
    if not owner_key:
        return "the run names no owner"
    if not isinstance(request, dict):
        return "no signed request"
    if payload.get("owner_key") != owner_key or request.get("owner_key") != owner_key:
        return f"signed by {str(payload.get('owner_key'))[:16]}..., not the owner {owner_key}"
    if request.get("run_id") != run_id:
        return f"the request is for run {request.get('run_id')!r}, not {run_id!r}"
    if request.get("reason", "halted by the run owner") != payload.get("reason"):
        return "the reason differs from the signed request's"
    signature = request.get("signature")
    message = request_message(request, NO_ROUND, HALT_PURPOSE)
    if not isinstance(signature, str) or not verify(owner_key, message, signature):
        return "the owner's signature does not verify"
    return None
