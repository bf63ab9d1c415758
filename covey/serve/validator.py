"""A serving validator (staked): claims a drawn answer, re-checks it by one prefill
(covey.serve.checks.check_answer: every sampled token against the seeded draw, and the
inference proof) and reports. The server re-checks a rejection before anyone is slashed,
so a validator gains nothing by accusing an honest worker (it pays a penalty instead)."""

from __future__ import annotations

import logging
from typing import Any

from covey.peer.client import CoordinatorLost, PeerRejected
from covey.serve.checks import check_answer
from covey.serve.peer import ServePeer

log = logging.getLogger("covey.serve.validator")


class ServeValidator(ServePeer):
    role = "validator"

    def run_loop(self, max_checks: int | None = None, poll_s: float = 0.2) -> int:
        """Check answers until stopped (or `max_checks` reported); returns how many."""
        self.join()
        self.reports: list[dict[str, Any]] = []
        try:
            while not self.stop.is_set() and (max_checks is None or len(self.reports) < max_checks):
                try:
                    task = self.client.post("/v1/serve/claim", self.body()).get("task")
                    if task is None:
                        self.stop.wait(poll_s)
                        continue
                    self.reports.append(self.check(task))
                except PeerRejected as e:
                    self.refused(e)
                except CoordinatorLost:
                    log.warning("[%s] the server is gone: stopping", self.name)
                    break
        finally:
            self.leave()
        return len(self.reports)

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        proof = bytes.fromhex(task["proof"])
        verdict = check_answer(self.model, task["job"], list(task["tokens"]), proof)
        report = {
            **self.body(),
            "answer_id": task["answer_id"],
            "ok": verdict.ok,
            "problem": verdict.problem,
            "detail": verdict.detail[:500],
        }
        reply = self.client.post("/v1/serve/report", report)
        log.info(
            "[%s] answer %d of %s: %s -> %s",
            self.name,
            task["answer_id"],
            task["worker_id"][:8],
            "ok" if verdict.ok else verdict.problem,
            reply.get("outcome"),
        )
        return {**report, **reply}
