"""Withheld evidence on the coordinator: a drawn validator's signed report that the worker's
providers did not deliver the evidence its check needs (outcome "withheld"), and the
penalty once enough drawn validators attest it (the rule and what it rests on:
covey.trust.withholding). A part of covey.coordinator.verification.Verification.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from covey.protocol import schemas

if TYPE_CHECKING:
    from .accounts import Accounts
    from .checks import Checks
    from .peers import Peers

log = logging.getLogger("covey.coordinator")


class WithheldEvidence:
    # provided by Verification
    accounts: Accounts
    checks: Checks
    peers: Peers
    _end_check: Any

    def _withheld_fault(
        self, task: schemas.VerifyTask, req: schemas.VerifyReport
    ) -> tuple[str, str] | None:
        """(field, reason) for a "withheld" report that cannot stand: one that does not
        name the task's worker, or of a contribution with no evidence to withhold (its
        payload and start are on this coordinator: a validator fetches them here)."""
        if req.worker_id != task.peer_id:
            return "worker_id", f"task {task.task_id} checks {task.peer_id[:12]}'s contribution"
        if task.local_state_cid is None and task.end_state_cid is None:
            return "outcome", f"task {task.task_id}'s contribution has no evidence to withhold"
        if not task.providers:
            return "outcome", f"{task.peer_id[:12]} uploaded its evidence to the coordinator"
        return None

    def _report_withheld(
        self, v: Any, req: schemas.VerifyReport, raw: dict[str, Any]
    ) -> dict[str, Any]:
        """A drawn validator's signed attestation that the worker's providers did not
        deliver its evidence (covey.trust.withholding): its check ends unpaid and not
        against it, another validator is drawn, and once withholding is proven the worker
        is slashed, excluded and its pay for the contribution clawed back, as a fraud."""
        now = time.time()
        book = self.accounts.book
        with self.accounts.transaction() as c:
            self._end_check(c, req.task_id, req.validator_id, "withheld")
            self.accounts.append(
                c,
                "verification",
                {
                    "round": req.round,
                    "peer_id": v["peer_id"],
                    "validator_id": req.validator_id,
                    "outcome": "withheld",
                    "distance": None,
                    "exact": False,
                    "attestation": raw,
                },
                now,
            )
            proven = book.withholding_proven(v["round"], v["peer_id"])
            if proven:
                why = (
                    f"drawn for verification; its evidence was not delivered to "
                    f"{len(book._withheld_by[(v['round'], v['peer_id'])])} drawn validator(s)"
                )
                c.execute("UPDATE verifications SET status = 'withheld' WHERE id = ?", (v["id"],))
                c.execute(
                    "UPDATE local_states SET evidence = 'undelivered' WHERE round = ? "
                    "AND peer_id = ? AND evidence = 'pending'",
                    (v["round"], v["peer_id"]),
                )
                self.accounts.append(
                    c,
                    "slash",
                    {
                        "round": v["round"],
                        "peer_id": v["peer_id"],
                        "amount": book.slash_amount(v["peer_id"]),
                        "reason": why,
                        "withheld": True,
                    },
                    now,
                )
                self.peers.ban(c, v["peer_id"])
                c.execute(
                    "UPDATE payouts SET status = 'forfeit' WHERE peer_id = ? AND status = 'due'",
                    (v["peer_id"],),
                )
                self.checks.convict(c, v["round"], v["peer_id"], why, now)
        log.warning(
            "[round %d] %s attests that %s withheld its evidence%s",
            req.round,
            req.validator_id[:8],
            v["peer_id"][:8],
            ": proven, slashed" if proven else "",
        )
        return {"ok": True, "status": "withheld" if proven else v["status"]}
