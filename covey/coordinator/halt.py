"""HALT on the coordinator's side (covey.trust.halt): the run owner's signed request to
stop the run, written to the ledger by the round driver, so that no round can commit
between the HALT and its effect: the driver writes the entry and aborts the open round in
one step, and no round opens after it. A halted run keeps serving every GET (status,
ledger, checkpoints, blobs), so its last certified model stays exportable; joins and
heartbeats are answered 410 with the owner's reason, which is how workers learn of it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from covey.protocol import schemas
from covey.trust.halt import owner_of
from covey.trust.identity import NO_ROUND, peer_id_of

from .rejected import Rejected

if TYPE_CHECKING:
    from covey.config import RunConfig
    from covey.trust.identity import Identity

    from .accounts import Accounts
    from .db import Database

log = logging.getLogger("covey.coordinator")
HALT_WAIT_S = 20.0  # how long a HALT request waits for the round driver to write it


@dataclass
class _PendingHalt:
    payload: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class Halting:
    # provided by the rounds mode (covey.coordinator.rounds)
    cfg: RunConfig
    db: Database
    accounts: Accounts
    identity: Identity
    run_id: str
    state: Any
    _wake: threading.Event
    _check_run: Any
    authenticate: Any
    open_round: Any
    _abort: Any
    commits: Any  # covey.coordinator.views.CommitSignal

    def __init__(self) -> None:
        self._halt_lock = threading.Lock()
        self._pending_halt: _PendingHalt | None = None

    @property
    def halted(self) -> dict[str, Any] | None:
        """The ledger's HALT ({index, round, reason}), or None while the run goes on."""
        return self.accounts.book.halted

    @property
    def owner_key(self) -> str:
        return owner_of(self.cfg.model_dump(), self.identity.public_key)

    def check_not_halted(self) -> None:
        """Rejected(410) naming the owner's reason once the run is halted."""
        if (h := self.halted) is not None:
            raise Rejected(
                410,
                f"run {self.run_id} was halted by its owner at round {h['round']}: {h['reason']}",
            )

    def halt(self, req: schemas.HaltRequest, raw: dict[str, Any]) -> dict[str, Any]:
        """Stop the run (idempotent: a halted run answers with its HALT). Rejected: another
        run (409), a key that is not the owner's (403), a bad signature or nonce (401);
        503 when the round driver did not write it within HALT_WAIT_S (it still will)."""
        self._check_run(req.run_id)
        owner = self.owner_key
        if req.owner_key != owner:
            raise Rejected(
                403,
                f"key {req.owner_key[:16]}... is not the owner key of run {self.run_id} "
                f"({owner[:16]}...): only the run owner may halt it",
            )
        self.authenticate(raw, NO_ROUND, peer_id_of(owner), owner)
        if self.halted is not None:
            return {"ok": True, "halted": self.halted}
        pending = _PendingHalt({"owner_key": owner, "reason": req.reason, "request": raw})
        with self._halt_lock:
            if self._pending_halt is None:
                self._pending_halt = pending
            pending = self._pending_halt
        self._wake.set()
        if not pending.done.wait(HALT_WAIT_S):
            raise Rejected(503, "the HALT is accepted but not written yet; ask again")
        if pending.error is not None:
            raise Rejected(500, f"the HALT could not be written: {pending.error}")
        return {"ok": True, "halted": self.halted}

    def enforce_halt(self, now: float) -> None:
        """The round driver's part (first in every tick): write a pending HALT, then abort
        whatever round is open in a halted run (also one left open by a crash)."""
        with self._halt_lock:
            pending, self._pending_halt = self._pending_halt, None
        if pending is not None:
            try:
                payload = {"round": self.state.round, **pending.payload}
                with self.accounts.transaction() as c:
                    if self.halted is None:
                        self.accounts.append(c, "halt", payload, now)
                        self.db.event(c, now, "halt", "", {"reason": payload["reason"]})
                log.warning(
                    "run %s HALTED by its owner at round %d: %s",
                    self.run_id,
                    payload["round"],
                    payload["reason"],
                )
                self.commits.notify()  # round long-polls learn of the HALT at once
            except Exception as e:
                pending.error = f"{type(e).__name__}: {e}"
                raise
            finally:
                pending.done.set()
        if self.halted is not None and (current := self.open_round()) is not None:
            self._abort(current, "the run was halted by its owner")
