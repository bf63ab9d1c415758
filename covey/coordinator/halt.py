"""HALT, a part of the coordinator's host that every mode uses (covey.trust.halt): the run
owner's signed request to stop the run, written to the mode's ledger as a "halt" entry by
the mode's own driver thread, so that nothing the mode certifies can slip in between the
HALT and its effect. The rounds driver writes it and aborts the open round in one step;
the RL trainer's loop writes it and takes no step after it; the SWARM driver writes it and
pays nothing after it. A halted run keeps serving every GET (status, ledger, blobs), so its
last model stays exportable; joins and heartbeats are answered 410 with the owner's
reason, which is how workers, validators, servers and trainers learn of it.

`Halt` gets what it uses in its constructor: the accounts (ledger and book), the run id,
the owner's key, membership's `check_run` and `authenticate`, the event that wakes the
mode's driver, where the run stands (`position`: the round, policy version or epoch the
entry records) and the mode's own effect of a halt (`effect`, called by the driver on each
pass while the run is halted). The HTTP route is covey.coordinator.host_app's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from covey.protocol import schemas
from covey.trust.identity import NO_ROUND, peer_id_of

from .rejected import Rejected

if TYPE_CHECKING:
    from .accounts import Accounts

log = logging.getLogger("covey.coordinator")
HALT_WAIT_S = 20.0  # how long a HALT request waits for the mode's driver to write it


@dataclass
class _PendingHalt:
    payload: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


def _nothing() -> None:
    return None


class Halt:
    """The owner's HALT of one run: taken by `request` (any thread), written by `enforce`
    (the mode's driver), refused joins and heartbeats by `check_not_halted`."""

    def __init__(
        self,
        accounts: Accounts,
        *,
        run_id: str,
        owner_key: str,
        check_run: Callable[[str], None],
        authenticate: Callable[[dict[str, Any], int, str, str], None],
        wake: threading.Event,
        position: Callable[[], int],
        effect: Callable[[], None] = _nothing,
        written: Callable[[], None] = _nothing,
    ) -> None:
        """`authenticate(raw, round, peer_id, public_key)` raises Rejected(401) for a bad
        signature or a used nonce; `wake` is set to have the driver call `enforce` now;
        `position()` is the round (policy version, epoch) written in the entry; `effect()`
        is the mode's own part of a halt, called by `enforce` while the run is halted;
        `written()` is called once, right after the entry is written."""
        self.accounts = accounts
        self.run_id = run_id
        self.owner_key = owner_key
        self._check_run = check_run
        self._authenticate = authenticate
        self._wake = wake
        self._position = position
        self._effect = effect
        self._written = written
        self._lock = threading.Lock()
        self._pending: _PendingHalt | None = None

    @property
    def halted(self) -> dict[str, Any] | None:
        """The ledger's HALT ({index, round, reason}), or None while the run goes on."""
        return self.accounts.book.halted

    def check_not_halted(self) -> None:
        """Rejected(410) naming the owner's reason once the run is halted."""
        if (h := self.halted) is not None:
            raise Rejected(
                410,
                f"run {self.run_id} was halted by its owner at round {h['round']}: {h['reason']}",
            )

    def authenticate_owner(self, run_id: str, key: str, raw: dict[str, Any], what: str) -> None:
        """Rejected unless `raw` is this run's request (409), signed by the owner (403 for
        another key) for the endpoint it was sent to with a fresh nonce (401). The HALT and
        the treasury's deposits (covey.coordinator.treasury) are the owner's requests."""
        self._check_run(run_id)
        owner = self.owner_key
        if key != owner:
            raise Rejected(
                403,
                f"key {key[:16]}... is not the owner key of run {self.run_id} "
                f"({owner[:16]}...): only the run owner may {what}",
            )
        self._authenticate(raw, NO_ROUND, peer_id_of(owner), owner)

    def request(self, req: schemas.HaltRequest, raw: dict[str, Any]) -> dict[str, Any]:
        """Stop the run (idempotent: a halted run answers with its HALT). Rejected: another
        run (409), a key that is not the owner's (403), a bad signature or nonce (401);
        503 when the driver did not write it within HALT_WAIT_S (it still will)."""
        self.authenticate_owner(req.run_id, req.owner_key, raw, "halt it")
        owner = self.owner_key
        if self.halted is not None:  # the receipt: with the ledger's signed head
            return {"ok": True, "halted": self.halted, "ledger_head": self.accounts.head()}
        pending = _PendingHalt({"owner_key": owner, "reason": req.reason, "request": raw})
        with self._lock:
            if self._pending is None:
                self._pending = pending
            pending = self._pending
        self._wake.set()
        if not pending.done.wait(HALT_WAIT_S):
            raise Rejected(503, "the HALT is accepted but not written yet; ask again")
        if pending.error is not None:
            raise Rejected(500, f"the HALT could not be written: {pending.error}")
        return {"ok": True, "halted": self.halted, "ledger_head": self.accounts.head()}

    def enforce(self, now: float) -> None:
        """The driver's part (first in every pass): write a pending HALT, then apply the
        mode's effect while the run is halted (also after a restart)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            try:
                payload = {"round": self._position(), **pending.payload}
                with self.accounts.transaction() as c:
                    if self.halted is None:
                        self.accounts.append(c, "halt", payload, now)
                        self.accounts.db.event(c, now, "halt", "", {"reason": payload["reason"]})
                log.warning(
                    "run %s HALTED by its owner at round %d: %s",
                    self.run_id,
                    payload["round"],
                    payload["reason"],
                )
                self._written()
            except Exception as e:
                pending.error = f"{type(e).__name__}: {e}"
                raise
            finally:
                pending.done.set()
        if self.halted is not None:
            self._effect()
