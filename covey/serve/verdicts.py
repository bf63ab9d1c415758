"""The ledger entries of a validator's report on a served answer (covey.serve.service
lists them), written inside the report's transaction. A house canary
(covey.serve.canaries) is decided like any answer, except that an agreement on it is
re-checked by the server's referee, and it is revealed here: after its validator reported.

- agreed, and the referee clears it (every agreement on a real answer): verification
  (agree) -> contribution accepted -> reward (work) -> reward (check);
- agreed on a canary the referee convicts: verification (agree) -> house canary
  (convicted) -> contribution rejected -> penalty (missed fraud), no check pay;
- rejected, and the referee convicts: verification (disagree) -> contribution rejected ->
  dispute (fraud) -> slash -> reward (catch) [-> house canary (caught)];
- rejected, and the referee cannot reproduce it: verification (disagree) -> dispute
  (validator wrong) -> penalty -> the answer accepted as above.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Protocol

from covey.coordinator.accounts import Accounts
from covey.coordinator.checks import Checks
from covey.serve.canaries import ServeCanaries
from covey.serve.checks import AnswerVerdict
from covey.serve.config import ServeConfig


class Server(Protocol):
    """What of covey.serve.service.ServeCoordinator the entries need."""

    cfg: ServeConfig
    accounts: Accounts
    checks: Checks
    canaries: ServeCanaries

    def accept(
        self, c: Any, answer: int, worker: str, cid: str, tokens: int, rate: float, draw: str,
        now: float,
    ) -> None: ...  # fmt: skip


def write_verdict(
    s: Server,
    c: sqlite3.Connection,
    row: sqlite3.Row,
    validator: str,
    ok: bool,
    verdict: AnswerVerdict | None,
    canary: sqlite3.Row | None,
    claimed: tuple[str | None, str],
    now: float,
) -> tuple[str, str, str | None, str]:
    """The entries for `validator`'s report `ok` on answer `row`, given the referee's
    `verdict` (None: not re-checked) and the answer's unrevealed canary record (None: a
    real answer); `claimed`: the validator's (problem, detail). Returns (outcome for the
    validator, the answer's new status, problem, detail)."""
    answer, worker, tokens = row["id"], row["worker_id"], json.loads(row["tokens"])
    banned = s.accounts.book.accounts[worker].banned

    def entry(type: str, peer: str, **fields: Any) -> None:
        s.accounts.append(c, type, {"round": answer, "peer_id": peer, **fields}, now)

    outcome = "agree" if ok else "disagree"
    entry("verification", worker, validator_id=validator, outcome=outcome, distance=None,
          exact=True)  # fmt: skip
    if verdict is not None and not verdict.ok:
        reason = f"{verdict.problem}: {verdict.detail}"[:300]
        reveal = canary is not None and not banned
        if ok:  # an agreement on a canary, overruled by the referee: the reveal convicts it
            if reveal:
                s.canaries.reveal(c, canary, validator, "convicted", reason, now)
            entry("contribution rejected", worker, reason=reason)
        else:
            entry("contribution rejected", worker, reason=reason)
            entry("dispute", worker, validator_id=validator, segment=0, outcome="fraud",
                  detail=reason)  # fmt: skip
            if not banned:
                entry("slash", worker, reason=reason, amount=s.accounts.book.slash_amount(worker))
            if s.cfg.trust.catch_reward > 0:
                entry("reward", validator, kind="catch", tokens=0, amount=s.cfg.trust.catch_reward)
            if reveal:  # after the dispute that convicted it
                s.canaries.reveal(c, canary, validator, "caught", reason, now)
        # whoever agreed on it missed a fraud; pay for it, if any, is clawed back
        s.checks.convict(c, answer, worker, f"the server's check rejects it ({reason})", now)
        said = "canary " if canary is not None else ""
        return said + ("passed" if ok else "caught"), "rejected", verdict.problem, verdict.detail
    problem, detail = claimed
    if not ok:
        entry("dispute", worker, validator_id=validator, segment=0, outcome="validator wrong",
              detail=detail[:300])  # fmt: skip
        entry(
            "penalty",
            validator,
            kind="false accusation",
            amount=s.accounts.book.penalty_amount(validator),
            reason=f"rejected answer {answer}; the server's check accepts it",
        )
    if not banned:
        s.accept(c, answer, worker, row["cid"], len(tokens), row["rate"], row["draw"], now)
    if ok:
        s.checks.pay_check(c, answer, worker, validator, s.cfg.trust.check_reward, now)
    return ("accepted" if ok else "false accusation"), "accepted", problem, detail
