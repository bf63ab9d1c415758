"""Verdicts on rollout batches and the ledger entries that record them.

A verdict rests on recomputation by the trainer (trusted): a validator's rejection is
re-checked on the sequences it was given (plus the one it names) before the worker is
slashed and the validator paid a catch; a rejection the trainer cannot reproduce is a
false accusation (dispute "validator wrong", penalty) and the batch is accepted; an
acceptance is audited in full with probability audit_rate (drawn from the trainer's
signature, so anyone can recompute it), and a bad batch found so costs the worker its
slash and the validator a penalty (ledger kind "missed fraud": it passed a batch the
audit proved bad) and its check pay, through covey.coordinator.checks.Checks.convict, the
same accounting as a rounds contribution convicted by the referee.
A batch no validator could take is checked by the trainer in full. A house worker's canary
(covey.rl.canaries) is decided here like any batch, except that an agreement on it is always
audited, and is revealed in the verdict's transaction: after its validator reported.

Ledger entries (covey.trust.incentives), round = the batch's step:
accepted: verification(agree) -> contribution accepted -> reward(work, per token) ->
reward(check); rejected: verification(disagree) -> contribution rejected -> dispute(fraud)
-> slash -> reward(catch). A worker already excluded for fraud is never paid again.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from covey.coordinator.checks import Checks, Verdict
from covey.coordinator.rejected import Rejected
from covey.rl.batch import BatchVerdict, RolloutBatch, check_batch, verified_subset
from covey.rl.canaries import HouseCanaries
from covey.rl.costs import record
from covey.rl.policy import codec_kwargs

if TYPE_CHECKING:
    from covey.rl.trainer_parts import TrainerParts

log = logging.getLogger("covey.rl.intake")


class Checked(NamedTuple):
    """What the trainer judges: a batch's row and the samples to recompute (None: all)."""

    row: sqlite3.Row
    samples: list[int] | None


def _h(*parts: object) -> str:
    return hashlib.sha256("|".join(str(p) for p in parts).encode()).hexdigest()


