"""The serving mode's coordinator: built on the host (covey.coordinator.host: key,
database, accounts and ledger, membership, halt), not a copy of it. Transport-free
(covey.serve.app turns HTTP into calls here); its event-loop half is covey.serve.dispatch.

What it adds: the answers table; the draw that decides which answers a validator
re-checks (covey.trust.certify.sample: the coordinator's signature over the answer, so a
worker cannot predict it, and anyone can recompute it from the ledger), at new_worker_rate
while a worker is new or of low reputation and verify_rate after; validators' claims and
reports; the referee (the server re-checks a rejection before anyone is slashed, so a
lying validator cannot convict an honest worker); the house canaries (covey.serve.canaries:
noted at intake, revealed with their verdict); and the ledger entries
(covey.trust.entry_schemas; a report's are written by covey.serve.verdicts), round = the
answer's number:

- not drawn: contribution accepted -> reward (work, per token);
- drawn and confirmed: verification (agree) -> contribution accepted -> reward (work) ->
  reward (check);
- drawn and convicted: verification (disagree) -> contribution rejected -> dispute (fraud)
  -> slash (the book bans the worker: membership refuses it from then on) -> reward (catch);
- a rejection the referee cannot reproduce: verification (disagree) -> dispute (validator
  wrong) -> penalty -> the answer is accepted as above;
- an agreement on a house canary (the referee re-checks every one): verification (agree)
  -> house canary (convicted) -> contribution rejected -> penalty (missed fraud).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from covey.coordinator.checks import Checks
from covey.coordinator.db import Database
from covey.coordinator.host import Host, RunTerms
from covey.coordinator.rejected import Rejected
from covey.rl.proofs import proof_size
from covey.serve import assign
from covey.serve import model as served
from covey.serve.canaries import CANARY_SCHEMA, ServeCanaries
from covey.serve.checks import AnswerVerdict, check_answer, check_shape
from covey.serve.config import ServeConfig, run_id_of
from covey.serve.verdicts import write_verdict
from covey.serve.wire import Job
from covey.trust import certify
from covey.trust.halt import owner_of
from covey.trust.identity import Identity

log = logging.getLogger("covey.serve")
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS serve_answers (id INTEGER PRIMARY KEY, job_id TEXT UNIQUE, "
    "worker_id TEXT NOT NULL, job TEXT NOT NULL, tokens TEXT NOT NULL, proof TEXT NOT NULL, "
    "cid TEXT NOT NULL, rate REAL NOT NULL, draw TEXT NOT NULL, status TEXT NOT NULL, "
    "validator_id TEXT, claimed_at REAL, tried TEXT, problem TEXT, detail TEXT, "
    "created REAL NOT NULL)",
    *CANARY_SCHEMA,
)


class ServeCoordinator:
    def __init__(self, cfg: ServeConfig | None, data_dir: Path, model: str | None) -> None:
        """Open the run in `data_dir`, or create it from `cfg` and the model at `model` (an
        exported folder or a rounds run directory, covey.serve.model.model_dir).
        ValueError when the directory holds another run or none and no model is given."""
        self.data_dir = Path(data_dir)

        def terms(identity: Identity, db: Database) -> RunTerms:
            stored = db.get_meta("serve_spec")
            if stored is None:
                if cfg is None or model is None:
                    raise ValueError(f"{self.data_dir} holds no serving run: give --model")
                self.cfg, self.model_path = cfg, served.model_dir(model, self.data_dir)
                self.model_cid = served.model_cid(self.model_path)
                self.run_id = run_id_of(cfg, self.model_cid, identity.public_key)
            else:
                saved = json.loads(stored)
                self.cfg = ServeConfig.model_validate(saved["spec"])
                self.model_cid, self.run_id = saved["model_cid"], saved["run_id"]
                self.model_path = served.model_dir(model or saved["model_path"], self.data_dir)
                if (cfg is not None and cfg != self.cfg) or served.model_cid(
                    self.model_path
                ) != self.model_cid:
                    raise ValueError(
                        f"{self.data_dir} serves run {self.run_id} with another spec or "
                        f"model; use another --data-dir"
                    )
            return RunTerms(
                self.run_id,
                owner_of(self.spec_of_run(), identity.public_key),
                self.cfg.membership_config(),
            )

        self.host = host = Host(self.data_dir, terms, position=self.answers, db_file="serve.db")
        self.identity, self.db, self.accounts = host.identity, host.db, host.accounts
        self.membership, self.halt = host.membership, host.halt
        with self.db.transaction() as c:
            for statement in SCHEMA:
                c.execute(statement)
        if self.db.get_meta("serve_spec") is None:
            self._create()
        self.checks = Checks(self.accounts)
        self.model, self.tokenizer = served.load_model(self.model_path)  # the referee's
        self.hidden_size = served.hidden_size(self.model)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.window = served.context_window(self.model)
        self.lock = threading.Lock()  # ledger decisions, one at a time
        # which answers are house canaries (covey.serve.canaries): secret until revealed
        self.canaries = ServeCanaries(
            self.cfg.trust.canary_rate, self.run_id, self.identity, self.db, self.accounts
        )
        self._judging = threading.Lock()  # prefill hooks: one check at a time
        self._thread: threading.Thread | None = None
        self.tokens_served = 0
        self.started = time.time()

    def spec_of_run(self) -> dict[str, Any]:
        return {"serve": self.cfg.model_dump(mode="json"), "model": self.model_cid}

    def _create(self) -> None:
        now = time.time()
        saved = {
            "spec": self.cfg.model_dump(mode="json"),
            "model_cid": self.model_cid,
            "run_id": self.run_id,
            "model_path": str(self.model_path),
        }
        with self.accounts.transaction() as c:
            self.accounts.append(
                c,
                "run created",
                {
                    "run_id": self.run_id,
                    "name": self.cfg.name,
                    "spec": self.spec_of_run(),
                    "coordinator_key": self.identity.public_key,
                    "policy": self.cfg.policy().to_dict(),
                },
                now,
            )
            c.execute("INSERT INTO meta VALUES ('serve_spec', ?)", (json.dumps(saved),))
            c.execute("INSERT OR REPLACE INTO meta VALUES ('run_id', ?)", (self.run_id,))
        log.info("[serve] created run %s for model %s", self.run_id, self.model_cid[:12])

    # -- the driver: the owner's HALT, lapsed claims ------------------------------------------

    def answers(self) -> int:
        row = self.db.one("SELECT COALESCE(MAX(id), 0) AS n FROM serve_answers")
        return int(row["n"]) if row else 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="serve-driver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.host.stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.host.close()

    def _run(self) -> None:
        while not self.host.stop.is_set():
            self.host.wake.wait(0.5)
            self.host.wake.clear()
            try:
                self.halt.enforce(time.time())
                with self.db.transaction() as c:  # a lapsed claim goes to another validator
                    c.execute(
                        "UPDATE serve_answers SET status = 'pending', validator_id = NULL, "
                        "tried = json_insert(COALESCE(tried, '[]'), '$[#]', validator_id) "
                        "WHERE status = 'claimed' AND claimed_at < ?",
                        (time.time() - self.cfg.claim_timeout_s,),
                    )
            except Exception:  # the driver must outlive one bad pass; the error is logged
                log.exception("serve driver pass failed")

    # -- who may take part --------------------------------------------------------------------

    def alive(self, peer_id: str) -> bool:
        """A worker that heartbeats (within dead_after_s) and is not excluded."""
        account = self.accounts.book.accounts.get(peer_id)
        if account is None or account.banned:
            return False
        seen = self.membership.liveness.last_seen(peer_id, None)
        return time.time() - seen < self.cfg.dead_after_s

    def authenticate(self, raw: dict[str, Any], peer_id: str, role: str) -> None:
        """Rejected unless `raw` is signed for this endpoint by `peer_id`, a registered peer
        of `role` not excluded, in a run not halted."""
        self.membership.check_run(raw.get("run_id", ""))
        self.halt.check_not_halted()
        account = self.accounts.book.accounts.get(peer_id)
        if account is None:
            raise Rejected(404, f"unknown peer {peer_id[:12]}: join first")
        self.membership.authenticate(raw, -1, peer_id)
        self.membership.check_not_banned(peer_id)
        if account.role != role:
            raise Rejected(403, f"peer {peer_id[:12]} is a {account.role}, not a {role}")

    # -- answers --------------------------------------------------------------------------------

    def intake(self, job: Job, worker: str, tokens: list[int], proof_hex: str) -> int:
        """Record a worker's answer to `job` (held by it: the caller checked): its shape and
        proof size are checked first (Rejected 422, nothing recorded); then the draw, and
        for an answer not drawn, its pay. Returns the answer's number."""
        problem = check_shape(tokens, job.max_tokens, job.eos_id)
        if problem is None and any(t >= self.vocab_size for t in tokens):
            problem = f"a token id outside the model's vocabulary of {self.vocab_size}"
        expected = 2 * proof_size(len(tokens), self.hidden_size)
        if problem is None and len(proof_hex) != expected:
            problem = f"proof of {len(proof_hex) // 2} bytes, expected {expected // 2}"
        if problem is not None:
            raise Rejected(422, f"answer to job {job.job_id}: {problem}")
        job_json = job.model_dump_json()
        cid = hashlib.sha256(f"{job_json}|{tokens}|{proof_hex}".encode()).hexdigest()
        now = time.time()
        with self.lock:
            account = self.accounts.book.accounts[worker]
            policy = self.cfg.policy()
            new = account.contributions < self.cfg.new_worker_answers
            low = account.reputation < policy.low_reputation
            rate = self.cfg.new_worker_rate if new or low else self.cfg.verify_rate
            with self.accounts.transaction() as c:
                cur = c.execute(
                    "INSERT INTO serve_answers (job_id, worker_id, job, tokens, proof, cid, "
                    "rate, draw, status, created) VALUES (?, ?, ?, ?, ?, ?, ?, '', 'new', ?)",
                    (job.job_id, worker, job_json, json.dumps(tokens), proof_hex, cid, rate, now),
                )
                answer = int(cur.lastrowid or 0)
                sampled, draw = certify.sample(
                    self.identity, self.run_id, answer, worker, cid, rate
                )
                status = "pending" if sampled else "accepted"
                self.canaries.note(c, answer, worker, job.job_id)
                c.execute(
                    "UPDATE serve_answers SET draw = ?, status = ? WHERE id = ?",
                    (draw, status, answer),
                )
                if not sampled:
                    self.accept(c, answer, worker, cid, len(tokens), rate, draw, now)
        self.tokens_served += len(tokens)
        return answer

    def _entry(self, c: Any, type: str, answer: int, peer: str, now: float, **fields: Any) -> None:
        self.accounts.append(c, type, {"round": answer, "peer_id": peer, **fields}, now)

    def accept(
        self,
        c: Any,
        answer: int,
        worker: str,
        cid: str,
        tokens: int,
        rate: float,
        draw: str,
        now: float,
    ) -> None:
        self._entry(
            c,
            "contribution accepted",
            answer,
            worker,
            now,
            cid=cid,
            tokens=tokens,
            inner_steps=1,
            sampled=False,
            rate=rate,
            draw=draw,
            request_id=cid,
            nonce="",
            signature="",
        )
        self._entry(
            c,
            "reward",
            answer,
            worker,
            now,
            kind="work",
            tokens=tokens,
            amount=self.accounts.book.work_reward(tokens),
        )

    def live_validators(self, now: float) -> list[str]:
        """Validators heard from within dead_after_s, not excluded."""
        book, live = self.accounts.book.accounts, self.membership.liveness
        return [
            r["peer_id"]
            for r in self.membership.peers.by_role("validator")
            if r["state"] != "left"
            and now - live.last_seen(r["peer_id"], r["last_seen"]) < self.cfg.dead_after_s
            and not (r["peer_id"] in book and book[r["peer_id"]].banned)
        ]

    def claim(self, validator: str) -> dict[str, Any] | None:
        """The oldest drawn answer not yet checked that is assigned to `validator`
        (covey.serve.assign: its draw ranks `validator` first among the live ones)."""
        live = self.live_validators(time.time())
        if validator not in live:
            live.append(validator)  # it asks now: it is alive
        with self.lock, self.db.transaction() as c:
            rows = c.execute(
                "SELECT * FROM serve_answers WHERE status = 'pending' AND worker_id != ? "
                "ORDER BY id LIMIT 256",
                (validator,),
            ).fetchall()
            tried = {r["id"]: json.loads(r["tried"] or "[]") for r in rows}
            mine = [
                r
                for r in rows
                if assign.assigned(r["draw"], r["worker_id"], live, tried[r["id"]]) == validator
            ]
            if not mine:
                return None
            row = mine[0]
            c.execute(
                "UPDATE serve_answers SET status = 'claimed', validator_id = ?, claimed_at = ? "
                "WHERE id = ?",
                (validator, time.time(), row["id"]),
            )
        return {
            "answer_id": row["id"],
            "worker_id": row["worker_id"],
            "job": json.loads(row["job"]),
            "tokens": json.loads(row["tokens"]),
            "proof": row["proof"],
        }

    def judge(self, job: dict[str, Any], tokens: list[int], proof: bytes) -> AnswerVerdict:
        with self._judging:
            return check_answer(self.model, job, tokens, proof)

    def report(
        self, validator: str, answer: int, ok: bool, problem: str | None, detail: str
    ) -> dict[str, Any]:
        """A validator's verdict on the answer it claimed; a rejection, and an agreement on
        a house canary (covey.serve.canaries), is re-checked here first; the entries are
        covey.serve.verdicts'. Rejected(409) when it holds no claim on that answer."""
        row = self.db.one("SELECT * FROM serve_answers WHERE id = ?", (answer,))
        if row is None or row["status"] != "claimed" or row["validator_id"] != validator:
            raise Rejected(409, f"validator {validator[:12]} holds no claim on answer {answer}")
        verdict = None
        if not ok or self.canaries.is_canary(answer):
            tokens, proof = json.loads(row["tokens"]), bytes.fromhex(row["proof"])
            verdict = self.judge(json.loads(row["job"]), tokens, proof)
        now = time.time()
        with self.lock, self.accounts.transaction() as c:
            again = c.execute(
                "SELECT status, validator_id FROM serve_answers WHERE id = ?", (answer,)
            ).fetchone()
            if again["status"] != "claimed" or again["validator_id"] != validator:
                raise Rejected(409, f"answer {answer} was decided or reassigned meanwhile")
            canary = self.canaries.of_answer(c, answer)
            outcome, status, problem, detail = write_verdict(
                self, c, row, validator, ok, verdict, canary, (problem, detail), now
            )
            c.execute(
                "UPDATE serve_answers SET status = ?, problem = ?, detail = ? WHERE id = ?",
                (status, problem, (detail or "")[:500], answer),
            )
        level = logging.INFO if outcome == "accepted" else logging.WARNING
        log.log(level, "[serve - answer %d] worker %s: %s by %s", answer, row["worker_id"][:8],
                outcome, validator[:8])  # fmt: skip
        return {"ok": True, "outcome": outcome}

    def status(self) -> dict[str, Any]:
        rows = self.db.query(
            "SELECT status, COUNT(*) AS n, SUM(json_array_length(tokens)) AS t "
            "FROM serve_answers GROUP BY status"
        )
        book = self.accounts.book.accounts
        return {
            "run_id": self.run_id,
            "model": self.cfg.name,
            "model_cid": self.model_cid,
            "answers": {r["status"]: r["n"] for r in rows},
            "tokens": {r["status"]: r["t"] or 0 for r in rows},
            "excluded": sorted(p for p, a in book.items() if a.banned),
            "canaries": self.canaries.counts(),
            "workers": {
                p: {
                    "name": a.name,
                    "balance": a.balance,
                    "stake": a.stake,
                    "answers_paid": a.contributions,
                    "banned": a.banned,
                }
                for p, a in book.items()
                if a.role == "worker"
            },
        }
