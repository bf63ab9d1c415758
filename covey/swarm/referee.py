"""The referee for duplicated microbatches: recompute a stage's reply from the signed
request and the state the servers claimed, and name whoever answered otherwise.

A dispute carries the request body (base64), and per server its reply body, the state id
it claimed and its signature over (stage, state, sha256(request), sha256(reply))
(covey.swarm.wire.reply_message). A reply whose signature does not verify is nobody's and
convicts nobody. The state is fetched by content id from the stage's servers' blob
servers (hash-checked by BlobClient), loaded into a fresh stage, and the request is
recomputed with covey.swarm.compute, the same code the servers run. A reply farther than
`tolerance` (relative L2, covering 8-bit rounding and thread-count noise) is a lie.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import threading
from typing import Any

from covey.blobs import BlobClient
from covey.blobs.store import BlobError
from covey.coordinator.rejected import Rejected
from covey.devices import referee_compute
from covey.swarm import compute
from covey.swarm.config import SwarmConfig
from covey.swarm.wire import WireError, build_stage, load_state, reply_message, sha
from covey.trust.identity import verify

log = logging.getLogger("covey.swarm.referee")
KEEP_STATES = 3  # stage states kept after a recomputation (rounds may move on meanwhile)
FAR = 1e30  # the distance written for a reply that is no reply (inf, nan)


class Referee:
    def __init__(self, cfg: SwarmConfig, device: str | None = None) -> None:
        """`device` (the coordinator's --device; default the run's `verify_device`) is
        where replies are recomputed. A coordinator without that class warns now and
        judges nothing: a dispute then convicts nobody (covey.devices.referee_compute).
        DeviceError for a malformed or absent `device`."""
        self.cfg = cfg
        self.compute = referee_compute(cfg.verify_device, "fp32", device)
        if self.compute.refusal is not None:
            log.warning("this swarm coordinator will not judge disputes: %s", self.compute.refusal)
        self.fetcher = BlobClient(timeout_s=cfg.request_timeout_s, retries=2)
        self._states: dict[str, bytes] = {}  # the last KEEP_STATES recomputed on
        self._lock = threading.Lock()  # one recomputation at a time: it is CPU work

    def settle(
        self, body: dict[str, Any], keys: dict[str, str], providers: list[str]
    ) -> dict[str, Any]:
        """{"liars": [...], "honest": [...], "detail": str}. Rejected(400) for a malformed
        dispute, Rejected(409) when the claimed state cannot be had from any provider."""
        cfg, kind = self.cfg, body.get("kind")
        try:
            k = int(body["stage"])
            request = base64.b64decode(body["request"], validate=True)
            replies = [
                (
                    str(r["server"]),
                    str(r["state"]),
                    base64.b64decode(r["reply"], validate=True),
                    str(r["sig"]),
                )
                for r in body["replies"]
            ]
        except (KeyError, TypeError, ValueError, binascii.Error) as e:
            raise Rejected(400, f"malformed dispute: {e}") from None
        if kind not in ("forward", "backward") or not 0 <= k < cfg.stages or len(replies) < 2:
            raise Rejected(
                400, f"dispute kind {kind!r} stage {k}: need forward|backward, 2 replies"
            )
        signed = [
            (srv, st, rep)
            for srv, st, rep, sig in replies
            if srv in keys and verify(keys[srv], reply_message(k, st, sha(request), sha(rep)), sig)
        ]
        if len({st for _, st, _ in signed}) != 1 or len(signed) < 2:
            return {
                "liars": [],
                "honest": [s for s, _, _ in signed],
                "detail": "fewer than two signed replies on one state: nothing to settle",
            }
        if self.compute.refusal is not None:  # not recomputed on another class: open
            return {"liars": [], "honest": [], "detail": f"not judged: {self.compute.refusal}"}
        state = signed[0][1]
        with self._lock:
            try:
                data = self._states.get(state) or self.fetcher.fetch(state, providers)
            except BlobError as e:
                raise Rejected(409, f"stage {k} state {state[:12]} unavailable: {e}") from None
            self._states.pop(state, None)  # the last few: a conviction keeps its state
            self._states[state] = data
            while len(self._states) > KEEP_STATES:
                self._states.pop(next(iter(self._states)))
            stage = build_stage(cfg, k, self.compute.device or "cpu")
            try:
                load_state(stage, data)
                run = compute.forward if kind == "forward" else compute.backward
                truth = run(cfg, k, stage, request)
            except WireError as e:  # the request itself is bad: the trainer's fault
                return {"liars": [], "honest": [], "detail": f"request does not compute: {e}"}
        dist = {srv: compute.reply_distance(rep, truth) for srv, _, rep in signed}
        liars = sorted(s for s, d in dist.items() if not d <= cfg.tolerance)
        honest = sorted(s for s, d in dist.items() if d <= cfg.tolerance)
        detail = ", ".join(f"{s[:8]}: {d:.3g}" for s, d in sorted(dist.items()))
        # finite, for JSON (a malformed reply is infinitely far: a liar all the same)
        far = {s: d if math.isfinite(d) else FAR for s, d in dist.items()}
        return {"liars": liars, "honest": honest, "detail": f"{kind} stage {k}: {detail}",
                "distances": far}  # fmt: skip

    def state_bytes(self, state: str) -> bytes | None:
        """The bytes of the stage state the last settled dispute was recomputed on (kept
        as a conviction's evidence), or None."""
        with self._lock:
            return self._states.get(state)
