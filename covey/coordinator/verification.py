"""Verification and incentives on the coordinator (docs/architecture.md, "A round, from
contribution to certificate").

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

A component: it owns the verification tables, the referee thread and its queue, and
reaches membership (signatures, registration, exclusions) only through the `Membership`
it is given. Whoever commits work calls `record_round` inside the commit's transaction
and keeps the blobs `verification_blobs` names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import sqlite3
import threading
import time
from typing import TYPE_CHECKING, Any

from covey.protocol import schemas
from covey.trust.certify import sample
from covey.trust.identity import canonical_json

from .assignment import OPEN, Assignments
from .canary import Canaries
from .checks import Checks
from .disputes import Disputes
from .rejected import Rejected
from .withheld import WithheldEvidence

if TYPE_CHECKING:
    from covey.algorithms import Strategy, TrainState
    from covey.blobs import BlobStore
    from covey.config import RunConfig
    from covey.data.corpus import Corpus

    from .accounts import Accounts
    from .db import Database
    from .membership import Membership

log = logging.getLogger("covey.coordinator")

# a disagreement is judged when none was before: the contribution still open, or agreed on
# by another validator that reported first (its checks then count as complete, but the
# disagreeing validator still held its assigned check): a rubber stamp that reports at once
# must not shadow an honest validator's disagreement, nor escape paying for it
DISPUTABLE = (*OPEN, "agree")


class Verification(Assignments, Canaries, Disputes, WithheldEvidence):
    """Validators, their checks (assignments and canaries) and the referee. The four
    bases are this one component's parts (one file each), not shared-state mixins of the
    coordinator."""

    def __init__(
        self,
        db: Database,
        cfg: RunConfig,
        accounts: Accounts,
        membership: Membership,
        blobs: BlobStore,
        *,
        run_id: str,
        strategy: Strategy,
        template: TrainState,
        corpus: Corpus,
        seq_len: int,
        verifying: bool,
    ) -> None:
        """`strategy`/`template` re-execute and size contributions; `corpus`/`seq_len` give
        the referee a contribution's batches; `verifying` False: validators get no work."""
        self.db = db
        self.cfg = cfg
        self.accounts = accounts
        self.membership = membership
        self.peers = membership.peers
        self.blobs = blobs
        self.run_id = run_id
        self.strategy = strategy
        self.template = template
        self.corpus = corpus
        self.seq_len = seq_len
        self.verifying = verifying
        self.checks = Checks(accounts)  # check pay and missed fraud, shared with RL
        self._init_referee()
        self._create_checks_table()
        self._create_canary_table()

    def _init_referee(self) -> None:
        """The referee's queue and its judging state (also a bare referee's, in tests)."""
        self._disputes: queue.Queue[int | None] = queue.Queue()
        self._referee_thread: threading.Thread | None = None
        self._referee_strategy: Strategy | None = None
        self._attempts: dict[int, int] = {}  # task id -> times its judging raised
        self._layout: tuple[int, dict[str, int]] | None = None
        self._layout_lock = threading.Lock()

    # -- membership checks ----------------------------------------------------------------

    def _check_role(self, peer_id: str, role: str) -> None:
        account = self.accounts.book.accounts.get(peer_id)
        if account is None or account.role != role:
            raise Rejected(403, f"{peer_id[:12]} is not a registered {role}")

    # -- at each commit ---------------------------------------------------------------------

    def record_round(
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
        drawn_at_intake = {  # a stateful contribution's evidence was drawn at this rate
            (s["attempt"], s["peer_id"]): s["rate"]
            for s in c.execute(
                "SELECT attempt, peer_id, rate FROM local_states WHERE round = ?", (round_,)
            )
            if s["rate"] is not None
        }
        for r in rows:
            rate = drawn_at_intake.get((r["attempt"], r["peer_id"]))
            if rate is None:
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
        keep |= {  # the committed local states a re-execution starts from and ends at
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
        self.membership.check_run(req.run_id)
        self.membership.register(
            req.validator_id, req.public_key, req.name, "validator", req.stake, raw
        )
        log.info("[%s %s] validator joined", req.name, req.validator_id[:8])
        return {"ok": True, "verifying": self.verifying}

    def claim(self, req: schemas.ClaimRequest, raw: dict[str, Any]) -> dict[str, Any]:
        """The oldest check the beacon assigned to this validator, or {"task": None}. A
        validator staked below min_validator_stake is refused (403). Each claim first
        sweeps: late checks are missed and reassigned, and open contributions short of
        validators get the next ones drawn (covey.coordinator.assignment)."""
        self.membership.check_run(req.run_id)
        self.membership.authenticate(raw, -1, req.validator_id)
        self._check_role(req.validator_id, "validator")
        self.membership.check_not_banned(req.validator_id)
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
            found = self._assigned_task(c, req.validator_id)
        if found is None:
            return {"task": None}
        task = self._task(found)
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
        chain = self._local_state_chain(v["round"], rnd["attempt"], v["peer_id"])
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
            # where its evidence (the committed local states) is fetched from: the worker's
            # own blob server, never this coordinator's store (none: the worker accepts no
            # connections and uploaded them here)
            providers=[url] if (url := self.peers.blob_url(v["peer_id"])) else [],
            **chain,
        )

    def _local_state_chain(self, round_: int, attempt: int, peer_id: str) -> dict[str, Any]:
        """The committed local states of a contribution (covey.algorithms.base, the
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
        self.membership.check_run(req.run_id)
        self.membership.authenticate(raw, req.round, req.validator_id)
        self._check_role(req.validator_id, "validator")
        v = self.db.one("SELECT * FROM verifications WHERE id = ?", (req.task_id,))
        if v is None or v["status"] == "canary":
            raise Rejected(404, f"no verification task {req.task_id}")
        if not self._holds_check(req.task_id, req.validator_id):
            raise Rejected(
                409, f"task {req.task_id} is not assigned to {req.validator_id[:12]} (or ended)"
            )
        task = self._task(req.task_id)
        fault = self._report_fault(task, req)
        if fault is None and req.outcome == "withheld":
            fault = self._withheld_fault(task, req)
        if fault is not None:
            self._refuse_report(v, req, *fault)
            raise Rejected(422, f"report refused: {fault[0]}: {fault[1]}")
        if req.outcome == "withheld":
            return self._report_withheld(v, req, raw)
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
            # a completed assigned check is paid (taken back if it agreed on a fraud)
            self.checks.pay_check(
                c, req.round, v["peer_id"], req.validator_id, self.cfg.trust.check_reward, now
            )
            status = v["status"]
            if status == "fraud" and req.outcome == "agree":  # passed a fraud convicted already
                self.checks.convict(c, req.round, v["peer_id"], "agreed after the conviction", now)
            if status in DISPUTABLE and req.outcome == "disagree":
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
        if status == "disputed" and v["status"] in DISPUTABLE:
            self._disputes.put(req.task_id)
        return {"ok": True, "status": status}

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
