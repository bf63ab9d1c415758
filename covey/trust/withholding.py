"""Withholding evidence: a worker drawn for verification that does not deliver what its
check needs (its committed local states) is penalized, on grounds that do not rest on the
coordinator's word alone (docs/trust.md, "Verification off the critical path").

- What it owes is committed before anyone knows it was drawn: the signed contribution names
  the content ids of its local states (`local_state_cid`, `end_state_cid`), and the
  coordinator's draw is its signature over that contribution's cid, made at intake
  (covey.trust.certify.sample). Nobody can change what is owed after the draw.
- Non-delivery is attested by the drawn validators themselves: each signs a report with
  outcome "withheld" naming the worker, once it has tried the worker's providers for
  `evidence_deadline_s` (covey.trust.policy: the request timeout plus the state at the
  worker's paced rate; the coordinator's expiry of the check, `check_timeout_s`, allows
  for it). The signed report goes into the ledger's "verification" entry
  (`attestation`), so `covey ledger verify` checks every signature with the validator's key
  from its join entry.
- The penalty (a "slash" with `withheld: true`: `slash_fraction` of the stake, the ban, the
  claw-back of the contribution's paid work, as a conviction) needs `WITHHOLD_ATTESTATIONS`
  distinct validators' attestations, or every eligible validator's when fewer are eligible,
  no completed check of the contribution and none still held: one validator alone cannot
  frame a worker when a second is eligible. An honest worker whose provider is slow but
  delivers within the deadline is checked normally and loses nothing, and an attestation
  about a round more than `EVIDENCE_KEEP_ROUNDS` behind the last certified one counts for
  nothing (its worker need not keep that evidence any more).

`Withholding` is mixed into covey.trust.incentives.Book.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from covey.trust.identity import IdentityError, request_message, request_purpose, verify
from covey.trust.ledger import LedgerError

if TYPE_CHECKING:
    from covey.trust.policy import Account

# a worker keeps a drawn contribution's evidence for this many rounds (covey.peer.
# worker_publish: its receipt says it was drawn); a check claimed later may find it gone
EVIDENCE_KEEP_ROUNDS = 32
WITHHOLD_ATTESTATIONS = 2  # distinct validators that must attest non-delivery
REPORT_PATH = "/v1/verify/report"


def attestation_fault(
    public_key: str,
    body: Any,
    *,
    run_id: str,
    round_: int,
    worker_id: str,
    validator_id: str,
) -> str | None:
    """Why `body` is not `validator_id`'s signed attestation that `worker_id` withheld the
    evidence of its round-`round_` contribution in run `run_id`; None when it is."""
    if not isinstance(body, dict):
        return "the attestation is not a signed report"
    want = {
        "run_id": run_id,
        "round": round_,
        "validator_id": validator_id,
        "worker_id": worker_id,
        "outcome": "withheld",
    }
    for name, value in want.items():
        if body.get(name) != value:
            return f"the attestation's {name} is {str(body.get(name))[:80]!r}, not {value!r}"
    signature = body.get("signature")
    if not isinstance(signature, str):
        return "the attestation carries no signature"
    try:
        message = request_message(body, round_, request_purpose(REPORT_PATH))
        ok = verify(public_key, message, signature)
    except (IdentityError, ValueError, TypeError) as e:
        return f"the attestation's signature does not check: {e}"
    return None if ok else "the attestation is not signed by the validator's key"


class Withholding:
    """The book's account of withheld evidence (see the module docstring)."""

    # provided by Book
    accounts: dict[str, Account]
    run_id: str | None
    _done: dict[tuple[int, str], int]
    _open: dict[tuple[int, str], set[str]]
    certificates: int  # rounds certified so far: the last is round certificates - 1
    draw: Any
    _convict: Any

    def _init_withholding(self) -> None:
        self._withheld_by: dict[tuple[int, str], set[str]] = {}  # (round, worker) -> attesting

    def _attest_withheld(self, i: int, p: dict[str, Any], validator: Account) -> None:
        """A "verification" with outcome "withheld": its `attestation` must be the
        validator's own signed report; the check is not complete (another is drawn)."""
        fault = attestation_fault(
            validator.public_key,
            p.get("attestation"),
            run_id=self.run_id or "",
            round_=p["round"],
            worker_id=p["peer_id"],
            validator_id=validator.peer_id,
        )
        if fault is not None:
            raise LedgerError(i, f"verification: withheld: {fault}")
        if self.certificates - 1 - p["round"] >= EVIDENCE_KEEP_ROUNDS:
            return  # its worker need not keep that evidence any more: it proves nothing
        self._withheld_by.setdefault((p["round"], p["peer_id"]), set()).add(validator.peer_id)

    def withholding_proven(self, round_: int, peer_id: str) -> bool:
        """Whether the worker's round-`round_` evidence is attested withheld: by
        WITHHOLD_ATTESTATIONS validators, or by every eligible one (at least one), and no
        validator completed a check of it."""
        key = (round_, peer_id)
        attested = len(self._withheld_by.get(key, ()))
        if attested == 0 or self._done.get(key, 0) > 0 or self._open.get(key):
            return False  # a validator still holding its check may yet receive it
        return attested >= WITHHOLD_ATTESTATIONS or not self.draw(round_, peer_id, 1)

    def _slash_withheld(self, i: int, p: dict[str, Any]) -> None:
        """A "slash" with `withheld: true`: allowed only once withholding is proven; it
        counts as a withholding (reputation) and convicts the item (claw-backs)."""
        if not self.withholding_proven(p["round"], p["peer_id"]):
            got = sorted(self._withheld_by.get((p["round"], p["peer_id"]), ()))
            raise LedgerError(
                i,
                f"slash: withheld evidence of {p['peer_id']}'s round-{p['round']} contribution "
                f"is not proven: attested by {len(got)} validator(s), "
                f"{self._done.get((p['round'], p['peer_id']), 0)} completed check(s)",
            )
        self.accounts[p["peer_id"]].withheld += 1
        self._convict(p["round"], p["peer_id"])
