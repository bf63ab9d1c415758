"""What an inference worker and a serving validator share: the server's spec, the model
(a local copy whose content id must be the server's), membership (join, heartbeats in a
thread, the deathrattle) and a stop on the owner's HALT or on exclusion.

Every wait is bounded: the client retries with capped backoff for `lost_s`, then
CoordinatorLost; a long-poll waits at most the server's pull_wait_s plus a margin.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from covey.peer.client import CoordinatorClient, PeerRejected
from covey.serve import model as served
from covey.trust.identity import Identity

log = logging.getLogger("covey.serve.peer")


class ServePeer:
    role = "worker"

    def __init__(
        self,
        url: str,
        identity: Identity,
        model_dir: str | Path,
        *,
        name: str = "peer",
        stake: float = 10.0,
        lost_s: float = 60.0,
        stop: threading.Event | None = None,
    ) -> None:
        """ValueError when the local model is not the one the server serves (its content
        id differs): an honest peer does not start on other weights."""
        self.identity, self.name, self.stake = identity, name, stake
        self.stop = stop or threading.Event()
        self.client = CoordinatorClient(
            url, timeout_s=30.0, lost_s=lost_s, stop=self.stop, identity=identity
        )
        self.spec: dict[str, Any] = self.client.get("/v1/serve/spec")
        self.run_id: str = self.spec["run_id"]
        cid = served.model_cid(model_dir)
        if cid != self.spec["model_cid"]:
            raise ValueError(
                f"{model_dir} is model {cid[:12]}, the server serves {self.spec['model_cid'][:12]}"
            )
        self.model, self.tokenizer = self.load(model_dir)
        self.stopped: str | None = None  # why it stopped: the owner's HALT, an exclusion
        self._beats: threading.Thread | None = None

    def load(self, model_dir: str | Path) -> tuple[Any, Any]:
        return served.load_model(model_dir)

    def join(self) -> None:
        """Join the run and start heartbeating."""
        self.register()
        self._beats = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._beats.start()

    def register(self) -> None:
        """The join request of the current key (covey.serve.house joins again under a new
        key)."""
        ident = self.identity
        if self.role == "validator":
            self.client.post(
                "/v1/serve/validators/join",
                {
                    "run_id": self.run_id,
                    "validator_id": ident.peer_id,
                    "public_key": ident.public_key,
                    "name": self.name,
                    "stake": self.stake,
                },
            )
        else:
            self.client.post(
                "/v1/join",
                {
                    "run_id": self.run_id,
                    "peer_id": ident.peer_id,
                    "public_key": ident.public_key,
                    "name": self.name,
                    "stake": self.stake,
                    "step_time_s": 1.0,
                },
            )

    def body(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "peer_id": self.identity.peer_id}

    def _beat(self) -> None:
        period = float(self.spec["heartbeat_s"])
        while not self.stop.wait(period):
            try:
                self.client.post_once("/v1/heartbeat", self.body(), timeout_s=period)
            except PeerRejected as e:
                self.refused(e)
            except Exception as e:  # the server may be restarting: the next beat retries
                log.debug("heartbeat failed: %s", e)

    def refused(self, e: PeerRejected) -> None:
        """A 410 (halted) or 403 (excluded for fraud) ends this peer; others are logged."""
        if e.status in (403, 410):
            if self.stopped is None:
                log.warning("[%s] stopping: %s", self.name, e.message)
            self.stopped = self.stopped or e.message
            self.stop.set()
        else:
            log.warning("[%s] refused: %s", self.name, e)

    def leave(self, reason: str = "shutdown") -> None:
        self.stop.set()
        try:
            self.client.post_once("/v1/leave", {**self.body(), "reason": reason}, timeout_s=3.0)
        except Exception as e:  # a deathrattle is best effort: the server times us out
            log.debug("leave failed: %s", e)
        self.client.close()
