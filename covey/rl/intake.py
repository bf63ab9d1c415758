"""The RL mode's intake and verification: submitted rollout batches, validator assignment,
reports, and the verdicts written to the ledger.

- A submission is signed by the worker over the whole batch for the step it names (the
  request signature's round), so the batch is bound to worker, step and policy version.
  A batch naming another worker, signed by this one, is a replay: refused (403) and
  slashed. Wrong run, a step outside [version - async_level, version], a policy that is
  not that step's, a second batch for a step: refused (409), nothing changes.
- Every batch is checked. It is assigned to one live validator, ranked by
  sha256(the trainer's signature over (run, batch cid), validator id) (not first come, and
  not steerable: a worker that grinds its batch's bytes cannot predict the signature, so
  cannot aim its batch at a colluding validator; the signature is in the task, so the
  rank is auditable); the sequences it prefills are drawn
  from the trainer's signature over (run, batch cid, validator), which the worker cannot
  know when it generates. A check not reported within verify_timeout_s is recorded as
  missed and reassigned; with no eligible validator the trainer checks it itself.
- A verdict rests on recomputation: a rejection is re-checked by the trainer before the
  worker is slashed (the validator wins a catch), and a rejection the trainer cannot
  reproduce costs the validator a penalty (false accusation) while the batch is accepted.
  `audit_rate` of accepted batches are re-checked in full; a bad one is rejected, its
  worker slashed and the validator penalized (a "penalty" of kind "missed fraud": it
  passed a batch the audit proved bad). Workers are paid per token of accepted batches
  only.
- Per policy version (step), one validator claims at most `validator_round_cap` batches;
  the next-ranked validator (or, past the deadline, the trainer) checks the rest. Canaries
  (covey.rl.canaries) are batches of the run owner's house workers, submitted, assigned and
  claimed here like any other: nothing in this module treats them apart.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from covey.coordinator.rejected import Rejected
from covey.protocol.schemas import PeerId, RunId, Signed
from covey.rl.batch import Problem, RolloutBatch, draw_samples
from covey.rl.canaries import CANARY_SCHEMA
from covey.rl.costs import COSTS_SCHEMA, MAX_REPORTED_S, record, record_batch
from covey.rl.runspec import NotJudged
from covey.rl.verdicts import Judge
from covey.trust.draws import draw_validators
from covey.trust.identity import NO_ROUND

if TYPE_CHECKING:
    from covey.rl.trainer_parts import TrainerParts

log = logging.getLogger("covey.rl.intake")
RL_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS rl_versions (version INTEGER PRIMARY KEY, cid TEXT NOT NULL, "
    "at REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS rl_batches (id INTEGER PRIMARY KEY AUTOINCREMENT, "
    "step INTEGER NOT NULL, worker_id TEXT NOT NULL, cid TEXT NOT NULL, samples INTEGER, "
    "tokens INTEGER, status TEXT NOT NULL, validator_id TEXT, tried TEXT NOT NULL DEFAULT "
    "'[]', claimed_at REAL, draw TEXT, problem TEXT, detail TEXT, submitted_at REAL, "
    "nonce TEXT, signature TEXT, consumed_by INTEGER, UNIQUE (step, worker_id))",
    *CANARY_SCHEMA,
    *COSTS_SCHEMA,
)


class SubmitBatch(Signed):
    """POST /v1/rl/batch, signed for round = batch.step. Rewards and logprobs must be
    finite: a NaN or Infinity (which JSON parsers here accept) would be stored as null and
    make the batch unreadable to every checker, so it is a 422 naming the sample."""

    run_id: RunId
    peer_id: PeerId
    batch: RolloutBatch
    # what the batch cost its worker (covey.rl.costs; reported, never a verdict's input):
    # generating it, and the wall seconds since its previous submission (or its join)
    compute_s: float | None = Field(None, ge=0, le=MAX_REPORTED_S, allow_inf_nan=False)
    wall_s: float | None = Field(None, ge=0, le=MAX_REPORTED_S, allow_inf_nan=False)

    @model_validator(mode="after")
    def _finite(self) -> SubmitBatch:
        for i, s in enumerate(self.batch.samples):
            if not math.isfinite(s.reward):
                raise ValueError(f"batch.samples[{i}].reward is {s.reward}: not finite")
            bad = next((j for j, x in enumerate(s.logprobs) if not math.isfinite(x)), None)
            if bad is not None:
                raise ValueError(
                    f"batch.samples[{i}].logprobs[{bad}] is {s.logprobs[bad]}: not finite"
                )
        return self


class ClaimCheck(Signed):
    """POST /v1/rl/claim: a validator asks for its next assigned batch."""

    run_id: RunId
    peer_id: PeerId


PROBLEMS = tuple(p.value for p in Problem)
# no control characters (C0, DEL, C1) nor bidi overrides: a report's words reach the
# ledger, which `covey ledger show` prints to terminals
PLAIN_TEXT = r"^[^\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]*$"


class ReportCheck(Signed):
    """POST /v1/rl/report: a validator's verdict on the batch it was assigned. `problem`
    is one of covey.rl.batch.Problem's values; `detail` is plain text."""

    run_id: RunId
    peer_id: PeerId
    batch_cid: str = Field(pattern=r"^[0-9a-f]{64}$")
    ok: bool
    problem: str | None = Field(None, max_length=64)
    detail: str = Field("", max_length=500, pattern=PLAIN_TEXT)
    sample: int | None = Field(None, ge=0)
    # what the check cost the validator (covey.rl.costs): its compute, and fetching the
    # batch and its policy
    compute_s: float | None = Field(None, ge=0, le=MAX_REPORTED_S, allow_inf_nan=False)
    fetch_s: float | None = Field(None, ge=0, le=MAX_REPORTED_S, allow_inf_nan=False)

    @model_validator(mode="after")
    def _known_problem(self) -> ReportCheck:
        if self.problem is not None and self.problem not in PROBLEMS:
            raise ValueError(f"problem {self.problem[:64]!r} is not one of {list(PROBLEMS)}")
        return self


