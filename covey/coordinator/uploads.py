"""The coordinator's blob plane as a component (`Blobs`): its content-addressed store, its
fetcher of blobs that peers serve themselves, and the gate of uploads: who may upload a
blob to the coordinator, which one and how big, checked on a PUT's headers before a byte
of its body is read. The rounds mode (intake) and the app reach blobs only through it.

An upload is signed in headers (covey.blobs.store.upload_message: purpose, run, peer,
cid, size, nonce) by a live worker or a registered validator. Its size must be one the
run's model implies: a contribution payload (the codec's exact size for each fragment) or
a local state (verification evidence, committed worker state). Each peer has one upload in
flight at a time and at most `max_pending_uploads` uploaded blobs that no submission or
verification report names yet, so the disk a member can fill is bounded by
members x pending x the largest implied size, for the orphan grace period (then pruned).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from covey.blobs import BlobError, LocalBlobError
from covey.blobs.store import (
    UPLOAD_NONCE_HEADER,
    UPLOAD_PEER_HEADER,
    UPLOAD_SIGNATURE_HEADER,
    is_cid,
    upload_message,
)
from covey.trust.identity import IdentityError, nonce_time, verify

from .peers import Peers
from .rejected import Rejected

if TYPE_CHECKING:
    from covey.algorithms import Strategy, TrainState
    from covey.blobs import BlobClient, BlobStore
    from covey.blobs.store import BlobWriter
    from covey.config import RunConfig

    from .db import Database

PENDING_FORGET_S = 600.0  # = the store's orphan grace: older unnamed uploads are pruned


def blob_sizes(strategy: Strategy, template: TrainState) -> dict[int, str]:
    """Every blob size a peer may upload for this run's model, with what it is: the
    codec's exact payload size for each fragment a round can take, and the size of a
    local state (covey.trust.verify.local_state_to_bytes: names and shapes are fixed for
    a model and config)."""
    from covey.trust.verify import local_state_nbytes  # torch-heavy: coordinator only

    sizes: dict[int, str] = {}
    fragments = {strategy.round_fragment(r) for r in range(256)}
    for fragment in sorted(fragments, key=lambda f: -1 if f is None else f):
        numel = sum(template.params[n].numel() for n in strategy.fragment_names(fragment))
        what = "contribution" if fragment is None else f"contribution (fragment {fragment})"
        sizes.setdefault(strategy.codec.nbytes(numel), what)
    local = local_state_nbytes(strategy.local_state_layout())  # sized, not serialized
    sizes.setdefault(local, "local state")  # a validator's state backing a dispute
    # a worker's published end state (covey.trust.evidence.evidence_of): its private part alone
    evidence = local_state_nbytes(strategy.evidence_layout())
    sizes.setdefault(evidence, "local state")
    return sizes


@dataclass(frozen=True)
class Ticket:
    """An admitted upload: who sends which blob of what size."""

    peer_id: str
    cid: str
    size: int


class Blobs:
    """The blob plane: admits signed uploads (`admit`, `writer`, `done`) and remembers them
    until named (`named`); fetches a blob a member serves itself (`fetch_from_peer`); the
    store (`store`) holds them all. Thread-safe."""

    def __init__(
        self,
        db: Database,
        cfg: RunConfig,
        store: BlobStore,
        fetcher: BlobClient,
        sizes: Mapping[int, str],
        check_not_banned: Callable[[str], None] | None = None,
        *,
        run_id: str,
    ) -> None:
        """`sizes`: every blob size this run's model implies (`blob_sizes`);
        `check_not_banned(peer_id)` raises Rejected(403) for a peer excluded for fraud;
        `run_id`: the run's id (covey.config.run_id_of), uploads are signed for it."""
        self.db, self.run_id, self.sizes = db, run_id, dict(sizes)
        self.peers = Peers(db)
        self.store, self.fetcher = store, fetcher
        self.check_not_banned = check_not_banned
        self.window_s = cfg.trust.nonce_window_s
        self.max_pending = cfg.limits.max_pending_uploads
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._pending: dict[str, dict[str, float]] = {}  # peer -> cid -> uploaded at

    def admit(self, cid: str, headers: Mapping[str, str], length: str | None) -> Ticket:
        """Check an upload before its body is read. Rejected: 400 malformed cid, 411 no
        Content-Length, 401 unsigned / bad signature / stale or replayed nonce, 403 not a
        live member or validator (or excluded for fraud), 413 a size this run's model does
        not imply, 429 another upload of this peer in flight or too many of its uploads
        not yet named."""
        if not is_cid(cid):
            raise Rejected(400, f"not a content id: {cid[:80]!r}")
        if length is None or not length.isdigit():
            raise Rejected(411, "a blob upload needs a Content-Length (chunked bodies refused)")
        size = int(length)
        peer_id = headers.get(UPLOAD_PEER_HEADER.lower())
        nonce = headers.get(UPLOAD_NONCE_HEADER.lower())
        signature = headers.get(UPLOAD_SIGNATURE_HEADER.lower())
        if not (peer_id and nonce and signature):
            raise Rejected(
                401,
                f"unsigned upload: a blob upload needs the {UPLOAD_PEER_HEADER}, "
                f"{UPLOAD_NONCE_HEADER} and {UPLOAD_SIGNATURE_HEADER} headers of a member",
            )
        row = self.peers.row(peer_id)
        if row is None or not row["public_key"]:
            raise Rejected(403, f"unknown peer {peer_id[:32]!r}: only members upload blobs")
        message = upload_message(self.run_id, peer_id, cid, size, nonce)
        if not verify(row["public_key"], message, signature):
            raise Rejected(
                401,
                f"upload signature does not verify for peer {peer_id[:12]}, blob {cid[:12]}, "
                f"{size} bytes: wrong key, or signed for another blob, size or run",
            )
        if self.check_not_banned is not None:
            self.check_not_banned(peer_id)
        if row["role"] == "worker" and row["state"] != "live":
            raise Rejected(403, f"peer {peer_id[:12]} is {row['state']}: only live members upload")
        if size not in self.sizes:
            known = ", ".join(f"{n} ({what})" for n, what in sorted(self.sizes.items()))
            raise Rejected(
                413, f"blob {cid[:12]} of {size} bytes: this run's blobs are {known} bytes"
            )
        self._use_nonce(peer_id, nonce)
        with self._lock:
            if peer_id in self._in_flight:
                raise Rejected(429, f"peer {peer_id[:12]} already has an upload in progress")
            pending = self._unnamed(peer_id)
            if cid not in pending and len(pending) >= self.max_pending:
                raise Rejected(
                    429,
                    f"peer {peer_id[:12]} has {len(pending)} uploaded blobs that no "
                    f"submission names yet (at most {self.max_pending})",
                )
            self._in_flight.add(peer_id)
        return Ticket(peer_id, cid, size)

    def writer(self, ticket: Ticket) -> BlobWriter:
        """Where an admitted upload's body streams to (hashed as it arrives; committed only
        if it hashes to the ticket's cid, of its size)."""
        return self.store.writer(ticket.cid, ticket.size)

    def is_payload_size(self, size: int) -> bool:
        """Whether `size` is a contribution payload's size for this run's model."""
        return self.sizes.get(size, "").startswith("contribution")

    def is_local_state_size(self, size: int) -> bool:
        """Whether `size` is a worker local state's size for this run's model."""
        return self.sizes.get(size) == "local state"

    def payload_sizes(self) -> str:
        """The contribution sizes this run takes, for error messages."""
        return ", ".join(f"{n} bytes" for n in sorted(self.sizes) if self.is_payload_size(n))

    def fetch_from_peer(
        self, peer_id: str, cid: str, size: int, fetcher: BlobClient | None = None
    ) -> None:
        """Make sure blob `cid` of `size` bytes is in the store: there already (of that
        size), or fetched from the blob URL `peer_id` registered at join (streamed to disk,
        hashed on arrival, no redirects). Rejected: 422 a stored blob of another size, 409
        the peer serves no blobs (it must upload) or its server did not deliver, 503 this
        side failed (LocalBlobError: our disk, a closed client), no fault of the peer's.
        `fetcher`: a client of the caller's own (default the shared one)."""
        if self.store.has(cid):
            if self.store.size(cid) != size:
                raise Rejected(422, f"blob {cid[:12]} has {self.store.size(cid)} bytes, not {size}")
            return
        url = self.peers.blob_url(peer_id)
        if url is None:
            raise Rejected(409, f"blob {cid[:12]} was not uploaded (PUT /v1/blobs/...)")
        try:  # streamed to disk and hashed on arrival (capped by limits.max_blob_bytes)
            (fetcher or self.fetcher).fetch_into(self.store, cid, [url], size=size)
        except LocalBlobError as e:
            raise Rejected(503, f"could not fetch blob {cid[:12]}: {e}") from None
        except BlobError as e:
            raise Rejected(409, f"could not fetch blob {cid[:12]} from the peer: {e}") from None

    def done(self, ticket: Ticket, stored: bool) -> None:
        """The upload ended; a stored blob counts as pending until something names it."""
        with self._lock:
            self._in_flight.discard(ticket.peer_id)
            if stored:
                self._pending.setdefault(ticket.peer_id, {})[ticket.cid] = time.time()

    def named(self, peer_id: str, cids: Iterable[str | None]) -> None:
        """A submission of `peer_id` names these blobs: they no longer count as pending."""
        with self._lock:
            pending = self._pending.get(peer_id, {})
            for cid in cids:
                if cid is not None:
                    pending.pop(cid, None)

    def _unnamed(self, peer_id: str) -> dict[str, float]:
        """This peer's pending uploads, dropping old ones and those a contribution or a
        verification report has named since (called with the lock held)."""
        pending = self._pending.setdefault(peer_id, {})
        cutoff = time.time() - PENDING_FORGET_S
        for cid, at in list(pending.items()):
            if at < cutoff or self._is_named(cid):
                del pending[cid]
        return pending

    def _is_named(self, cid: str) -> bool:
        if self.db.one("SELECT 1 FROM contributions WHERE cid = ? LIMIT 1", (cid,)):
            return True
        return bool(
            self.db.one("SELECT 1 FROM verifications WHERE report LIKE ? LIMIT 1", (f"%{cid}%",))
        )

    def _use_nonce(self, peer_id: str, nonce: str) -> None:
        try:
            age = time.time() - nonce_time(nonce)
        except IdentityError as e:
            raise Rejected(401, str(e)) from None
        if abs(age) > self.window_s:
            raise Rejected(
                401, f"nonce is {age:.0f} s old; uploads must be within {self.window_s:.0f} s"
            )
        try:
            with self.db.transaction() as c:
                c.execute(
                    "INSERT INTO nonces (peer_id, nonce, at) VALUES (?, ?, ?)",
                    (peer_id, nonce, time.time()),
                )
        except sqlite3.IntegrityError:
            raise Rejected(401, f"replayed upload: nonce {nonce} was already used") from None
