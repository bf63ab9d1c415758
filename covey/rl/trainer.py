"""The RL trainer (trusted, the run owner): holds the policy, publishes versions on the blob
plane, and takes a GRPO step whenever enough VERIFIED samples are in.

It is built on covey's coordinator host (covey.coordinator.host), not a copy of it:
`Membership` (joins with stake, heartbeats, leaves, signed requests and nonces, the peers
table), `Accounts` (the ledger and the book), `Halt` (the owner's HALT, written by the
learning loop, which stops after it), `BlobStore` (policy versions and submitted batches
by content id). The RL mode's
own parts: `Intake` (covey.rl.intake: submissions, validator assignment and reports,
verdicts written to the ledger) and the learning loop here.

Everything a restarted trainer needs is in its data directory: the SQLite database
(`coordinator.db`: spec, versions, batches, peers, nonces, ledger), the blobs (every
policy version and batch), its key, and the optimizer's moments of the latest version
(covey.rl.moments: safetensors, checked on load), so a restarted trainer's next step is
the one an uninterrupted trainer would take. A run directory without them (an older run)
restarts with fresh moments and says so; moments that do not fit refuse the start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from covey.coordinator.db import Database
from covey.coordinator.host import Host, RunTerms
from covey.coordinator.storage import Storage
from covey.devices import resolve_device, resolve_precision
from covey.protocol.content import content_id
from covey.rl import policy as pol
from covey.rl.batch import RolloutBatch
from covey.rl.costs import record, run_costs
from covey.rl.intake import RL_SCHEMA, Intake
from covey.rl.learning import held_out_pass_at_1, make_learner
from covey.rl.moments import load_moments, moments_path, prune_moments, save_moments
from covey.rl.runspec import (
    NotJudged,
    RLSpec,
    ledger_policy,
    membership_config,
    rollout_spec,
    run_id_of,
    verify_compute,
)
from covey.trust.halt import owner_of
from covey.trust.identity import Identity

log = logging.getLogger("covey.rl.trainer")
KEY_FILE = "trainer.key"
MAX_PEER_PROVIDERS = 4  # peers' blob servers listed per policy version


class Trainer:
    def __init__(
        self,
        data_dir: Path,
        *,
        spec: RLSpec | None = None,
        policy_dir: str | None = None,
        url: str = "",
        device: str = "cpu",
        precision: str = "fp32",
        storage: Storage = Storage(),  # noqa: B008 -- frozen
    ) -> None:
        """Open the run in `data_dir` (and `storage`, covey.coordinator.storage), or create
        it from `spec` and the policy at `policy_dir` (a policy directory or
        covey:<preset>). ValueError when the directory holds no run and no spec/policy is
        given, or holds a run with another spec.
        `device` (covey.devices.resolve_device) holds the policy and its optimizer state;
        `precision` ("fp32", "bf16") is the learning step's forward (DeviceError otherwise)."""
        self.data_dir = Path(data_dir)
        self.url = url
        self._policy0: bytes | None = None  # a new run's first policy, stored once hosted

        def terms(identity: Identity, db: Database) -> RunTerms:
            stored = db.get_meta("rl_spec")
            if stored is None:
                if spec is None or policy_dir is None:
                    raise ValueError(f"{self.data_dir} holds no RL run: give a spec and a --policy")
                self.model_cfg, model = pol.load_policy_dir(policy_dir)
                self._policy0 = pol.policy_bytes(model)
                cid0 = content_id(self._policy0)
                self.spec = spec
                self.run_id = run_id_of(spec, self.model_cfg, cid0, identity.public_key)
            else:
                saved = json.loads(stored)
                self.spec = RLSpec.model_validate(saved["spec"])
                if spec is not None and spec != self.spec:
                    raise ValueError(
                        f"{self.data_dir} holds run {saved['run_id']} with another "
                        f"spec; use another --data-dir"
                    )
                self.model_cfg, self.run_id = saved["model"], saved["run_id"]
            spec_of_run = {"rl": self.spec.model_dump(mode="json"), "model": self.model_cfg}
            return RunTerms(
                run_id=self.run_id,
                owner_key=owner_of(spec_of_run, identity.public_key),
                membership=membership_config(self.spec),
            )

        # the host's parts; the learning loop writes the owner's HALT between steps and
        # takes no step after it
        self.host = host = Host(
            self.data_dir, terms, position=lambda: self.version, key_file=KEY_FILE,
            storage=storage,
        )  # fmt: skip
        self.identity, self.db, self.accounts = host.identity, host.db, host.accounts
        self.blobs, self.membership, self.halt = host.blobs, host.membership, host.halt
        self.stop_event, self._wake = host.stop, host.wake  # _wake: a HALT to write
        with self.db.transaction() as c:
            for statement in RL_SCHEMA:
                c.execute(statement)
        if self._policy0 is not None:
            self._create(self.blobs.put(self._policy0))
            self._policy0 = None
        self.task = self.spec.task.build()
        self.rollout = rollout_spec(self.spec, self.run_id, self.model_cfg["vocab_size"])
        self.lock = threading.RLock()
        rows = self.db.query("SELECT version, cid FROM rl_versions ORDER BY version")
        self.cids = {int(r["version"]): r["cid"] for r in rows}
        self.version = max(self.cids)
        # re-checks and audits run on the run's verify class (a policy version
        # loaded there by policy_at), or not at all: judged elsewhere, rounding could convict
        self.judging = verify_compute(self.spec)
        self._not_judged: set[int] = set()
        if self.judging.refusal is not None:
            log.warning("[trainer] this trainer will not judge batches: %s", self.judging.refusal)
        self.device = resolve_device(device)
        self.policy = pol.load_weights(
            pol.build_policy(self.model_cfg), self.blobs.get(self.cids[self.version])
        ).to(self.device)
        self.learner = make_learner(self.policy, self.spec, self.task, self.model_cfg)
        self.learner.precision = resolve_precision(precision, self.device)
        self._load_moments()
        self.intake = Intake(self)
        self.history: list[dict[str, Any]] = json.loads(self.db.get_meta("rl_history") or "[]")
        self._thread: threading.Thread | None = None
        self._frozen: dict[int, torch.nn.Module] = {}

    def _moments_meta(self, version: int) -> dict[str, str]:
        return {"run_id": self.run_id, "version": str(version), "policy_cid": self.cids[version]}

    def _load_moments(self) -> None:
        """The optimizer moments saved with the current version (MomentsError, a
        ValueError naming the file, when they do not fit the run); fresh ones, with a
        warning, when none were saved (version 0, or a run from before they were)."""
        path = moments_path(self.data_dir, self.version)
        if path.exists():
            n = load_moments(
                self.learner.optimizer, self.policy, path, self._moments_meta(self.version)
            )
            log.info("[trainer - v%d] optimizer moments of %d parameters loaded", self.version, n)
        elif self.version > 0:
            log.warning(
                "[trainer - v%d] no optimizer moments saved with this version (%s): "
                "continuing with fresh moments",
                self.version,
                path,
            )

    def _create(self, cid0: str) -> None:
        now = time.time()
        spec_dict = {"rl": self.spec.model_dump(mode="json"), "model": self.model_cfg}
        with self.accounts.transaction() as c:
            self.accounts.append(
                c,
                "run created",
                {
                    "run_id": self.run_id,
                    "name": self.spec.name,
                    "spec": spec_dict,
                    "coordinator_key": self.identity.public_key,
                    "policy": ledger_policy(self.spec).to_dict(),
                },
                now,
            )
            saved = {
                "spec": self.spec.model_dump(mode="json"),
                "model": self.model_cfg,
                "run_id": self.run_id,
            }
            c.execute("INSERT INTO meta VALUES ('rl_spec', ?)", (json.dumps(saved),))
            c.execute("INSERT OR REPLACE INTO meta VALUES ('run_id', ?)", (self.run_id,))
            c.execute("INSERT INTO rl_versions VALUES (0, ?, ?)", (cid0, now))
            self.accounts.append(
                c, "checkpoint", {"round": 0, "cid": cid0, "weights_hash": cid0}, now
            )
        log.info("[trainer] created run %s: policy v0 %s", self.run_id, cid0[:12])

    # -- what the service and the roles read --------------------------------------------

    def describe(self) -> dict[str, Any]:
        """GET /v1/rl/spec: the run's rules, model, and the trainer's key."""
        return {
            "run_id": self.run_id,
            "spec": self.spec.model_dump(mode="json"),
            "model": self.model_cfg,
            "trainer_key": self.identity.public_key,
        }

    def policy_info(self) -> dict[str, Any]:
        """GET /v1/rl/policy: the current version, its content id, its size and who serves
        it: at most MAX_PEER_PROVIDERS peers that announced a blob server (a different
        draw each version, so many Sybil servers cannot stand before every worker's
        fetch), the trainer last. Any may lie; the hash decides, and a fetch stops at
        `size` bytes."""
        with self.lock:
            v, cid = self.version, self.cids[self.version]
        peers = self.membership.peers.blob_urls(live_role="worker")
        urls = sorted(
            set(peers.values()),
            key=lambda u: hashlib.sha256(f"{cid}|{u}".encode()).digest(),
        )[:MAX_PEER_PROVIDERS]
        providers = urls + ([self.url] if self.url else [])
        return {"version": v, "cid": cid, "size": self.blobs.size(cid), "providers": providers}

    def policy_at(self, version: int) -> torch.nn.Module:
        """The frozen policy of `version` (cached while it can still be checked against), on
        the run's verify device class; NotJudged when this machine has none."""
        if self.judging.device is None:  # NotJudged: the batch stays undecided
            if version not in self._not_judged:  # once per version: the loop retries often
                self._not_judged.add(version)
                log.warning("[trainer - v%d] batches not judged: %s", version, self.judging.refusal)
            raise NotJudged(str(self.judging.refusal))
        with self.lock:
            model = self._frozen.get(version)
            if model is None:
                model = pol.load_weights(
                    pol.build_policy(self.model_cfg), self.blobs.get(self.cids[version])
                ).to(self.judging.device)
                self._frozen[version] = model
                for old in [v for v in self._frozen if v < self.version - self.spec.async_level]:
                    del self._frozen[old]
            return model

    # -- the learning loop ----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rl-learn", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.host.close()

    def _loop(self) -> None:
        if not any(h.get("pass_at_1") is not None for h in self.history):
            self._evaluate(record=True)
        while not self.stop_event.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            try:
                self.halt.enforce(time.time())
                if self.halt.halted is not None:
                    log.warning("[trainer - v%d] the run is halted: no more steps", self.version)
                    return
                self.intake.expire(time.time())
                self.step_if_ready()
            except Exception:  # the loop must outlive one bad step; the error is logged
                log.exception("[trainer - v%d] step failed", self.version)
                self.stop_event.wait(1.0)

    def step_if_ready(self) -> dict[str, Any] | None:
        """Train on accepted batches if they hold samples_per_step samples (batches older
        than version - async_level are dropped first); publish version + 1. None if not
        enough verified samples are in yet."""
        with self.lock:
            oldest = self.version - self.spec.async_level
            with self.db.transaction() as c:
                dropped = c.execute(
                    "UPDATE rl_batches SET status = 'dropped' WHERE status = "
                    "'accepted' AND step < ?",
                    (oldest,),
                ).rowcount
            if dropped:
                log.info("[trainer - v%d] dropped %d stale batches", self.version, dropped)
            rows = self.db.query(
                "SELECT id, step, cid, samples FROM rl_batches WHERE status = "
                "'accepted' ORDER BY id"
            )
            if sum(r["samples"] for r in rows) < self.spec.samples_per_step:
                return None
            batches = [
                (RolloutBatch.model_validate_json(self.blobs.get(r["cid"])), r["step"])
                for r in rows
            ]
            t0 = time.time()
            stats = self.learner.step(batches, self.version)
            cid = self.blobs.put(pol.policy_bytes(self.policy))
            meta = {"run_id": self.run_id, "version": str(self.version + 1), "policy_cid": cid}
            save_moments(  # before the version is committed: a crash leaves v's file
                self.learner.optimizer,
                self.policy,
                moments_path(self.data_dir, self.version + 1),
                meta,
            )
            now = time.time()
            with self.accounts.transaction() as c:
                c.execute("INSERT INTO rl_versions VALUES (?, ?, ?)", (self.version + 1, cid, now))
                record(c, "step", now - t0)  # covey.rl.costs: the trainer's step is useful
                ids = [r["id"] for r in rows]
                c.execute(
                    f"UPDATE rl_batches SET status = 'consumed', consumed_by = ? WHERE id "
                    f"IN ({','.join('?' * len(ids))})",
                    (self.version + 1, *ids),
                )
                self.accounts.append(
                    c,
                    "checkpoint",
                    {"round": self.version + 1, "cid": cid, "weights_hash": cid},
                    now,
                )
            self.cids[self.version + 1] = cid
            self.version += 1
            prune_moments(self.data_dir, self.version)
            rewards = [s.reward for b, _ in batches for s in b.samples]
            entry = {
                "version": self.version,
                "at": now,
                "batches": len(batches),
                "samples": len(rewards),
                "reward": sum(rewards) / len(rewards),
                "step_s": now - t0,
                "loss": float(stats.get("loss", 0.0)),
                "pass_at_1": None,
            }
            self.history.append(entry)
        log.info(
            "[trainer - v%d] stepped on %d batches, %d samples, reward %.3f",
            self.version,
            len(batches),
            len(rewards),
            entry["reward"],
        )
        if self.version % self.spec.eval_every == 0:
            self._evaluate(record=False)
        self._save_history()
        return entry

    def _evaluate(self, record: bool) -> None:
        with self.lock:
            score = held_out_pass_at_1(self.policy, self.spec, self.task, self.model_cfg)
            if record or not self.history:
                self.history.append(
                    {"version": self.version, "at": time.time(), "pass_at_1": score}
                )
            else:
                self.history[-1]["pass_at_1"] = score
        log.info("[trainer - v%d] pass@1 on held-out prompts: %s", self.version, score)
        self._save_history()

    def _save_history(self) -> None:
        with self.db.transaction() as c:
            c.execute(
                "INSERT OR REPLACE INTO meta VALUES ('rl_history', ?)",
                (json.dumps(self.history[-500:]),),
            )

    # -- the status page ---------------------------------------------------------------

    def costs(self) -> dict[str, Any]:
        """covey.rl.costs over the run so far (one grouped query)."""
        return run_costs(self.db).as_dict()

    def status(self) -> dict[str, Any]:
        """GET /v1/rl/status: version, reward and pass@1 curves, batches by status and
        rejection reason, every account's standing."""
        counts = {
            r["status"]: r["n"]
            for r in self.db.query("SELECT status, COUNT(*) AS n FROM rl_batches GROUP BY status")
        }
        reasons = {
            r["problem"]: r["n"]
            for r in self.db.query(
                "SELECT problem, COUNT(*) AS n FROM rl_batches WHERE status = 'rejected' "
                "GROUP BY problem"
            )
        }
        evals = [h for h in self.history if h.get("pass_at_1") is not None]
        summary = self.accounts.book.summary()
        return {
            "run_id": self.run_id,
            "model_name": pol.policy_name(self.model_cfg),
            "parameters": sum(p.numel() for p in self.policy.parameters()),
            "halted": self.halt.halted,  # the owner's HALT ({index, round, reason}) or None
            "version": self.version,
            "verify_device": self.spec.verify_device,
            "judging": self.judging.refusal or f"on {self.judging.device}",
            "batches": counts,
            "accepted": sum(counts.get(k, 0) for k in ("accepted", "consumed", "dropped")),
            "rejected": counts.get("rejected", 0),
            "rejected_by_reason": reasons,
            "audits": self.intake.judge.audits,
            "canaries": self.intake.canaries.counts(),
            "costs": self.costs(),  # the decentralization multiplier (covey.rl.costs)
            "pass_at_1": [(h["version"], h["pass_at_1"]) for h in evals],
            "reward": [(h["version"], h["reward"]) for h in self.history if "reward" in h],
            "accounts": summary["accounts"],
            "totals": summary["totals"],
        }
