"""Canaries in the serving mode: answers of the run owner's own house workers, bad on
purpose, to requests the owner itself sent (covey.trust.house; docs/trust.md, "Canaries").

A canary is not a task of its own: it is an answer like any other, generated, signed and
submitted by its worker (covey.serve.house.HouseServeWorker) through POST
/v1/serve/answer, drawn for a check by the same signed sampling draw, assigned by the same
public ranking (covey.serve.assign), handed out by the same claim. Two secrets make it
one, and only the coordinator's key holder can tell either:

- its worker is a house key (covey.trust.house.house_identity, derived from the
  coordinator's key);
- its request is a house request: one the server sent itself (`house_traffic`: requests
  the owner supplies, `covey serve server --house-requests`), queued and dispatched like
  a user's, whose id (32 hex digits, like any) hides a tag made with the coordinator's key
  (covey.trust.house.house_request_id).

A house worker answers every request honestly, except a house request whose draw, the
coordinator's signature over (run, request id, house key)
(covey.trust.house.house_canary_draw), falls below the trust table's `canary_rate`. To those it
answers with other tokens than the seeded draw, and a proof honestly made for those tokens
(covey.serve.house.canary_answer): a real, signed answer of the right shape that only a
prefill tells from an honest one. Same worker, same request stream, same sizes, same
timing: nothing a validator reads before it reports tells it from a real check.

Nobody is ever given a canary answer knowingly: a user's request has an id the server
drew at random, which is never a house request's, so a house worker answers it honestly;
only the server's own house requests can get a canary answer, and the server drops every
answer to a house request. A house request answered by another worker is answered
honestly (the owner's compute, spent on its own traffic).

The reveal comes with the answer's verdict, after its validator reported
(covey.serve.service.ServeCoordinator.report): a "house canary" ledger entry with the draw,
the request id it was drawn over, and the coordinator's proof that the key is its own
(`covey ledger verify` checks all three and the rate), which burns the key (banned; the
house worker moves on to its next key). A validator that rejected it, confirmed by the
server's referee, "caught" it (a "dispute" of outcome "fraud", a catch reward). One that
agreed on it is overruled by the referee, which always re-checks an agreement on a canary:
"convicted", and the validator pays a "missed fraud" penalty (validator_slash_fraction of
its stake) and is not paid for the check (covey.coordinator.checks.Checks.convict). A
canary not drawn for a check is accepted like any answer and never revealed: its only
reader was the server, which dropped it.

With canary_rate c, a share h of answers that are house requests answered by house
workers, and the sampling rate r, a validator's share of checks that are canaries is
about c*h (a canary is drawn for a check at the same rate r as any answer). A validator
that agrees without checking loses validator_slash_fraction of its stake at each canary
it is handed: after about 1/(c*h) reports on average.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

from covey.coordinator.accounts import Accounts
from covey.coordinator.db import Database
from covey.trust.house import house_canary_draw, house_peer_ids, house_proof
from covey.trust.identity import Identity

log = logging.getLogger("covey.serve")
CANARY_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS serve_house_canaries (answer_id INTEGER PRIMARY KEY, "
    "worker_id TEXT NOT NULL, job_id TEXT NOT NULL, draw TEXT NOT NULL, "
    "status TEXT NOT NULL)",
)


class ServeCanaries:
    """The server's side: which answers are canaries (noted at intake, secret), and their
    reveal on the ledger. The methods that take `c` run inside the caller's transaction."""

    def __init__(
        self, rate: float, run_id: str, identity: Identity, db: Database, accounts: Accounts
    ) -> None:
        """The run's canary_rate, run id, the server's key (it signs the draws and the
        house proofs), database and ledger."""
        self.rate, self.run_id, self.identity = rate, run_id, identity
        self.db, self.accounts = db, accounts
        self.house = house_peer_ids(identity, run_id) if rate > 0 else frozenset()  # secret

    def note(self, c: sqlite3.Connection, answer: int, worker: str, job_id: str) -> None:
        """At intake: remember `answer` as a canary when it is one (nothing public)."""
        if worker not in self.house:
            return
        draw = house_canary_draw(self.identity, self.run_id, job_id, worker, self.rate)
        if draw is not None:
            c.execute(
                "INSERT OR IGNORE INTO serve_house_canaries VALUES (?, ?, ?, ?, 'planted')",
                (answer, worker, job_id, draw),
            )

    def of_answer(self, c: sqlite3.Connection, answer: int) -> sqlite3.Row | None:
        """The canary record of `answer` while unrevealed, else None."""
        return c.execute(  # type: ignore[no-any-return]
            "SELECT * FROM serve_house_canaries WHERE answer_id = ? AND status = 'planted'",
            (answer,),
        ).fetchone()

    def is_canary(self, answer: int) -> bool:
        """Whether `answer` is an unrevealed canary (read outside a transaction)."""
        return (
            self.db.one(
                "SELECT 1 FROM serve_house_canaries WHERE answer_id = ? AND status = 'planted'",
                (answer,),
            )
            is not None
        )

    def reveal(
        self,
        c: sqlite3.Connection,
        canary: sqlite3.Row,
        validator: str,
        outcome: str,
        detail: str,
        now: float,
    ) -> None:
        """The "house canary" entry: "caught" after the dispute that convicted it,
        "convicted" (a validator agreed on it) before its rejection. It burns the key."""
        answer, worker = canary["answer_id"], canary["worker_id"]
        c.execute(
            "UPDATE serve_house_canaries SET status = ? WHERE answer_id = ?", (outcome, answer)
        )
        self.accounts.append(
            c,
            "house canary",
            {
                "round": answer,
                "peer_id": worker,
                "draw": canary["draw"],
                "request": canary["job_id"],
                "proof": house_proof(self.identity, self.run_id, worker),
                "outcome": outcome,
                "detail": detail[:500],
            },
            now,
        )
        level = logging.INFO if outcome == "caught" else logging.WARNING
        log.log(level, "[serve - answer %d] house canary of %s revealed: %s by %s", answer,
                worker[:8], outcome, validator[:8])  # fmt: skip

    def counts(self) -> dict[str, int]:
        """Revealed canaries by outcome: caught, convicted (a validator passed it)."""
        rows = self.db.query(
            "SELECT status, COUNT(*) AS n FROM serve_house_canaries WHERE status != 'planted' "
            "GROUP BY status"
        )
        return {r["status"]: r["n"] for r in rows}


def house_request_bodies(lines: list[str]) -> list[dict[str, Any]]:
    """The owner's house requests: one JSON object per non-empty line, each the body of an
    OpenAI completion request (POST /v1/completions). ValueError naming the line."""
    import json

    from pydantic import ValidationError

    from covey.serve.wire import CompletionRequest

    bodies = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
            CompletionRequest.model_validate(body).text()
        except (ValueError, ValidationError) as e:
            raise ValueError(f"house request on line {n}: {str(e)[:200]}") from None
        bodies.append(body)
    if not bodies:
        raise ValueError("no house requests: one JSON completion request per line")
    return bodies
