"""An RL validator (staked): claim the batch the trainer assigned, check it, report.

The check is covey.rl.batch.check_batch under the policy of the batch's step, with the
run's rules from the trainer's spec (never from the batch) and the prefill checks on the
sequences the trainer's draw picked. Policies and batches are fetched by content id and
verified by hash. The dishonest validators of tests and the demo are
covey.rl.cheater.CheatingRolloutValidator, which overrides `verdict`.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from covey.blobs import BlobClient, BlobError, BlobStore
from covey.peer.client import CoordinatorClient, PeerRejected
from covey.rl.batch import RolloutBatch, check_batch
from covey.rl.peer import Membership, PolicyCache, RunInfo, read_run
from covey.rl.policy import PolicyError, codec_kwargs
from covey.rl.runspec import peer_device
from covey.trust.identity import Identity

log = logging.getLogger("covey.rl.validator")


class RolloutValidator:
    def __init__(
        self,
        trainer_url: str,
        identity: Identity,
        *,
        name: str = "validator",
        stake: float = 10.0,
        lost_s: float = 60.0,
        run_id: str | None = None,
        stop: threading.Event | None = None,
        work_dir: Path | None = None,
        device: str = "auto",
    ) -> None:
        """`device` (covey.rl.runspec.peer_device: auto is the run's verify class) holds
        the policies it checks under. VerifyRefused, before joining, when it is of another
        class than the run's verify_device (or auto and this machine lacks that class)."""
        self.identity, self.name, self.stake = identity, name, stake
        self.stop = stop or threading.Event()
        self.client = CoordinatorClient(
            trainer_url, timeout_s=30.0, lost_s=lost_s, stop=self.stop, identity=identity
        )
        self.trainer_url = trainer_url.rstrip("/")
        self.run: RunInfo = read_run(self.client, run_id)
        # on another device class than the run's, VerifyRefused before any claim
        self.device = peer_device(self.run.spec, device, "validator")
        root = work_dir or Path(tempfile.mkdtemp(prefix="covey-rl-validator-"))
        self.fetcher = BlobClient(timeout_s=10.0, retries=2)  # bytes are checked by hash
        self.policies = PolicyCache(self.run, BlobStore(root / "blobs"), self.fetcher, self.device)
        self.halted: str | None = None  # the owner's reason, once the run is halted
        self.membership = Membership(self.client, identity, self.run, self.halt_seen)
        self.reports: list[dict[str, Any]] = []

    def halt_seen(self, reason: str) -> None:
        """The run owner halted the run (a 410 from a heartbeat or a request): stop."""
        if self.halted is None:
            log.warning("[%s] the run was halted by its owner (%s): stopping", self.name, reason)
        self.halted = self.halted or reason
        self.stop.set()

    def run_loop(self, max_checks: int | None = None, poll_s: float = 0.3) -> int:
        """Check assigned batches until stopped (or `max_checks` reported)."""
        self.membership.join("validator", self.name, self.stake)
        try:
            while not self.stop.is_set() and (max_checks is None or len(self.reports) < max_checks):
                try:
                    task = self.client.post(
                        "/v1/rl/claim",
                        {"run_id": self.run.run_id, "peer_id": self.identity.peer_id},
                    )
                except PeerRejected as e:
                    if e.status != 410:
                        raise
                    self.halt_seen(e.message)
                    break
                if task.get("task") is None:
                    self.stop.wait(poll_s)
                    continue
                if self.check(task["task"]) is None:
                    self.stop.wait(poll_s)  # the assignment expires and goes elsewhere
        finally:
            self.membership.leave("shutdown")
            self.fetcher.close()
        return len(self.reports)

    def check(self, task: dict[str, Any]) -> dict[str, Any] | None:
        """Check one assigned batch and report the verdict; None if it could not be had
        (the assignment then expires and goes to another validator)."""
        started = time.perf_counter()
        try:
            model = self.policies.model(task["policy_cid"], [self.trainer_url])
            data = self.fetcher.fetch(task["batch_cid"], [self.trainer_url])
            batch = RolloutBatch.model_validate_json(data)
        except (BlobError, PolicyError, ValueError) as e:
            log.warning("[%s] cannot check %s: %s", self.name, task["batch_cid"][:12], e)
            return None
        report: dict[str, Any] = {
            "run_id": self.run.run_id,
            "peer_id": self.identity.peer_id,
            "batch_cid": task["batch_cid"],
        }
        fetched = time.perf_counter()
        report |= self.verdict(task, batch, model)
        # what the check cost (covey.rl.costs): fetching the batch and policy, checking it
        report |= {"fetch_s": round(fetched - started, 6),
                   "compute_s": round(time.perf_counter() - fetched, 6)}  # fmt: skip
        try:
            reply = self.client.post("/v1/rl/report", report)
        except PeerRejected as e:
            log.warning("[%s] report on %s refused: %s", self.name, task["batch_cid"][:12], e)
            if e.status == 410:
                self.halt_seen(e.message)
            return None
        log.info(
            "[%s - step %d] %s %s: %s",
            self.name,
            task["step"],
            task["worker_id"][:8],
            "ok" if report["ok"] else f"REJECT ({report.get('problem')})",
            reply.get("outcome"),
        )
        self.reports.append({**report, **reply})
        return reply

    def verdict(
        self, task: dict[str, Any], batch: RolloutBatch, model: torch.nn.Module
    ) -> dict[str, Any]:
        """The report's verdict on the assigned `batch`: covey.rl.batch.check_batch under
        `model`, the policy of the batch's step."""
        verdict = check_batch(
            batch,
            spec=self.run.rollout,
            submitter=task["worker_id"],
            step=task["step"],
            policy_version=task["policy_version"],
            policy_cid=task["policy_cid"],
            model=model,
            task=self.run.task,
            verify_samples=list(task["verify_samples"]),
            **codec_kwargs(self.run.model_cfg),  # the policy's tokenizer
        )
        return {
            "ok": verdict.ok,
            "detail": "".join(ch if ch.isprintable() else " " for ch in verdict.detail)[:500],
            "problem": verdict.problem.value if verdict.problem else None,
            "sample": verdict.sample,
        }
