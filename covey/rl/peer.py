"""What a rollout worker and a validator share: the trainer's spec, membership (join,
heartbeats, the deathrattle) and policies fetched by content id.

Every wait is bounded: the trainer client retries with capped backoff for `lost_s`, then
`CoordinatorLost`; blob fetches try each provider a bounded number of times and accept
only bytes whose sha256 is the content id, so a provider serving a corrupt policy is
skipped and another tried; a policy that hashes right but does not load (wrong shapes,
NaN) is refused. Nothing is generated or checked on a policy that failed either test.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from covey.blobs import BlobClient, BlobError, BlobStore
from covey.peer.client import CoordinatorClient, PeerRejected
from covey.rl import policy as pol
from covey.rl.batch import RolloutSpec
from covey.rl.runspec import RLSpec, rollout_spec
from covey.rl.tasks import Task
from covey.trust.identity import Identity

log = logging.getLogger("covey.rl.peer")


@dataclass
class RunInfo:
    run_id: str
    spec: RLSpec
    model_cfg: dict[str, Any]
    trainer_key: str
    task: Task
    rollout: RolloutSpec


def read_run(client: CoordinatorClient, run_id: str | None = None) -> RunInfo:
    """The trainer's spec; ValueError if `run_id` is given and differs, or the spec does
    not hash to the id the trainer claims is checked by the trainer's key in the ledger."""
    d = client.get("/v1/rl/spec")
    if run_id is not None and d["run_id"] != run_id:
        raise ValueError(f"trainer serves run {d['run_id']}, not --run-id {run_id}")
    spec = RLSpec.model_validate(d["spec"])
    pol.config_of(d["model"])  # PolicyError for a model this covey cannot build
    return RunInfo(
        d["run_id"],
        spec,
        d["model"],
        d["trainer_key"],
        spec.task.build(),
        rollout_spec(spec, d["run_id"], int(d["model"]["vocab_size"])),
    )


class Membership:
    """Join (worker or validator), heartbeat in a thread, leave on close."""

    def __init__(
        self,
        client: CoordinatorClient,
        identity: Identity,
        run: RunInfo,
        on_halted: Callable[[str], None] | None = None,
    ) -> None:
        """`on_halted(reason)` is called once a heartbeat is answered 410: the run owner
        halted the run (covey.coordinator.halt)."""
        self.client, self.identity, self.run = client, identity, run
        self.on_halted = on_halted
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def join(
        self,
        role: str,
        name: str,
        stake: float,
        blob_url: str | None = None,
        device: str = "cpu",
    ) -> None:
        """Join as `role`; a worker reports `device` (covey.devices.device_name) to the
        status page."""
        ident = self.identity
        if role == "validator":
            self.client.post(
                "/v1/rl/validators/join",
                {
                    "run_id": self.run.run_id,
                    "validator_id": ident.peer_id,
                    "public_key": ident.public_key,
                    "name": name,
                    "stake": stake,
                },
            )
        else:
            body: dict[str, Any] = {
                "run_id": self.run.run_id,
                "peer_id": ident.peer_id,
                "public_key": ident.public_key,
                "name": name,
                "stake": stake,
                "device": device,
                "step_time_s": 1.0,
                "accepts_connections": blob_url is not None,
            }
            if blob_url:
                body["blob_url"] = blob_url
            self.client.post("/v1/join", body)
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        period = self.run.spec.heartbeat_s
        while not self.stop.wait(period):
            try:
                self.client.post_once(
                    "/v1/heartbeat",
                    {"run_id": self.run.run_id, "peer_id": self.identity.peer_id},
                    timeout_s=period,
                )
            except PeerRejected as e:
                log.warning("heartbeat refused: %s", e)
                if e.status == 410 and self.on_halted is not None:  # halted by its owner
                    self.on_halted(e.message)
                    return
            except Exception as e:  # the trainer may be restarting: the next beat retries
                log.debug("heartbeat failed: %s", e)

    def leave(self, reason: str = "shutdown") -> None:
        self.stop.set()
        try:
            self.client.post_once(
                "/v1/leave",
                {"run_id": self.run.run_id, "peer_id": self.identity.peer_id, "reason": reason},
                timeout_s=3.0,
            )
        except Exception as e:  # a deathrattle is best effort: the trainer times us out
            log.debug("leave failed: %s", e)


class PolicyCache:
    """Policies by content id: fetched from the providers (verified by hash), kept in a
    local blob store (which a worker may serve to others), loaded into models."""

    def __init__(
        self,
        run: RunInfo,
        store: BlobStore,
        fetcher: BlobClient,
        device: torch.device | str = "cpu",
    ) -> None:
        self.run, self.store, self.fetcher = run, store, fetcher
        self.device = torch.device(device)  # where loaded policies compute
        self._models: dict[str, torch.nn.Module] = {}

    def model(self, cid: str, providers: list[str], size: int | None = None) -> torch.nn.Module:
        """The policy with content id `cid`. BlobError when no provider serves bytes with
        that hash (a provider sending more than `size` bytes, the trainer's figure, fails
        at once: a peer's server cannot stream a worker out of memory); PolicyError when
        they do not load into the run's model."""
        if cid in self._models:
            return self._models[cid]
        if not self.store.has(cid):
            data = self.fetcher.fetch(cid, providers, size)
            self.store.put_verified(cid, data)
        model = pol.load_weights(pol.build_policy(self.run.model_cfg), self.store.get(cid))
        model = model.to(self.device)
        self._models = {cid: model, **dict(list(self._models.items())[-3:])}
        return model


__all__ = ["BlobError", "Membership", "PolicyCache", "RunInfo", "read_run"]