def _h(*parts: object) -> str:
    return hashlib.sha256("|".join(str(p) for p in parts).encode()).hexdigest()


def assign_rank(assign_draw: str, validator_id: str) -> str:
    """A validator's place in a batch's ranking (lowest checks it): public once the
    trainer's `assign_draw` is, unpredictable before."""
    return _h("covey-rl-assign/v1", assign_draw, validator_id)


class Intake:
    def __init__(self, trainer: TrainerParts) -> None:
        self.t = trainer
        self.judge = Judge(trainer)
        self.canaries = self.judge.canaries
        self._assign_draws: dict[str, str] = {}

    # -- submissions ----------------------------------------------------------------------

    def submit(self, req: SubmitBatch, raw: dict[str, Any]) -> dict[str, Any]:
        t, m, b = self.t, self.t.membership, req.batch
        m.check_run(req.run_id)
        m.check_not_halted()  # 410 with the owner's reason: the worker stops
        self._role(req.peer_id, "worker")
        m.authenticate(raw, b.step, req.peer_id)
        m.check_not_banned(req.peer_id)
        if b.worker_id != req.peer_id:
            self._slash_replay(
                req,
                f"batch.worker_id is {b.worker_id[:12]}, signed by "
                f"{req.peer_id[:12]}: a replay of another worker's batch",
            )
            raise Rejected(
                403,
                f"batch.worker_id {b.worker_id[:12]} is not the signer "
                f"{req.peer_id[:12]}: replay refused and slashed",
            )
        if b.run_id != t.run_id:
            raise Rejected(409, f"batch.run_id {b.run_id} is not this run {t.run_id}")
        with t.lock:
            v, oldest = t.version, t.version - t.spec.async_level
            cid_of_step = t.cids.get(b.step)
        if not oldest <= b.step <= v:
            raise Rejected(
                409,
                f"batch.step {b.step} is outside [{oldest}, {v}] (policy "
                f"v{v}, async_level {t.spec.async_level}): fetch the policy",
            )
        if b.policy_version != b.step or b.policy_cid != cid_of_step:
            raise Rejected(
                409,
                f"batch.policy_version/policy_cid ({b.policy_version}, "
                f"{b.policy_cid[:12]}) are not step {b.step}'s policy "
                f"({b.step}, {str(cid_of_step)[:12]})",
            )
        data = b.model_dump_json().encode()
        tokens = sum(len(s.tokens) for s in b.samples)
        cid = t.blobs.put(data)
        try:
            with t.db.transaction() as c:
                c.execute(
                    "INSERT INTO rl_batches (step, worker_id, cid, samples, tokens, status, "
                    "submitted_at, nonce, signature) VALUES (?, ?, ?, ?, ?, 'pending', ?, ?, ?)",
                    (
                        b.step,
                        req.peer_id,
                        cid,
                        len(b.samples),
                        tokens,
                        time.time(),
                        req.nonce,
                        req.signature,
                    ),
                )
                record_batch(c, cid, req.compute_s, req.wall_s)
        except sqlite3.IntegrityError:
            raise Rejected(
                409, f"worker {req.peer_id[:12]} already submitted a batch for step {b.step}"
            ) from None
        log.info(
            "[%s - step %d] batch %s: %d samples, %d tokens",
            req.peer_id[:8],
            b.step,
            cid[:12],
            len(b.samples),
            tokens,
        )
        # the receipt: with the ledger's signed head, which the worker keeps (covey.peer.heads)
        return {"ok": True, "cid": cid, "tokens": tokens, "ledger_head": t.accounts.head()}

    def _role(self, peer_id: str, role: str) -> None:
        known = self.t.membership.peers.role(peer_id)
        if known is None:
            raise Rejected(404, f"unknown peer {peer_id}: join first")
        if known != role:
            raise Rejected(403, f"peer {peer_id[:12]} is a {known}, not a {role}")

    def _slash_replay(self, req: SubmitBatch, reason: str) -> None:
        t, now, step = self.t, time.time(), req.batch.step
        with t.accounts.transaction() as c:
            c.execute(
                "INSERT OR IGNORE INTO rl_batches (step, worker_id, cid, samples, tokens, "
                "status, problem, detail, submitted_at) VALUES (?, ?, '', ?, 0, "
                "'rejected', 'replay', ?, ?)",
                (step, req.peer_id, len(req.batch.samples), reason, now),
            )
            self.judge.reject_entries(c, step, req.peer_id, None, reason, 0, now)

    # -- validators -----------------------------------------------------------------------

    def claim(self, req: ClaimCheck, raw: dict[str, Any]) -> dict[str, Any]:
        t, m = self.t, self.t.membership
        m.check_run(req.run_id)
        m.check_not_halted()  # 410: a halted run takes no check nor verdict
        self._role(req.peer_id, "validator")
        m.authenticate(raw, NO_ROUND, req.peer_id)
        m.check_not_banned(req.peer_id)
        live = set(self._live_validators())
        with t.db.transaction() as c:
            mine = c.execute(
                "SELECT * FROM rl_batches WHERE status = 'claimed' AND "
                "validator_id = ? ORDER BY id LIMIT 1",
                (req.peer_id,),
            ).fetchone()
            if mine is None:
                load = self._load(c)
                for row in c.execute(
                    "SELECT * FROM rl_batches WHERE status = 'pending' ORDER BY id"
                ).fetchall():
                    if self._assignee(row, live | {req.peer_id}, load) == req.peer_id:
                        mine = row
                        break
            if mine is None:
                return {"task": None}
            draw = t.identity.sign(
                f"covey-rl-draw/v1\n{t.run_id}\n{mine['cid']}\n{req.peer_id}".encode()
            )
            tried = sorted(set(json.loads(mine["tried"])) | {req.peer_id})
            c.execute(
                "UPDATE rl_batches SET status = 'claimed', validator_id = ?, claimed_at = "
                "?, draw = ?, tried = ? WHERE id = ?",
                (req.peer_id, time.time(), draw, json.dumps(tried), mine["id"]),
            )
        return {
            "task": {
                "batch_cid": mine["cid"],
                "step": mine["step"],
                "worker_id": mine["worker_id"],
                "policy_version": mine["step"],
                "policy_cid": t.cids[mine["step"]],
                "draw": draw,
                "assign_draw": self.assign_draw(mine["cid"]),
                "verify_samples": draw_samples(
                    mine["cid"], draw, mine["samples"], t.spec.verify_samples
                ),
            }
        }

    def _live_validators(self) -> list[str]:
        t = self.t
        now, live = time.time(), t.membership.liveness
        rows = t.membership.peers.live("validator")
        book = t.accounts.book.accounts
        return [
            r["peer_id"]
            for r in rows
            if live.last_seen(r["peer_id"], r["last_seen"]) > now - t.spec.dead_after_s
            and not (r["peer_id"] in book and book[r["peer_id"]].banned)
        ]

    def _load(self, c: sqlite3.Connection) -> dict[tuple[int, str], int]:
        """Batches each validator has claimed per step still checkable."""
        oldest = self.t.version - self.t.spec.async_level
        load: dict[tuple[int, str], int] = {}
        for row in c.execute("SELECT step, tried FROM rl_batches WHERE step >= ?", (oldest,)):
            for v in json.loads(row["tried"]):
                load[(row["step"], v)] = load.get((row["step"], v), 0) + 1
        return load

    def _assignee(
        self, row: sqlite3.Row, live: set[str], load: dict[tuple[int, str], int]
    ) -> str | None:
        """The live validator ranked first by `assign_rank` among those that did not try
        this batch, are not its worker and are under validator_round_cap claims at its
        step (covey.trust.draws.draw_validators); None when none is."""
        beacon, step = self.assign_draw(row["cid"]), row["step"]
        drawn = draw_validators(  # the rule rounds' Book.draw uses, with RL's beacon
            sorted(live),
            lambda v: assign_rank(beacon, v),
            1,
            worker=row["worker_id"],
            tried=set(json.loads(row["tried"])),
            load={v: load.get((step, v), 0) for v in live},
            cap=self.t.spec.validator_round_cap,
        )
        return drawn[0] if drawn else None

    def assign_draw(self, cid: str) -> str:
        """The trainer's signature over (run, batch cid): the beacon of the batch's
        validator ranking, unknown to the worker when it builds the batch."""
        if (draw := self._assign_draws.get(cid)) is None:
            message = f"covey-rl-assign/v1\n{self.t.run_id}\n{cid}".encode()
            draw = self._assign_draws[cid] = self.t.identity.sign(message)
            if len(self._assign_draws) > 4096:  # bounded: drop the oldest
                self._assign_draws.pop(next(iter(self._assign_draws)))
        return draw

    def expire(self, now: float) -> None:
        """Checks held past verify_timeout_s go back (a missed check in the ledger); a
        batch no live validator may take for verify_timeout_s is checked by the trainer."""
        t = self.t
        timeout = t.spec.verify_timeout_s
        for row in t.db.query(
            "SELECT * FROM rl_batches WHERE status = 'claimed' AND claimed_at < ?", (now - timeout,)
        ):
            with t.accounts.transaction() as c:
                c.execute(
                    "UPDATE rl_batches SET status = 'pending', validator_id = NULL WHERE id = ?",
                    (row["id"],),
                )
                t.accounts.append(
                    c,
                    "verification",
                    {
                        "round": row["step"],
                        "peer_id": row["worker_id"],
                        "validator_id": row["validator_id"],
                        "outcome": "expired",
                        "distance": None,
                        "exact": False,
                        "cid": row["cid"],
                    },
                    now,
                )
            log.warning(
                "[%s - step %d] check of %s not reported in %.0f s: reassigned",
                row["validator_id"][:8],
                row["step"],
                row["cid"][:12],
                timeout,
            )
        live = set(self._live_validators())
        with t.db.transaction() as c:
            load = self._load(c)
        for row in t.db.query(
            "SELECT * FROM rl_batches WHERE status = 'pending' AND submitted_at < ?",
            (now - timeout,),
        ):
            if self._assignee(row, live, load) is None:
                with contextlib.suppress(Rejected):  # a validator took it meanwhile
                    self.judge.decide(row, None, None)

    def report(self, req: ReportCheck, raw: dict[str, Any]) -> dict[str, Any]:
        t, m = self.t, self.t.membership
        m.check_run(req.run_id)
        m.check_not_halted()  # 410: a halted run takes no check nor verdict
        self._role(req.peer_id, "validator")
        m.authenticate(raw, NO_ROUND, req.peer_id)
        m.check_not_banned(req.peer_id)  # excluded while holding a claim: it just expires
        row = t.db.one(
            "SELECT * FROM rl_batches WHERE cid = ? AND status = 'claimed' AND validator_id = ?",
            (req.batch_cid, req.peer_id),
        )
        if row is None:
            raise Rejected(
                409,
                f"batch {req.batch_cid[:12]} is not assigned to validator "
                f"{req.peer_id[:12]} (reported already, or reassigned)",
            )
        claim = {"ok": req.ok, "problem": req.problem, "detail": req.detail, "sample": req.sample}
        try:
            reply = self.judge.decide(row, req.peer_id, claim)
        except NotJudged:  # the trainer lacks the verify class: undecided, nobody's miss
            with t.db.transaction() as c:
                c.execute(
                    "UPDATE rl_batches SET status = 'pending', validator_id = NULL WHERE id = ? "
                    "AND status = 'claimed'",
                    (row["id"],),
                )
            raise
        with t.db.transaction() as c:  # a decided check: what it cost its validator
            self._record_check(c, req)
        return reply

    def _record_check(self, c: sqlite3.Connection, req: ReportCheck) -> None:
        """A reported check's compute and evidence (the batch fetched) for covey.rl.costs."""
        record(c, "check", req.compute_s, req.batch_cid)
        size = self.t.blobs.size(req.batch_cid) if self.t.blobs.has(req.batch_cid) else 0
        record(c, "fetch", req.fetch_s if req.fetch_s is not None else 0.0, req.batch_cid, size)
