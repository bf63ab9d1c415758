"""A worker that cheats, for tests and demos (`covey worker --behavior ...`).

`CheatingWorker` is the honest `covey.peer.worker.Worker` with the hooks where a dishonest
participant would lie overridden by the behaviors of covey.peer.adversary (what each one
does is listed there): which data it trains on and how many steps it really takes, what it
claims, the local state it starts from, the bytes it publishes, whether it serves its end
state, and the requests it replays. The honest worker imports nothing of this; the CLI
builds one or the other with `build_worker`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from covey.algorithms import Contribution
from covey.peer import adversary
from covey.peer.client import PeerRejected
from covey.peer.overlap import SideCommitter
from covey.peer.worker import Worker, WorkerOptions
from covey.peer.worker_types import Finished, LocalStates
from covey.protocol import schemas
from covey.protocol.content import content_id
from covey.trust import verify
from covey.trust.committer import Committer
from covey.trust.evidence import evidence_of

log = logging.getLogger("covey.worker")


def build_worker(opts: WorkerOptions) -> Worker:
    """The honest Worker for `opts.behavior` "honest", else the CheatingWorker that plays
    it. ValueError for a behavior that is not a plain, late or intermittent one."""
    if opts.behavior == "honest":
        return Worker(opts)
    return CheatingWorker(opts)


class CheatingWorker(Worker):
    """A worker playing `opts.behavior` (covey.peer.adversary.BEHAVIORS, or a late or
    intermittent schedule of one of them)."""

    def __init__(self, opts: WorkerOptions) -> None:
        super().__init__(opts)
        self._last_payload: bytes | None = None  # stale
        self._last_request: tuple[str, dict[str, Any]] | None = None  # replay
        self._last_certificate: schemas.Certificate | None = None  # copycat

    def _check_behavior(self, spec: str) -> None:
        adversary.check_behavior(spec)  # ValueError: a plain, late or intermittent one

    def _behavior(self, round: int) -> str:
        """What this worker does in `round`: its behavior, or "honest" outside a schedule's
        cheating rounds."""
        return adversary.behavior_at(self.opts.behavior, round, self.peer_id)

    # -- training ---------------------------------------------------------------------------

    def _overlaps(self) -> bool:
        return False  # a cheat's rounds are published one at a time

    def _chained_start(self, chain: LocalStates) -> tuple[dict[str, torch.Tensor], str | None]:
        if self.opts.behavior not in adversary.STATE_CHEATS:
            return super()._chained_start(chain)
        start = adversary.forge_local_state(chain.end)
        if self.opts.behavior == "unchained":  # names the forged state
            named = evidence_of(self.strategy, start)
            return start, content_id(verify.local_state_to_bytes(named))
        return start, chain.end_cid  # names the committed state

    def _work(self, info: schemas.RoundInfo) -> tuple[str, int]:
        key, steps = super()._work(info)
        behavior = self._behavior(info.round)
        return adversary.data_key(behavior, key), adversary.steps_taken(behavior, steps)

    def _claims(
        self,
        info: schemas.RoundInfo,
        done: int,
        committer: Committer | SideCommitter,
        commitments: list[dict[str, Any]],
    ) -> tuple[int, list[dict[str, Any]]]:
        assert info.assignment is not None
        if self._behavior(info.round) not in ("lazy", "free-rider"):
            return done, commitments
        claimed = info.assignment.inner_steps  # all of them, whatever was taken
        if claimed == done:
            return done, commitments
        padded = adversary.pad_commitments(
            [c.to_dict() for c in committer.recorded],
            verify.commitment_steps(claimed, self.cfg.trust.commit_every),
        )
        return claimed, padded

    def _settle(self, f: Finished, adopt: bool) -> str:
        if f.certificate is not None:
            self._last_certificate = f.certificate
        return super()._settle(f, adopt)

    # -- publishing -------------------------------------------------------------------------

    def _publish(
        self,
        info: schemas.RoundInfo,
        c: Contribution,
        loss: float,
        compute_s: float,
        wall_s: float,
        commitments: list[dict[str, Any]],
    ) -> bool:
        if self.opts.behavior == "replay" and self._last_request is not None:
            old_path, old_body = self._last_request  # sent again verbatim, signature and all
            try:
                self.client.post_once(old_path, old_body, timeout_s=self.heartbeat_s, round=None)
            except PeerRejected as e:
                log.warning("[%s - round %d] replay refused: %s", self.name, info.round, e)
            return False
        return super()._publish(info, c, loss, compute_s, wall_s, commitments)

    def _payload(self, info: schemas.RoundInfo, c: Contribution) -> bytes | None:
        behavior = self._behavior(info.round)
        payload = c.payload
        if behavior in adversary.PAYLOAD_CHEATS and behavior != "free-rider":
            numel = self._numel()
            payload = adversary.forge_payload(
                behavior, payload, self.strategy.codec, numel, info.round
            )
        elif behavior == "stale":
            payload, self._last_payload = self._last_payload or payload, payload
        elif behavior == "copycat":
            theirs = [
                a
                for a in (self._last_certificate.accepted if self._last_certificate else [])
                if a.peer_id != self.peer_id
            ]
            if not theirs:
                log.info("[%s - round %d] nothing to copy yet", self.name, info.round)
                return None
            victim = theirs[0]
            sources = [*victim.providers, self.opts.coordinator]
            payload = self.blobs.fetch(victim.cid, sources, size=victim.size)
        return payload

    def _serves_end_state(self, round: int) -> bool:
        return self._behavior(round) != "withhold"

    def _signed(self, path: str, body: dict[str, Any], round: int) -> dict[str, Any]:
        signed = super()._signed(path, body, round)
        self._last_request = (path, signed)
        return signed
