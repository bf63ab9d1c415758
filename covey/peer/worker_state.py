"""A worker's canonical state: syncing to a round's start, the certificate, the certified
weights (computed from the accepted set, else downloaded), receipts, and serving the state
to joiners. Mixed into covey.peer.worker.Worker, whose attributes it uses (set up in
`Worker._setup`); `_round_result` reads only `self.state`, never the live model, so it may
run on the overlap's transfer thread (covey.peer.overlap). A plain round's hash check and
serving run on a background thread while the next round trains (covey.peer.pending_check).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from covey.algorithms import Contribution, TrainState
from covey.blobs import BlobError
from covey.peer.client import CoordinatorLost, PeerRejected
from covey.peer.heads import HeadKeeper
from covey.peer.pending_check import CheckTimeout, PendingCheck
from covey.peer.worker_types import Stopped
from covey.protocol import schemas
from covey.protocol.checkpoint import (
    CheckpointError,
    FileTensors,
    max_state_bytes,
    state_from_file,
    state_to_file,
)
from covey.trust import ledger
from covey.trust.certify import certificate_is_signed
from covey.trust.identity import canonical_json
from covey.trust.polls import ROUND_POLL, poll_headers

log = logging.getLogger("covey.worker")
ROUND_WAIT_S = 5.0  # a waiting worker's round long-poll: woken at once by a change
CHECK_WAIT_S = 600.0  # the most the training thread waits for a pending hash check


class StateKeeping:
    """The canonical-state half of a worker (see the module docstring)."""

    # set by Worker
    state: TrainState | None
    state_hash: str | None
    _published: list[str]
    _served_state: str | None
    _trained_since_adopt: bool
    _pending: tuple[PendingCheck, schemas.Certificate] | None  # covey.peer.pending_check
    name: str
    opts: Any
    store: Any
    server: Any
    strategy: Any
    heads: HeadKeeper

    def _round_view(self, after: str | None = None, wait_s: float = 0.0) -> schemas.RoundInfo:
        """GET /v1/round. With `after` (a tag this worker saw), a long-poll: held until
        there is news for this worker (a round it is a member of opened; the run finished
        or was halted) or about `wait_s` passes, and signed, so it counts against it."""
        params: dict[str, Any] = {"peer_id": self.peer_id}
        headers = None
        if after and wait_s > 0:
            params |= {"after": after, "wait": round(min(wait_s, 30.0), 3)}
            headers = poll_headers(self.identity, self.run_id, path=ROUND_POLL)
        sent = time.monotonic()
        got = self.client.get("/v1/round", params=params, quiet=bool(headers), headers=headers)
        info = schemas.RoundInfo.model_validate(got)
        if headers and info.tag == after and time.monotonic() - sent < min(1.0, wait_s / 2):
            # answered without news and without being held (every long-poll slot of the
            # coordinator is taken): poll at the old pace instead of spinning
            self._pause(min(1.0, wait_s / 2))
        return info

    def _sync_state(self, cid: str, digest: str, size: int, providers: list[str]) -> None:
        """Make the local canonical state the round's start state (download if needed). A
        model that trained in a round that was then aborted goes back to it as well."""
        if self.state_hash == digest:
            if self._trained_since_adopt:
                assert self.state is not None
                self.strategy.load_state(self.state)
                self._trained_since_adopt = False
            return
        state = self._download_state(cid, size, providers)
        if state.digest() != digest:
            raise RuntimeError(f"state {cid[:12]} does not hash to the round's {digest[:12]}")
        self.state, self.state_hash = state, digest
        self.strategy.load_state(state)
        self._trained_since_adopt = False
        log.info("[%s] loaded canonical state of round %d (%s)", self.name, state.round, cid[:12])

    def _download_state(self, cid: str, size: int, providers: list[str]) -> TrainState:
        sources = [p for p in providers if p != self.blob_url] + [self.opts.coordinator]
        assert self.store is not None
        try:
            before = dict(self.blobs.served)
            # streamed to disk, hashed on arrival; bounded by the model, not the blob cap
            path = self.blobs.fetch_into(
                self.store, cid, sources, size=size, max_bytes=max_state_bytes(self.template)
            )
            served = {u: n - before.get(u, 0) for u, n in self.blobs.served.items()}
            log.info(
                "[%s] fetched state %s (%d bytes) from %s",
                self.name,
                cid[:12],
                size,
                ", ".join(f"{u} ({n} B)" for u, n in served.items() if n) or "?",
            )
            state = state_from_file(path, self.template)
        except (BlobError, CheckpointError) as e:
            raise RuntimeError(f"could not get canonical state {cid[:12]}: {e}") from None
        self._keep_state(cid)
        self._outer_on_disk(state, cid)
        return state

    def _await_certificate(self, info: schemas.RoundInfo) -> schemas.Certificate | None:
        """Poll for the round's certificate until it exists, or the round turns out to
        have been aborted and reopened (None), bounded by the deadline plus the time a
        coordinator may take to close and to come back after a restart."""
        limit = (info.deadline_in_s or 0) + self.cfg.limits.coordinator_lost_s
        give_up = time.monotonic() + limit
        while time.monotonic() < give_up:
            if self.stop.is_set():  # a signal or a HALT: no certificate is coming for us
                raise Stopped()
            try:
                body = self.client.get(
                    f"/v1/rounds/{info.round}/certificate",
                    params={"wait": 5, "peer_id": self.peer_id},
                    quiet=True,  # signed: long-polls count per peer (covey.trust.polls)
                    headers=poll_headers(self.identity, self.run_id, info.round),
                )
                cert = schemas.Certificate.model_validate(body)
                if not certificate_is_signed(cert, self.coordinator_key):
                    raise RuntimeError(
                        f"round {info.round}'s certificate is not signed by the run's "
                        f"coordinator key {self.coordinator_key[:12]}"
                    )
                if cert.ledger_head is not None:
                    where = f"round {cert.round}'s certificate"
                    self.heads.keep(cert.ledger_head.model_dump(), where)
                return cert
            except PeerRejected as e:
                if e.status != 404:
                    raise
            now = self._round_view()
            if now.phase == "halted":
                self.halted = now.halted or "halted"
                raise Stopped()
            if (now.round, now.attempt) != (info.round, info.attempt) and now.round <= info.round:
                log.warning("[%s] round %d was aborted; rejoining", self.name, info.round)
                return None
            self._pause(0.05)
        raise CoordinatorLost(f"no certificate for round {info.round} after {limit:.0f} s")

    def _round_result(
        self, cert: schemas.Certificate, consume: bool = False, defer: bool = False
    ) -> tuple[TrainState, str, bool]:
        """The certified weights: the accepted set applied to our start state, checked
        against the certificate's hash; on a mismatch (or a start that differs) the
        canonical state downloaded instead. -> (state, its hash, downloaded). Reads only
        self.state, never the live model: safe on a transfer thread. `consume`: the start
        state is emptied as the new one is made (when nothing else reads it meanwhile).
        `defer`: the hash check and the serving run on a background thread
        (covey.peer.pending_check) and the certificate's hash is returned at once; the
        caller settles the check (`_settle_check`) before it publishes from that state."""
        self._settle_check()  # the start state is checked before anything is built on it
        assert self.state is not None and self.store is not None
        if self.state_hash != cert.start_hash:  # we missed something: take the result
            return self._canonical(cert, "local start state differs from the certificate's")
        above = self.cfg.trust.sharded_above_peers
        if above and len(cert.accepted) >= above:  # shard by shard (docs/sharded-aggregation.md)
            sharded = self._sharded_result(cert)
            if sharded is not None:
                return sharded
        contributions = []
        fetched = []  # others' contributions: dropped once applied
        for a in cert.accepted:
            sources = [p for p in a.providers if p != self.blob_url] + [self.opts.coordinator]
            if not self.store.has(a.cid):
                self.blobs.fetch_into(self.store, a.cid, sources, size=a.size)
                fetched.append(a.cid)
            # mapped from disk, not read into memory: N contributions are not N in RAM
            payload = self.store.view(a.cid)
            contributions.append(Contribution(payload, a.tokens, a.inner_steps, a.fragment))
        if consume:  # the result replaces the start state: not both in memory
            self.state_hash = None  # the start state is emptied: a retry downloads it
            new_state = self.strategy.apply_round_consuming(self.state, contributions)
        else:
            new_state = self.strategy.apply_round(self.state, contributions)
        for cid in fetched:
            if cid not in self._published:
                self.store.delete(cid)
        if defer:  # hashed and served while the next round trains
            self._defer_check(cert, new_state, len(contributions))
            return new_state, cert.new_hash, False
        new_hash = new_state.digest()
        matched = new_hash == cert.new_hash
        self._record(cert, new_hash, matched)
        if not matched:
            return self._canonical(cert, f"weights hash {new_hash[:12]} != certificate's")
        self._serve_state(new_state, cert.new_cid)
        self._log_applied(cert, len(contributions))
        return new_state, new_hash, False

    def _log_applied(self, cert: schemas.Certificate, n: int) -> None:
        log.info(
            "[%s - round %d] applied %d contributions on %s; weights %s match the certificate",
            self.name,
            cert.round,
            n,
            self.strategy.round_computed_on or "the host",  # covey/algorithms/device_round.py
            cert.new_hash[:12],
        )

    def _defers_check(self) -> bool:
        """Whether a plain round's hash check runs behind the next round: every strategy
        but Streaming DiLoCo's, whose rounds keep their own order (covey.peer.overlap)."""
        return not hasattr(self.strategy, "merge_late")

    def _defer_check(self, cert: schemas.Certificate, state: TrainState, n: int) -> None:
        """Start the one pending check of `state` against `cert` (covey.peer.pending_check):
        its digest recorded in applied.jsonl, and when it matches, the state served."""
        assert self._pending is None, "a hash check is pending already"

        def on_match(s: TrainState, _digest: str) -> None:
            self._serve_state(s, cert.new_cid)
            self._log_applied(cert, n)

        check = PendingCheck(
            cert.round, state, cert.new_hash, on_match,
            lambda digest, matched: self._record(cert, digest, matched),
        )  # fmt: skip
        self._pending = (check.start(), cert)

    def _settle_check(self) -> bool:
        """Wait for the pending hash check, if any (at most CHECK_WAIT_S, then a
        RuntimeError). True when it refuted the state: the worker is then back on the
        canonical state, downloaded as on any mismatch, and marked to reload it, so the
        work trained from the refuted state must be discarded by the caller."""
        pending = self._pending
        if pending is None:
            return False
        check, cert = pending
        try:
            outcome = check.result(CHECK_WAIT_S)
        except CheckTimeout as e:
            raise RuntimeError(str(e)) from None
        finally:
            self._pending = None
        if outcome.matched:
            return False
        why = f"weights hash {outcome.digest[:12]} != certificate's"
        self.state, self.state_hash, _ = self._canonical(cert, why)
        self._trained_since_adopt = True  # the model trained from the refuted state
        return True

    def _sharded_result(self, cert: schemas.Certificate) -> tuple[TrainState, str, bool] | None:
        """The new state of a sharded round, fetched shard by shard and checked against
        the signed shard certificate (covey.peer.aggregator); None: the round was not
        sharded (apply it as usual); the canonical state when the shards cannot be had."""
        from covey.peer.aggregator import ShardFetchError, fetch_round_shards

        assert self.state is not None
        try:
            board = self.client.get(f"/v1/shards/{cert.round}", quiet=True)
        except PeerRejected:
            return None
        momentum = getattr(self.cfg.algorithm, "outer_momentum", 0.0) != 0
        try:
            state = fetch_round_shards(board, cert.new_hash, self.opts.coordinator,
                self.coordinator_key, self.state, list(self.strategy.names), momentum)  # fmt: skip
        except (ShardFetchError, ValueError) as e:
            return self._canonical(cert, f"sharded state: {e}")
        if state is None:
            return None
        self._record(cert, cert.new_hash, True)
        self._serve_state(state, cert.new_cid)
        log.info("[%s - round %d] assembled %d certified shards; weights %s", self.name,
                 cert.round, len(board["certificate"]["shards"]), cert.new_hash[:12])  # fmt: skip
        return state, cert.new_hash, False

    def _keep_receipt(self, round_: int) -> None:
        """Fetch the signed ledger entry that accepted our contribution and keep it in
        <store>/receipts.jsonl once its hash and the coordinator's signature check out."""
        try:
            entry = self.client.get(
                "/v1/ledger/receipt", params={"round": round_, "peer_id": self.peer_id}
            )
            parsed = ledger.parse_line(canonical_json(entry), entry.get("index", 0))
            ledger.check_entry(parsed, self.coordinator_key)
        except (PeerRejected, ledger.LedgerError, ValueError) as e:
            log.warning("[%s - round %d] no valid receipt: %s", self.name, round_, e)
            return
        with open(self.store_dir / "receipts.jsonl", "a") as f:
            f.write(ledger.to_line(parsed) + "\n")

    def _record(self, cert: schemas.Certificate, digest: str, matched: bool) -> None:
        """Append to <store>/applied.jsonl what this peer computed for each round."""
        line = {"round": cert.round, "weights_hash": digest, "certificate": cert.new_hash}
        with open(self.store_dir / "applied.jsonl", "a") as f:
            f.write(json.dumps({**line, "matched": matched}) + "\n")

    def _canonical(self, cert: schemas.Certificate, why: str) -> tuple[TrainState, str, bool]:
        """The round's certified state, downloaded and hash-checked (a re-sync)."""
        log.warning(
            "[%s - round %d] %s: re-syncing from the canonical state", self.name, cert.round, why
        )
        state = self._download_state(cert.new_cid, cert.new_size, [])
        if state.digest() != cert.new_hash:
            raise RuntimeError(f"canonical state {cert.new_cid[:12]} fails its own hash")
        return state, cert.new_hash, True

    def _serve_state(self, state: TrainState, cid: str) -> None:
        """Keep the latest canonical state in our blob store, so joiners can fetch it from
        us. Serialization is deterministic, so its id must be the certificate's."""
        if self.server is None or self.store is None:
            return
        tmp = self.store.scratch()
        try:  # streamed to disk and hashed on the way: never a second copy in memory
            written, _ = state_to_file(state, tmp)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("[%s] could not write the state to serve it: %s", self.name, e)
            return
        if written != cid:
            tmp.unlink(missing_ok=True)
            log.warning("[%s] serialized state differs from the certificate's blob", self.name)
            return
        self.store.adopt(tmp, written)
        self._keep_state(cid)
        self._outer_on_disk(state, cid)

    def _outer_on_disk(self, state: TrainState, cid: str) -> None:
        """While state `cid` is served from our store, its outer tensors (the outer
        momentum: a model size) are read from that file when the next round's update needs
        them, not held in memory while the worker trains. The same bytes:
        the file's content id is the state's."""
        if self.server is None or not state.outer:
            return
        state.outer = FileTensors(self.store.path(cid), "outer/")  # type: ignore[assignment]

    def _keep_state(self, cid: str) -> None:
        """The canonical state `cid` is in our store: serve it (dropping the one served
        before), or drop it at once when we serve nothing."""
        assert self.store is not None
        if self.server is None:
            self.store.delete(cid)
            return
        if self._served_state and self._served_state != cid:
            self.store.delete(self._served_state)
        self._served_state = cid
