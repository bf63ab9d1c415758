"""A rollout worker (untrusted): fetch policy v, generate the batch for step v, submit it.

For each policy version it sees, the worker answers the prompts the run assigns it at that
step with G seeded samples each (covey.rl.batch.rollout) and submits one batch signed over
(run, step, content): one batch per worker per step. The cheaters of tests and the demo
are covey.rl.cheater.CheatingRolloutWorker, which overrides `make_batch`.

Bounded everywhere: the trainer client gives up after `lost_s` unreachable; a policy that
no provider serves with the right hash is not generated on (the worker waits for the next
poll); a refused batch (stale step, duplicate) is logged and the worker moves on.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from covey.blobs import BlobClient, BlobError, BlobServer, BlobStore
from covey.devices import device_name
from covey.peer.client import CoordinatorClient, PeerRejected
from covey.peer.heads import HeadKeeper
from covey.rl.batch import RolloutBatch, rollout
from covey.rl.peer import Membership, PolicyCache, RunInfo, read_run
from covey.rl.policy import PolicyError, codec_kwargs
from covey.rl.runspec import peer_device
from covey.trust.identity import Identity

log = logging.getLogger("covey.rl.worker")


class RolloutWorker:
    def __init__(
        self,
        trainer_url: str,
        identity: Identity,
        *,
        name: str = "worker",
        stake: float = 1.0,
        lost_s: float = 60.0,
        serve_blobs: bool = False,
        run_id: str | None = None,
        stop: threading.Event | None = None,
        work_dir: Path | None = None,
        device: str = "auto",
    ) -> None:
        """`device` (covey.rl.runspec.peer_device: auto is the run's verify class; DeviceError
        naming a bad or absent one) holds the policy, generates and builds proofs; it is
        reported at join."""
        self.identity, self.name, self.stake = identity, name, stake
        self.stop = stop or threading.Event()
        self.client = CoordinatorClient(
            trainer_url, timeout_s=30.0, lost_s=lost_s, stop=self.stop, identity=identity
        )
        self.trainer_url = trainer_url.rstrip("/")
        self.run: RunInfo = read_run(self.client, run_id)
        self.device = peer_device(self.run.spec, device)  # auto: the run's verify class
        root = work_dir or Path(tempfile.mkdtemp(prefix="covey-rl-worker-"))
        self.store = BlobStore(root / "blobs")
        self.heads = HeadKeeper(root, self.run.run_id, self.run.trainer_key)  # receipts' heads
        self.fetcher = BlobClient(timeout_s=10.0, retries=2)
        self.policies = PolicyCache(self.run, self.store, self.fetcher, self.device)
        self.server = BlobServer(self.store) if serve_blobs else None
        self.halted: str | None = None  # the owner's reason, once the run is halted
        self.membership = Membership(self.client, identity, self.run, self.halt_seen)
        self.submitted: list[dict[str, Any]] = []
        self.last_submit: float | None = None  # perf_counter at the join, then at each submission

    def halt_seen(self, reason: str) -> None:
        """The run owner halted the run (a 410 from a heartbeat or a request): stop."""
        if self.halted is None:
            log.warning("[%s] the run was halted by its owner (%s): stopping", self.name, reason)
        self.halted = self.halted or reason
        self.stop.set()

    def run_loop(self, max_steps: int | None = None, poll_s: float = 0.3) -> int:
        """Work until stopped (or `max_steps` batches submitted); returns batches sent.
        CoordinatorLost propagates once the trainer is gone for `lost_s`."""
        url = self.server.start() if self.server else None
        self.membership.join("worker", self.name, self.stake, url, device_name(self.device))
        self.last_submit = time.perf_counter()
        done = -1
        try:
            while not self.stop.is_set() and (max_steps is None or len(self.submitted) < max_steps):
                info = self.client.get("/v1/rl/policy", quiet=True)
                if info["version"] <= done:
                    self.stop.wait(poll_s)
                    continue
                done = info["version"]
                self.step(info)
        finally:
            self.membership.leave("shutdown")
            if self.server:
                self.server.close()
            self.fetcher.close()
        return len(self.submitted)

    def step(self, info: dict[str, Any]) -> dict[str, Any] | None:
        """Generate and submit the batch for policy `info` (GET /v1/rl/policy). None when
        the policy could not be had or the batch was refused."""
        v, cid = int(info["version"]), str(info["cid"])
        providers = [*info.get("providers", []), self.trainer_url]
        try:
            size = int(info["size"]) if info.get("size") else None
            model = self.policies.model(cid, list(dict.fromkeys(providers)), size)
        except (BlobError, PolicyError) as e:
            log.warning(
                "[%s - step %d] policy %s refused, not generating: %s", self.name, v, cid[:12], e
            )
            return None
        t0 = time.time()
        started = time.perf_counter()
        batch = self.make_batch(model, v, cid)
        if batch is None:
            return None
        now = time.perf_counter()
        body = {
            "run_id": self.run.run_id,
            "peer_id": self.identity.peer_id,
            "batch": batch.model_dump(mode="json"),
            # what it cost (covey.rl.costs): generating, and the wall time since the last
            # submission (or the join): fetching policies and waiting for a new one
            "compute_s": round(now - started, 6),
            "wall_s": round(now - (self.last_submit or started), 6),
        }
        try:
            reply = self.client.post("/v1/rl/batch", body, round=v)
        except PeerRejected as e:
            log.warning("[%s - step %d] batch refused: %s", self.name, v, e)
            if e.status == 410:
                self.halt_seen(e.message)
            if e.status == 403:
                self.excluded(e.message)
            return None
        log.info(
            "[%s - step %d] submitted %d samples in %.1f s",
            self.name,
            v,
            len(batch.samples),
            time.time() - t0,
        )
        self.last_submit = time.perf_counter()
        if isinstance(reply, dict):
            self.heads.keep(reply.get("ledger_head"), f"step {v}'s receipt")
        self.submitted.append({"step": v, **reply})
        return reply

    def excluded(self, reason: str) -> None:
        """A batch was refused 403: excluded for fraud (or not a worker): nothing more to do."""
        self.stop.set()

    def make_batch(self, model: torch.nn.Module, v: int, cid: str) -> RolloutBatch | None:
        """The batch for step `v` under policy `model` (content id `cid`): the prompts the
        run assigns this worker, G seeded samples each. None: nothing to submit."""
        run = self.run
        return rollout(
            model,
            run.task,
            run.rollout,
            step=v,
            worker_id=self.identity.peer_id,
            policy_version=v,
            policy_cid=cid,
            gen_batch=run.rollout.group_size,  # G samples per forward
            **codec_kwargs(run.model_cfg),  # the policy's tokenizer (bytes for GPT)
        )
