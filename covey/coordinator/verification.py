"""Verification and incentives on the coordinator (../shared/DESIGN.md, "The round" step 6).

At each commit the accepted contributions are written to the ledger, each with the
coordinator's sampling draw (covey.trust.certify): sampled ones become tasks assigned to
validators by the public beacon (covey.coordinator.assignment), which each validator
claims (`/v1/verify/claim`: only its own), re-executes from the round's start state and
reports (`/v1/verify/report`: a completed check, paid `check_reward`). A disagreement
opens a dispute: the validator names the first diverging segment of the worker's
commitments, and the referee (a thread here) recomputes that one segment alone
(covey.trust.verify, after Verde, arXiv 2502.19405) and decides. Proven fraud slashes the
worker's stake, excludes it and pays the validator. Work is paid `challenge_rounds` after
it was accepted, unless it is still being checked (its checks are not complete: an
unreported check is reassigned, never paid anyway) or was fraud.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import queue
import sqlite3
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from covey.algorithms.codecs import CodecError
from covey.peer.blobs import BlobError
from covey.peer.runsetup import assignment_batches
from covey.protocol import schemas
from covey.protocol.checkpoint import state_from_bytes
from covey.trust import referee, verify
from covey.trust.certify import sample
from covey.trust.identity import canonical_json
from covey.trust.sketch import commitment_of

from .assignment import OPEN, Assignments
from .canary import Canaries
from .views import Rejected

if TYPE_CHECKING:
    from covey.algorithms import Strategy, TrainState
    from covey.config import RunConfig
    from covey.data.corpus import Corpus
    from covey.peer.blobs import BlobClient, BlobStore

    from .accounts import Accounts
    from .db import Database

log = logging.getLogger("covey.coordinator")


class Verification(Assignments, Canaries):
    # provided by Coordinator
    cfg: RunConfig
    run_id: str
    db: Database
    accounts: Accounts
    blobs: BlobStore
    fetcher: BlobClient
    strategy: Strategy
    template: TrainState
    corpus: Corpus
    seq_len: int
    verifying: bool
    authenticate: Any
    _check_run: Any
    _register: Any

    def __init__(self) -> None:
        self._disputes: queue.Queue[int | None] = queue.Queue()
        self._referee_thread: threading.Thread | None = None
        self._referee_strategy: Strategy | None = None
        self._attempts: dict[int, int] = {}  # task id -> times its judging raised
        self._layout: tuple[int, dict[str, int]] | None = None
        self._layout_lock = threading.Lock()
        if getattr(self, "db", None) is not None:
            self._create_checks_table()
            self._create_canary_table()

    # -- membership checks ----------------------------------------------------------------

    def _check_not_banned(self, peer_id: str) -> None:
        account = self.accounts.book.accounts.get(peer_id)
        if account is not None and account.banned:
            raise Rejected(403, f"peer {peer_id[:12]} was excluded from this run for fraud")

    def _check_role(self, peer_id: str, role: str) -> None:
        account = self.accounts.book.accounts.get(peer_id)
        if account is None or account.role != role:
            raise Rejected(403, f"{peer_id[:12]} is not a registered {role}")

    # -- at each commit ---------------------------------------------------------------------

    def _record_round(
        self,
        c: sqlite3.Connection,
        round_: int,
        rows: list[Any],
        cert: schemas.Certificate,
        now: float,
    ) -> None:
        """Inside the commit's transaction: ledger entries for the accepted contributions
        (with the sampling draw), the certificate, and the payments now due."""
        book = self.accounts.book
        for r in rows:
            rate = book.sampling_rate(r["peer_id"]) if self.verifying else 0.0
            sampled, draw = sample(
                self.accounts.identity, self.run_id, round_, r["peer_id"], r["cid"], rate
            )
            self.accounts.append(
                c,
                "contribution accepted",
                {
                    "round": round_,
                    "peer_id": r["peer_id"],
                    "cid": r["cid"],
                    "tokens": r["tokens"],
                    "inner_steps": r["inner_steps"],
                    "sampled": sampled,
                    "rate": rate,
                    "draw": draw,
                    "request_id": r["request_id"],
                    "nonce": r["nonce"],
                    "signature": r["signature"],
                },
                now,
            )
            c.execute(
                "INSERT OR REPLACE INTO payouts VALUES (?, ?, ?, 'due')",
                (round_, r["peer_id"], r["tokens"]),
            )
            if sampled:
                vid = c.execute(
                    "INSERT OR REPLACE INTO verifications (round, peer_id, status) "
                    "VALUES (?, ?, 'pending')",
                    (round_, r["peer_id"]),
                ).lastrowid
                assert vid is not None
                self._assign(c, vid, round_, r["peer_id"], "draw", now)
        if self.verifying:
            self._plant_canaries(c, round_, now)
        digest = hashlib.sha256(canonical_json(cert.model_dump(mode="json")).encode())
        self.accounts.append(
            c,
            "round certificate",
            {
                "round": round_,
                "new_hash": cert.new_hash,
                "certificate_hash": digest.hexdigest(),
                "accepted": [a.peer_id for a in cert.accepted],
                "rejected": [x.peer_id for x in cert.rejected],
            },
            now,
        )
        self._pay_due(c, round_, now)

    def _pay_due(self, c: sqlite3.Connection, round_: int, now: float) -> None:
        """Pay the work accepted `challenge_rounds` ago or earlier: unless its checks are
        not complete or it is disputed (held: until some validator reports on it, however
        long), or it proved fraud (forfeit)."""
        trust = self.cfg.trust
        due = c.execute(
            "SELECT p.round, p.peer_id, p.tokens, v.status AS check_status, v.validator_id "
            "FROM payouts p LEFT JOIN verifications v "
            "ON v.round = p.round AND v.peer_id = p.peer_id "
            "WHERE p.status = 'due' AND p.round <= ? ORDER BY p.round, p.peer_id",
            (round_ - trust.challenge_rounds,),
        ).fetchall()
        for d in due:
            status = d["check_status"]
            if status in ("pending", "claimed", "disputed"):
                continue
            if not self.accounts.book.checks_complete(d["round"], d["peer_id"]):
                continue  # a dispute closed, more checks to go (the sweep draws them)
            account = self.accounts.book.accounts.get(d["peer_id"])
            if status == "fraud" or (account is not None and account.banned):
                c.execute(
                    "UPDATE payouts SET status = 'forfeit' WHERE round = ? AND peer_id = ?",
                    (d["round"], d["peer_id"]),
                )
                continue
            amount = self.accounts.book.work_reward(d["tokens"])
            self.accounts.append(
                c,
                "reward",
                {
                    "round": d["round"],
                    "peer_id": d["peer_id"],
                    "amount": amount,
                    "kind": "work",
                    "tokens": d["tokens"],
                },
                now,
            )
            c.execute(
                "UPDATE payouts SET status = 'paid' WHERE round = ? AND peer_id = ?",
                (d["round"], d["peer_id"]),
            )

    def verification_blobs(self) -> set[str]:
        """Blobs an unfinished verification still needs (kept by the pruning)."""
        rows = self.db.query(
            "SELECT c.cid, r.start_cid FROM verifications v "
            "JOIN rounds r ON r.round = v.round "
            "JOIN contributions c ON c.round = v.round AND c.attempt = r.attempt "
            "AND c.peer_id = v.peer_id WHERE v.status IN ('pending', 'claimed', 'disputed')"
        )
        keep = {r["cid"] for r in rows} | {r["start_cid"] for r in rows}
        keep |= {  # H3: the committed local states a re-execution starts from and ends at
            cid
            for r in self.db.query(
                "SELECT l.start_cid, l.end_cid FROM verifications v "
                "JOIN rounds r ON r.round = v.round JOIN local_states l ON l.round = v.round "
                "AND l.attempt = r.attempt AND l.peer_id = v.peer_id "
                "WHERE v.status IN ('pending', 'claimed', 'disputed')"
            )
            for cid in (r["start_cid"], r["end_cid"])
            if cid is not None
        }
        keep |= self.canary_blobs()
        for row in self.db.query("SELECT report FROM verifications WHERE status = 'disputed'"):
            report = json.loads(row["report"] or "{}")
            keep |= {report.get("state_cid"), report.get("payload_cid")} - {None}
        return keep

    # -- validators -------------------------------------------------------------------------

    def validator_join(self, req: schemas.ValidatorJoin, raw: dict[str, Any]) -> dict[str, Any]:
        self._check_run(req.run_id)
        self._register(req.validator_id, req.public_key, req.name, "validator", req.stake, raw)
        log.info("[%s %s] validator joined", req.name, req.validator_id[:8])
        return {"ok": True, "verifying": self.verifying}

    def claim(self, req: schemas.ClaimRequest, raw: dict[str, Any]) -> dict[str, Any]:
        """The oldest check the beacon assigned to this validator, or {"task": None}. A
        validator staked below min_validator_stake is refused (403). Each claim first
        sweeps: late checks are missed and reassigned, and open contributions short of
        validators get the next ones drawn (covey.coordinator.assignment)."""
        self._check_run(req.run_id)
        self.authenticate(raw, -1, req.validator_id)
        self._check_role(req.validator_id, "validator")
        self._check_not_banned(req.validator_id)
        account = self.accounts.book.accounts[req.validator_id]
        if account.stake < self.cfg.trust.min_validator_stake:
            raise Rejected(
                403,
                f"validator {req.validator_id[:12]} has stake {account.stake}, below this "
                f"run's min_validator_stake {self.cfg.trust.min_validator_stake}",
            )
        now = time.time()
        with self.accounts.transaction() as c:
            self._sweep(c, now)
            self._sweep_canaries(c, now)
            found = [
                vid
                for vid in (
                    self._assigned_task(c, req.validator_id),
                    self._next_canary(c, req.validator_id),
                )
                if vid is not None
            ]
        if not found:
            return {"task": None}
        canary = self._canary(min(found))
        if canary is not None:  # looks like any other check
            return {"task": self._canary_task(canary).model_dump()}
        row = {"id": min(found)}
        task = self._task(row["id"])
        log.info(
            "[round %d] %s re-executes %s's contribution",
            task.round,
            req.validator_id[:8],
            task.peer_id[:8],
        )
        return {"task": task.model_dump()}

    def _task(self, task_id: int) -> schemas.VerifyTask:
        v = self.db.one("SELECT * FROM verifications WHERE id = ?", (task_id,))
        assert v is not None
        rnd = self.db.one("SELECT * FROM rounds WHERE round = ?", (v["round"],))
        assert rnd is not None
        c = self.db.one(
            "SELECT * FROM contributions WHERE round = ? AND attempt = ? AND peer_id = ?",
            (v["round"], rnd["attempt"], v["peer_id"]),
        )
        assert c is not None
        assignment = json.loads(rnd["assignments"])[v["peer_id"]]
        chain = self._local_state_chain(v["round"], rnd["attempt"], v["peer_id"])  # H3
        return schemas.VerifyTask(
            task_id=task_id,
            round=v["round"],
            peer_id=v["peer_id"],
            cid=c["cid"],
            size=c["size"],
            tokens=c["tokens"],
            inner_steps=c["inner_steps"],
            fragment=c["fragment"],
            data_key=assignment["data_key"],
            start_cid=rnd["start_cid"],
            start_hash=rnd["start_hash"],
            start_size=self.blobs.size(rnd["start_cid"]),
            commitments=json.loads(c["commitments"] or "[]"),
            providers=[],
            **chain,
        )

    def _local_state_chain(self, round_: int, attempt: int, peer_id: str) -> dict[str, Any]:
        """H3: the committed local states of a contribution (covey.algorithms.base, the
        local-state chain): its start (the end state of the peer's previous round, checked
        at intake), whether that round's certificate accepted it, and its end state."""
        row = self.db.one(
            "SELECT * FROM local_states WHERE round = ? AND attempt = ? AND peer_id = ?",
            (round_, attempt, peer_id),
        )
        if row is None:
            return {}
        out: dict[str, Any] = {"end_state_cid": row["end_cid"], "end_state_size": row["end_size"]}
        if row["start_cid"] is not None:
            prev = self.db.one("SELECT certificate FROM rounds WHERE round = ?", (round_ - 1,))
            cert = json.loads(prev["certificate"] or "{}") if prev is not None else {}
            out["local_state_cid"] = row["start_cid"]
            out["local_state_size"] = row["end_size"]  # every local state has one size
            out["previous_accepted"] = any(
                a.get("peer_id") == peer_id for a in cert.get("accepted", [])
            )
        return out

    def report(self, req: schemas.VerifyReport, raw: dict[str, Any]) -> dict[str, Any]:
        """Accept a validator's outcome for a task it holds. The report is validated in full
        before anything is judged (`_report_fault`): a malformed or unprovable one is
        refused (422 naming the field), recorded against the validator ("report refused")
        and the task goes back to be checked by someone."""
        self._check_run(req.run_id)
        self.authenticate(raw, req.round, req.validator_id)
        self._check_role(req.validator_id, "validator")
        canary = self._canary(req.task_id)
        if canary is not None and canary["validator_id"] == req.validator_id:
            return self._report_canary(canary, req)
        v = self.db.one("SELECT * FROM verifications WHERE id = ?", (req.task_id,))
        if v is None or v["status"] == "canary":
            raise Rejected(404, f"no verification task {req.task_id}")
        if not self._holds_check(req.task_id, req.validator_id):
            raise Rejected(
                409, f"task {req.task_id} is not assigned to {req.validator_id[:12]} (or ended)"
            )
        fault = self._report_fault(self._task(req.task_id), req)
        if fault is not None:
            self._refuse_report(v, req, *fault)
            raise Rejected(422, f"report refused: {fault[0]}: {fault[1]}")
        now = time.time()
        book = self.accounts.book
        with self.accounts.transaction() as c:
            self._end_check(c, req.task_id, req.validator_id, "done")
            self.accounts.append(
                c,
                "verification",
                {
                    "round": req.round,
                    "peer_id": v["peer_id"],
                    "validator_id": req.validator_id,
                    "outcome": req.outcome,
                    "distance": req.distance,
                    "exact": req.exact,
                },
                now,
            )
            if self.cfg.trust.check_reward > 0:  # a completed assigned check is paid
                self.accounts.append(
                    c,
                    "reward",
                    {
                        "round": req.round,
                        "peer_id": req.validator_id,
                        "amount": self.cfg.trust.check_reward,
                        "kind": "check",
                        "tokens": 0,
                    },
                    now,
                )
            status = v["status"]
            if status in OPEN and req.outcome == "disagree":
                status = "disputed"  # the first disagreement is judged
                c.execute(
                    "UPDATE verifications SET status = ?, validator_id = ?, report = ? "
                    "WHERE id = ?",
                    (status, req.validator_id, req.model_dump_json(), req.task_id),
                )
            elif status in OPEN and book.checks_complete(v["round"], v["peer_id"]):
                status = "agree"
                c.execute(
                    "UPDATE verifications SET status = ?, validator_id = ?, report = ? "
                    "WHERE id = ?",
                    (status, req.validator_id, req.model_dump_json(), req.task_id),
                )
        log.log(
            logging.INFO if req.outcome == "agree" else logging.WARNING,
            "[round %d] %s: %s's contribution %s (distance %s%s)",
            req.round,
            req.validator_id[:8],
            v["peer_id"][:8],
            "re-executed and agrees" if req.outcome == "agree" else "DISPUTED",
            "exact" if req.exact else f"{req.distance}",
            "" if req.segment is None else f", segment {req.segment}",
        )
        if status == "disputed" and v["status"] in OPEN:
            self._disputes.put(req.task_id)
        return {"ok": True, "status": status}

    def _report_canary(self, canary: Any, req: schemas.VerifyReport) -> dict[str, Any]:
        """A report on a canary: answered as a report on a real check would be."""
        if canary["status"] != "assigned":
            raise Rejected(
                409, f"task {req.task_id} is not assigned to {req.validator_id[:12]} (or ended)"
            )
        if req.round != canary["round"]:
            raise Rejected(422, f"report refused: round: task {req.task_id} is of another round")
        caught = req.outcome == "disagree"
        with self.accounts.transaction() as c:
            self._resolve_canary(c, canary, "caught" if caught else "passed", time.time())
        return {"ok": True, "status": "disputed" if caught else "agree"}

    def _report_fault(
        self, task: schemas.VerifyTask, req: schemas.VerifyReport
    ) -> tuple[str, str] | None:
        """(field, reason) for a report that cannot be judged as it stands, else None: a
        round other than the task's; a disagreement without a segment, or one the round
        does not have; evidence missing for the segment (the validator's commitment at its
        end, or its payload for the last one); a commitment at the wrong step or of the
        wrong layout; a blob it names that was not uploaded or whose size is not the size
        this run's model and codec imply."""
        if req.round != task.round:
            return "round", f"task {task.task_id} is of round {task.round}, not {req.round}"
        if req.outcome == "agree":
            return None
        k = self.cfg.trust.commit_every
        n = len(verify.commitment_steps(task.inner_steps, k))
        if req.segment is None:
            return "segment", "a disagreement names the first diverging segment"
        if req.segment >= n:
            return "segment", (
                f"segment {req.segment} out of range: a round of {task.inner_steps} inner "
                f"steps committing every {k} has segments 0..{n - 1}"
            )
        state_size, sketch_lengths = self._evidence_layout()
        last = req.segment == n - 1
        if last and req.payload_cid is None:
            return "payload_cid", f"segment {req.segment} is the last: back it with a payload"
        if not last:
            if req.claim is None:
                return "claim", f"segment {req.segment} ends at commitment {req.segment + 1}"
            try:
                claim = verify.Commitment.from_dict(req.claim.model_dump())
            except ValueError as e:
                return "claim", str(e)
            if claim.step != (end := (req.segment + 1) * k):
                return "claim", f"step {claim.step}, segment {req.segment} ends at step {end}"
            lengths = {g: len(v) for g, v in claim.sketch.items()}
            if lengths != sketch_lengths:
                return "claim", f"sketch lengths {lengths}, this run's are {sketch_lengths}"
        names = self.strategy.fragment_names(task.fragment)
        numel = sum(self.template.params[n].numel() for n in names)
        sizes = {
            "state_cid": (req.state_cid, state_size),
            "payload_cid": (req.payload_cid, self.strategy.codec.nbytes(numel)),
        }
        for field, (cid, size) in sizes.items():
            if cid is None:
                continue
            if not self.blobs.has(cid):
                return field, f"blob {cid[:12]} was not uploaded (PUT /v1/blobs/...)"
            if (got := self.blobs.size(cid)) != size:
                return field, f"blob {cid[:12]} is {got} bytes; this run implies {size}"
        return None

    def _evidence_layout(self) -> tuple[int, dict[str, int]]:
        """(bytes of a local state as `verify.local_state_to_bytes` writes it, the sketch
        lengths of a commitment): fixed by the model and config, computed once from zeros
        of the strategy's local state's names, shapes and dtypes."""
        with self._layout_lock:
            if self._layout is None:
                live = self.strategy.local_state(copy=False)
                zeros = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in live.items()}
                c = commitment_of(zeros, self.template.params, 0)
                lengths = {g: len(v) for g, v in c.sketch.items()}
                self._layout = (len(verify.local_state_to_bytes(zeros)), lengths)
            return self._layout

    def _refuse_report(self, v: Any, req: schemas.VerifyReport, field: str, reason: str) -> None:
        """Record a refused report against its validator and end its check (the next
        claim draws another validator in its place)."""
        with self.accounts.transaction() as c:
            self._end_check(c, v["id"], req.validator_id, "refused")
            self.accounts.append(
                c,
                "report refused",
                {
                    "round": v["round"],
                    "peer_id": req.validator_id,
                    "worker_id": v["peer_id"],
                    "task_id": v["id"],
                    "field": field,
                    "reason": reason[:500],
                },
                time.time(),
            )
        log.warning(
            "[round %d] %s's report on task %d refused: %s: %s",
            v["round"],
            req.validator_id[:8],
            v["id"],
            field,
            reason,
        )

    # -- the referee --------------------------------------------------------------------------

    def start_referee(self) -> None:
        for row in self.db.query("SELECT id FROM verifications WHERE status = 'disputed'"):
            self._disputes.put(row["id"])  # disputes left open by a restart
        self._referee_thread = threading.Thread(target=self._referee, name="referee", daemon=True)
        self._referee_thread.start()

    def stop_referee(self) -> None:
        self._disputes.put(None)
        if self._referee_thread is not None:
            self._referee_thread.join(30)

    def _referee(self) -> None:
        while (task_id := self._disputes.get()) is not None:
            try:
                self._settle(task_id)
            except Exception as e:  # a bug must not kill the referee nor convict anyone
                self._referee_failed(task_id, e)

    def _referee_failed(self, task_id: int, error: Exception) -> None:
        """A dispute whose judging raised stays open and goes to the back of the queue
        (other disputes first); after `trust.dispute_attempts` failures it is closed
        "inconclusive": nobody slashed or paid for it, recorded on the ledger."""
        attempts = self._attempts.get(task_id, 0) + 1
        self._attempts[task_id] = attempts
        log.error(
            "referee failed on task %d (attempt %d of %d)",
            task_id,
            attempts,
            self.cfg.trust.dispute_attempts,
            exc_info=error,
        )
        if attempts < self.cfg.trust.dispute_attempts:
            self._disputes.put(task_id)
            return
        try:
            self._close_inconclusive(
                task_id, f"the referee failed {attempts} times: {type(error).__name__}: {error}"
            )
        except Exception:  # the database itself failing: left open for a restart
            log.exception("could not close dispute %d as inconclusive", task_id)

    def _close_inconclusive(self, task_id: int, detail: str) -> None:
        """Close an open dispute as "inconclusive" on the ledger (nobody slashed)."""
        v = self.db.one("SELECT * FROM verifications WHERE id = ?", (task_id,))
        if v is None or v["status"] != "disputed":
            return
        report = json.loads(v["report"] or "{}")
        with self.accounts.transaction() as c:
            c.execute("UPDATE verifications SET status = 'inconclusive' WHERE id = ?", (task_id,))
            self.accounts.append(
                c,
                "dispute",
                {
                    "round": v["round"],
                    "peer_id": v["peer_id"],
                    "validator_id": v["validator_id"],
                    "segment": int(report.get("segment") or 0),
                    "outcome": "inconclusive",
                    "detail": detail[:500],
                },
                time.time(),
            )

    def _settle(self, task_id: int) -> None:
        """Recompute the disputed segment alone and write the outcome to the ledger."""
        task = self._task(task_id)
        row = self.db.one("SELECT report FROM verifications WHERE id = ?", (task_id,))
        assert row is not None
        report = schemas.VerifyReport.model_validate_json(row["report"])
        outcome, detail = self._judge(task, report)
        now = time.time()
        trust = self.cfg.trust
        with self.accounts.transaction() as c:
            # not fraud, and more checks required: open again for the next validators
            book = self.accounts.book
            reopen = outcome != "fraud" and not book.checks_complete(task.round, task.peer_id)
            status = "pending" if reopen else outcome
            c.execute("UPDATE verifications SET status = ? WHERE id = ?", (status, task_id))
            self.accounts.append(
                c,
                "dispute",
                {
                    "round": task.round,
                    "peer_id": task.peer_id,
                    "validator_id": report.validator_id,
                    "segment": report.segment,
                    "outcome": outcome,
                    "detail": detail,
                },
                now,
            )
            if outcome == "fraud":
                self.accounts.append(
                    c,
                    "slash",
                    {
                        "round": task.round,
                        "peer_id": task.peer_id,
                        "amount": self.accounts.book.slash_amount(task.peer_id),
                        "reason": detail,
                    },
                    now,
                )
                self.accounts.append(
                    c,
                    "reward",
                    {
                        "round": task.round,
                        "peer_id": report.validator_id,
                        "amount": trust.catch_reward,
                        "kind": "catch",
                        "tokens": 0,
                    },
                    now,
                )
                c.execute("UPDATE peers SET state = 'banned' WHERE peer_id = ?", (task.peer_id,))
                c.execute(
                    "UPDATE payouts SET status = 'forfeit' WHERE peer_id = ? AND status = 'due'",
                    (task.peer_id,),
                )
            elif outcome == "validator wrong":  # a false accusation costs its stake share
                self.accounts.append(
                    c,
                    "penalty",
                    {
                        "round": task.round,
                        "peer_id": report.validator_id,
                        "amount": self.accounts.book.penalty_amount(report.validator_id),
                        "kind": "false accusation",
                        "reason": detail[:500],
                    },
                    now,
                )
        log.warning(
            "[round %d] dispute over %s's contribution (segment %s): %s: %s",
            task.round,
            task.peer_id[:8],
            report.segment,
            outcome.upper() if outcome == "fraud" else outcome,
            detail,
        )

    def _judge(self, task: schemas.VerifyTask, report: schemas.VerifyReport) -> tuple[str, str]:
        """Recompute the disputed segment and compare its end with what the worker and the
        validator each claim it is. The validator's state at the segment's start is used
        only when it hashes to the worker's own commitment there (covey.trust.referee);
        otherwise the referee recomputes from W_r. "fraud" only on the worker's own
        provable fault: a claim malformed on its face, or an end far from the recomputed
        one; a report that does not hold together is "inconclusive", never fraud."""
        strategy = self._referee_strategy_for()
        trust = self.cfg.trust
        start = state_from_bytes(self.blobs.get(task.start_cid), self.template)
        numel = sum(start.params[n].numel() for n in strategy.fragment_names(task.fragment))
        points = verify.commitment_steps(task.inner_steps, trust.commit_every)
        segment = report.segment
        if segment is None or not 0 <= segment < len(points):  # validated at report time
            return "inconclusive", f"segment {segment} is not one of 0..{len(points) - 1}"
        try:
            claimed = [verify.Commitment.from_dict(c) for c in task.commitments]
            steps = [c.step for c in claimed]
            if steps != points:
                raise ValueError(f"commitments at steps {steps[:8]}, the round's are {points[:8]}")
            worker_end = verify.segment_end(
                claimed, self.blobs.get(task.cid), segment, strategy.codec, numel
            )
        except (ValueError, CodecError) as e:
            # a claim that is malformed on its face needs no recomputation
            return "fraud", f"the worker's claim is malformed: {e}"
        try:
            validator_end: Any
            if segment == len(points) - 1:
                if report.payload_cid is None:
                    return "inconclusive", "the validator backed the last segment with no payload"
                data = self.blobs.get(report.payload_cid)
                validator_end = strategy.codec.decode(data, numel)
            elif report.claim is not None:
                validator_end = verify.Commitment.from_dict(report.claim.model_dump())
            else:
                return "inconclusive", "the validator backed its dispute with no claim"
        except (ValueError, CodecError, BlobError) as e:
            return "inconclusive", f"the validator's evidence is unusable: {e}"
        seg_state = None
        if report.state_cid is not None and segment > 0:
            try:
                seg_state = verify.local_state_from_bytes(
                    self.blobs.get(report.state_cid), strategy.local_state()
                )
            except (ValueError, BlobError) as e:  # the referee recomputes from W_r instead
                log.info("task %d: the validator's state is unusable: %s", task.task_id, e)
        result = referee.referee(
            strategy,
            start,
            segment,
            seg_state,
            self._batch_fn(task.round, task.data_key),
            task.inner_steps,
            trust.commit_every,
            claimed_start=claimed[segment] if seg_state is not None else None,
            tolerance=trust.tolerance,
            **self._previous_end(task, strategy),  # H3: the committed start local state
        )
        verdict = referee.judge(result, worker_end, validator_end, trust.tolerance)
        return verdict.outcome, verdict.detail

    def _previous_end(self, task: schemas.VerifyTask, strategy: Strategy) -> dict[str, Any]:
        """H3: referee arguments for the task's committed start local state (none: fresh).
        ValueError for a blob that is not a local state of this run (checked by hash at
        intake, so only a coordinator bug gets here)."""
        if task.local_state_cid is None:
            return {}
        data = self.blobs.get(task.local_state_cid)
        return {
            "previous_end": verify.local_state_from_bytes(data, strategy.local_state()),
            "previous_accepted": task.previous_accepted,
        }

    def _referee_strategy_for(self) -> Strategy:
        """The referee's own copy of the strategy (its model is trained on; the round
        driver's is not touched)."""
        if self._referee_strategy is None:
            self._referee_strategy = copy.deepcopy(self.strategy)
        return self._referee_strategy

    def _batch_fn(self, round_: int, data_key: str) -> Any:
        return assignment_batches(self.cfg, self.corpus, self.seq_len, round_, data_key)