class Judge:
    def __init__(self, trainer: TrainerParts) -> None:
        self.t = trainer
        self.checks = Checks(trainer.accounts)  # check pay and missed fraud, as rounds'
        self.audits = {"audited": 0, "caught": 0}
        self.canaries = HouseCanaries(trainer)
        # one check at a time: the prefill captures hidden states with a forward hook on
        # the version's shared frozen model (covey.rl.sampling.forward_hidden), so two
        # concurrent checks (the loop's deadline checks, request threads' audits) read each
        # other's states and reject honest batches (seen in a demo: "top-k overlap 0.667")
        self._checking = threading.Lock()

    def judge(self, item: Checked) -> Verdict:
        """The trainer's verdict on a batch (covey.coordinator.checks.Referee): convicted
        when its recomputation over `item.samples` (None: every sample) finds a problem.
        Raising leaves the batch undecided: nobody is convicted or paid."""
        v = self.check(item.row, item.samples)
        if v.ok:
            return Verdict("cleared", v.detail)
        problem = v.problem.value if v.problem else ""
        return Verdict("convicted", v.detail, problem, v.sample)

    def check(self, row: sqlite3.Row, samples: list[int] | None) -> BatchVerdict:
        t = self.t
        batch = RolloutBatch.model_validate_json(t.blobs.get(row["cid"]))
        with self._checking:
            return self._check(batch, row, samples)

    def _check(
        self, batch: RolloutBatch, row: sqlite3.Row, samples: list[int] | None
    ) -> BatchVerdict:
        t = self.t
        return check_batch(
            batch,
            spec=t.rollout,
            submitter=row["worker_id"],
            step=row["step"],
            policy_cid=t.cids[row["step"]],
            policy_version=row["step"],
            model=t.policy_at(row["step"]),
            task=t.task,
            verify_samples=samples,
            **codec_kwargs(t.model_cfg),  # the policy's tokenizer (bytes for GPT)
        )

    def decide(
        self, row: sqlite3.Row, validator: str | None, claim: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Decide a batch: `claim` is the validator's report (None: the trainer's own check,
        over every sample). Returns what the validator is told."""
        t, now = self.t, time.time()
        step, worker, draw = row["step"], row["worker_id"], row["draw"] or ""
        canary = self.canaries.draw(worker, step)  # secret until revealed below
        picked = (
            verified_subset(row["cid"], draw, row["samples"], t.spec.verify_samples)
            if draw
            else None
        )
        started, judged = time.perf_counter(), True  # the trainer's own check, if it runs one
        if claim is None:
            verdict = self.judge(Checked(row, None))
            outcome = "rejected" if verdict.convicted else "accepted"
        elif claim["ok"]:
            audit = int(_h("covey-rl-audit", draw)[:8], 16) / 16**8 < t.spec.audit_rate
            verdict = self.judge(Checked(row, None)) if audit or canary else Verdict("cleared", "")
            judged = bool(audit or canary)
            self.audits["audited"] += audit
            self.audits["caught"] += audit and verdict.convicted
            outcome = "missed" if verdict.convicted else "accepted"
        else:
            extra = [claim["sample"]] if claim["sample"] is not None else []
            extra = [i for i in extra if i < row["samples"]]
            verdict = self.judge(Checked(row, sorted(set((picked or []) + extra))))
            outcome = "caught" if verdict.convicted else "false accusation"
        own_s = time.perf_counter() - started if judged else None
        banned = t.accounts.book.accounts[worker].banned
        if not verdict.convicted and banned:
            verdict = Verdict("convicted", "the worker was excluded for fraud", "banned")
        problem = verdict.finding or ("banned" if banned else None)
        accepted = not verdict.convicted
        with t.accounts.transaction() as c:
            now_status = c.execute("SELECT status FROM rl_batches WHERE id = ?", (row["id"],))
            if now_status.fetchone()[0] not in ("pending", "claimed"):  # decided meanwhile
                raise Rejected(409, f"batch {row['cid'][:12]} was decided already")
            if validator is not None:
                t.accounts.append(
                    c,
                    "verification",
                    {
                        "round": step,
                        "peer_id": worker,
                        "validator_id": validator,
                        "outcome": "agree" if claim and claim["ok"] else "disagree",
                        "distance": None,
                        "exact": True,
                        "cid": row["cid"],
                        "draw": draw,
                        "samples": picked or [],
                    },
                    now,
                )
            if outcome == "false accusation" and validator is not None:
                self.append(
                    c,
                    "dispute",
                    step,
                    worker,
                    validator_id=validator,
                    segment=0,
                    outcome="validator wrong",
                    detail=str(claim)[:300],
                )
                self.append(
                    c,
                    "penalty",
                    step,
                    validator,
                    kind="false accusation",
                    amount=t.accounts.book.penalty_amount(validator),
                    reason=f"rejected {row['cid'][:12]}; the trainer's check accepts it",
                )
            if accepted:
                self.accept_entries(c, row, draw, now)
                if outcome == "accepted" and validator is not None:
                    self.checks.pay_check(c, step, worker, validator, t.spec.check_reward, now)
            else:
                caught_by = validator if outcome == "caught" and not banned else None
                reveal = canary is not None and validator is not None and not banned
                why = f"{problem}: {verdict.detail}"
                if reveal and outcome == "missed":  # the reveal convicts it (and burns it)
                    self.canaries.reveal(c, step, worker, validator, canary, "convicted", why, now)
                self.reject_entries(
                    c,
                    step,
                    worker,
                    caught_by,
                    f"{problem}: {verdict.detail}",
                    verdict.evidence or 0,
                    now,
                    slash=not banned,
                )
                if reveal and outcome == "caught":  # after the dispute that convicted it
                    self.canaries.reveal(c, step, worker, validator, canary, "caught", why, now)
                if outcome in ("missed", "caught"):  # convicted by a check, not for a ban
                    # who agreed on it missed a fraud; its pay, if any, is clawed back
                    reason = f"the trainer's check rejects {row['cid'][:12]} ({problem})"
                    self.checks.convict(c, step, worker, reason, now)
            record(c, "check", own_s, row["cid"])  # covey.rl.costs: verification
            c.execute(
                "UPDATE rl_batches SET status = ?, problem = ?, detail = ? WHERE id = ?",
                (
                    "accepted" if accepted else "rejected",
                    problem,
                    verdict.detail[:500],
                    row["id"],
                ),
            )
        level = logging.INFO if accepted else logging.WARNING
        log.log(
            level,
            "[%s - step %d] batch %s %s (%s)%s",
            worker[:8],
            step,
            row["cid"][:12],
            "accepted" if accepted else "REJECTED",
            outcome,
            f": {problem}" if problem else "",
        )
        return {"ok": True, "outcome": outcome, "accepted": accepted}

    def append(self, c: sqlite3.Connection, type: str, step: int, peer: str, **fields: Any) -> None:
        self.t.accounts.append(c, type, {"round": step, "peer_id": peer, **fields}, time.time())

    def accept_entries(
        self, c: sqlite3.Connection, row: sqlite3.Row, draw: str, now: float
    ) -> None:
        t, step, worker, tokens = self.t, row["step"], row["worker_id"], row["tokens"]
        self.append(
            c,
            "contribution accepted",
            step,
            worker,
            cid=row["cid"],
            tokens=tokens,
            inner_steps=0,
            sampled=False,
            rate=1.0,
            draw=draw,
            request_id=row["cid"],
            nonce=row["nonce"] or "",
            signature=row["signature"] or "",
        )
        self.append(
            c,
            "reward",
            step,
            worker,
            amount=t.accounts.book.work_reward(tokens),
            kind="work",
            tokens=tokens,
        )

    def reject_entries(
        self,
        c: sqlite3.Connection,
        step: int,
        worker: str,
        validator: str | None,
        reason: str,
        sample: int,
        now: float,
        slash: bool = True,
    ) -> None:
        t = self.t
        self.append(c, "contribution rejected", step, worker, reason=reason[:300])
        if validator is not None:
            self.append(
                c,
                "dispute",
                step,
                worker,
                validator_id=validator,
                segment=sample,
                outcome="fraud",
                detail=reason[:300],
            )
        if slash:
            self.append(
                c,
                "slash",
                step,
                worker,
                amount=t.accounts.book.slash_amount(worker),
                reason=reason[:300],
            )
        if validator is not None and t.spec.catch_reward:
            self.append(
                c, "reward", step, validator, amount=t.spec.catch_reward, kind="catch", tokens=0
            )
