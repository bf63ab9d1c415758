"""`covey ledger verify` for RL runs: the treasury terms (covey.trust.treasury) the run's
spec gives, which its ledger's "run created" policy must name. Light to import (the
command line registers it before torch is loaded): the spec is read inside the call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from covey.trust.ledger import LedgerError
from covey.trust.policy import Policy
from covey.trust.treasury import check_spec_hash, mode_table


def ledger_terms(entries: Sequence[Any]) -> Policy | None:
    """The policy an RL run's spec gives (covey.rl.runspec.ledger_policy), None for a
    ledger of another mode. The spec must hash to the run id with the model, the first
    policy (round 0's "checkpoint") and the trainer's key, as a worker checks it:
    LedgerError when it does not, so a coordinator cannot write other terms or other
    funds than the spec peers were shown."""
    found = mode_table(entries, "rl")
    if found is None:
        return None
    created, table = found
    from pydantic import ValidationError

    from covey.rl.runspec import RLSpec, ledger_policy, run_id_of

    try:
        rl = RLSpec.model_validate(table)
    except ValidationError as e:
        raise LedgerError(0, f"run created: not an RL spec ({str(e)[:200]})") from None
    first = next(
        (e for e in entries if e.type == "checkpoint" and e.payload.get("round") == 0), None
    )
    if first is None:
        raise LedgerError(0, "run created: an RL ledger without its first policy's checkpoint")
    model, key = created["spec"].get("model"), str(created.get("coordinator_key"))
    check_spec_hash(created, run_id_of(rl, model, str(first.payload.get("cid")), key))
    return ledger_policy(rl)
