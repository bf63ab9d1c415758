"""Publishing a worker's contribution: the payload served from its blob server (or
uploaded), its end-state blob (the local-state chain), and the signed submission. Mixed into
covey.peer.worker.Worker, whose attributes it uses. Safe on the overlap's transfer thread: it
touches no live training state.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from covey.algorithms import Contribution, TrainState
from covey.blobs import BlobError
from covey.peer.client import CoordinatorLost, PeerRejected
from covey.peer.heads import HeadKeeper
from covey.peer.worker_types import LocalStates
from covey.protocol import schemas
from covey.trust.identity import request_purpose
from covey.trust.withholding import EVIDENCE_KEEP_ROUNDS

log = logging.getLogger("covey.worker")
# own contribution and end-state blobs kept on the blob server (peers fetch within a round
# or two); a drawn contribution's evidence is kept longer (`_pin`)
KEEP_CONTRIBUTIONS = 8
_PULL_BYTES_S = 1 << 20  # slowest rate a submission's answer may wait on a payload pull at
_UPLOAD_PAUSE_S = 1.0  # between uploads that failed (the coordinator may be restarting)


class Publishing:
    """The publishing half of a worker (see the module docstring)."""

    # set by Worker
    state: TrainState | None
    _local: LocalStates | None
    _published: list[str]
    _pinned: dict[str, int]  # a drawn contribution's evidence (cid -> its round)
    _evidence: set[str]  # the end states served: the blob server paces them
    name: str
    opts: Any
    store: Any
    server: Any
    strategy: Any
    heads: HeadKeeper

    def _upload(self, data: bytes, cid: str) -> None:
        """Upload a blob to the coordinator (a peer without a blob server). A coordinator
        that is restarting refuses connections for a while: the upload is tried again, with
        the client's own retries each time, for up to the run's coordinator_lost_s, and then
        CoordinatorLost, as any request to a coordinator that stays away."""
        patience = self.cfg.limits.coordinator_lost_s
        give_up = time.monotonic() + patience
        while True:
            try:
                self.blobs.upload(
                    self.opts.coordinator, data, cid, signer=(self.identity, self.run_id)
                )
                return
            except BlobError as e:
                if time.monotonic() + _UPLOAD_PAUSE_S > give_up:
                    raise CoordinatorLost(
                        f"no upload of blob {cid[:12]} for {patience:.0f} s: {e}"
                    ) from None
                log.warning("[%s] upload of %s failed, trying again: %s", self.name, cid[:12], e)
                self._pause(_UPLOAD_PAUSE_S)

    def _publish(
        self,
        info: schemas.RoundInfo,
        c: Contribution,
        loss: float,
        compute_s: float,
        wall_s: float,
        commitments: list[dict[str, Any]],
    ) -> bool:
        """Serve the contribution from our blob server (the coordinator pulls it) or upload
        it; then submit its metadata, signed for this round. False when the coordinator
        refused it; PeerRejected when this peer has been excluded from the run."""
        assert self.store is not None and self.state is not None
        path = f"/v1/rounds/{info.round}/contributions"
        payload = self._payload(info, c)
        if payload is None:
            return False
        cid = self.store.put(payload)
        self._published.append(cid)
        while len(self._published) > KEEP_CONTRIBUTIONS:
            old = self._published.pop(0)
            if old not in self._published and old not in self._pinned:
                self.store.delete(old)
                self._evidence.discard(old)
        if self.server is None:
            self._upload(payload, cid)
        local: dict[str, Any] = {}
        if self._local is not None and self._local.end_cid is not None:  # its end state
            end_cid, end_path = self._local.end_cid, self._local.end_path
            if not self._serves_end_state(info.round):
                if end_path is not None:  # named, never served
                    end_path.unlink(missing_ok=True)
            else:
                if end_path is not None and end_path.exists():  # sealed: moved into the store
                    self.store.adopt(end_path, end_cid)
                self._evidence.add(end_cid)  # served at the run's paced rate
                self._published.append(end_cid)
            if self.server is None and end_cid in self._published:
                self._upload(self.store.get(end_cid), end_cid)
            local = {
                "local_state_cid": self._local.start_cid,
                "end_state_cid": end_cid,
                "end_state_size": self._local.end_size,
            }
        body = {
            "run_id": self.run_id,
            "round": info.round,
            "attempt": info.attempt,
            "peer_id": self.peer_id,
            "cid": cid,
            "start_hash": info.start_hash or "",
            "size": len(payload),
            "tokens": c.tokens,
            "inner_steps": c.inner_steps,
            "fragment": c.fragment,
            "train_loss": loss if loss == loss else None,  # NaN: no loss to report
            "compute_s": compute_s,
            "wall_s": wall_s,
            "commitments": commitments,
            **local,
        }
        signed = self._signed(path, body, info.round)
        try:
            # the coordinator may pull the payload from us before it answers (never our
            # local states: drawn validators fetch those later, covey.peer.validator):
            # allow for that at 1 MiB/s (a 124M model's fp32 payload is 500 MB)
            pulled = len(payload)
            pull_s = self.cfg.limits.request_timeout_s + pulled / _PULL_BYTES_S
            reply = self.client.post(path, signed, round=None, timeout_s=pull_s)
        except PeerRejected as e:
            log.warning("[%s - round %d] contribution refused: %s", self.name, info.round, e)
            if e.status == 403:
                raise
            return False
        if isinstance(reply, dict):  # the receipt carries the ledger's signed head
            self.heads.keep(reply.get("ledger_head"), f"round {info.round}'s receipt")
            if reply.get("drawn") is True and local:  # its validators will come for these
                self._pin(info.round, (local["local_state_cid"], local["end_state_cid"]))
        log.info(
            "[%s - round %d] %d steps, loss %.4f, sent %d bytes",
            self.name,
            info.round,
            c.inner_steps,
            loss,
            len(payload),
        )
        return True

    def _pin(self, round_: int, cids: tuple[str | None, ...]) -> None:
        """Keep a drawn contribution's evidence (the start and end states it names) on the
        blob server for EVIDENCE_KEEP_ROUNDS rounds, whatever the pruning of other blobs:
        its validators fetch it after the round, and a worker that no longer has it
        when they come is attested withholding (covey.trust.withholding)."""
        for cid in cids:
            if cid is not None:
                self._pinned[cid] = max(self._pinned.get(cid, round_), round_)
        for cid, pinned_at in list(self._pinned.items()):
            if pinned_at <= round_ - EVIDENCE_KEEP_ROUNDS:
                del self._pinned[cid]
                if cid not in self._published:
                    self.store.delete(cid)
                    self._evidence.discard(cid)

    def _payload(self, info: schemas.RoundInfo, c: Contribution) -> bytes | None:
        """The bytes published for contribution `c` (None: nothing to send this round)."""
        return c.payload

    def _serves_end_state(self, round: int) -> bool:
        """Whether the end local state the contribution names is served: always."""
        return True

    def _signed(self, path: str, body: dict[str, Any], round: int) -> dict[str, Any]:
        """The submission `body`, signed for `round` and the endpoint at `path`."""
        return self.identity.sign_request(body, round, purpose=request_purpose(path))

    def _numel(self) -> int:
        """Elements of this round's contribution (its fragment's parameters)."""
        assert self.state is not None
        names = self.strategy.fragment_names(self.strategy.round_fragment(self.state.round))
        return sum(self.state.params[n].numel() for n in names)
