"""Who sent a request, and for which endpoint: every state-changing request is signed by
its sender's Ed25519 key over (purpose, run id, round, content id, nonce)
(covey.trust.identity). The purpose is the endpoint that received the request, which the
app layer records for the request's duration (`ReceivedAt`): no service method names it, so
a new endpoint is covered without being listed anywhere. A wrong key, an altered body, a
body signed for another endpoint, run or round, a stale nonce and a replayed one are all
refused with 401 before anything changes. Nonces are remembered in SQLite for the nonce
window, so a replay is refused even across a coordinator restart.
"""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from starlette.types import ASGIApp, Receive, Scope, Send

from covey.trust.identity import (
    IdentityError,
    nonce_time,
    request_message,
    request_purpose,
)
from covey.trust.polls import (
    POLL_NONCE_HEADER,
    POLL_PEER_HEADER,
    POLL_SIGNATURE_HEADER,
    poll_message,
)

from .peers import Peers
from .rejected import Rejected

if TYPE_CHECKING:
    from .db import Database

# the endpoint now handling a request, e.g. "POST /v1/leave" (set by ReceivedAt); copied
# into the worker thread that runs the service method (starlette's run_in_threadpool)
_RECEIVED_AT: ContextVar[str | None] = ContextVar("covey_received_at", default=None)


@functools.lru_cache(maxsize=16384)
def _public_key(public_key_hex: str) -> Ed25519PublicKey | None:
    """A parsed key, kept: parsing costs about as much as a verification, and the same few
    thousand peers sign every request. None for a malformed key."""
    try:
        raw = bytes.fromhex(public_key_hex)
        return Ed25519PublicKey.from_public_bytes(raw) if len(raw) == 32 else None
    except ValueError:
        return None


def verify(public_key_hex: str, message: bytes, signature_hex: str) -> bool:
    """covey.trust.identity.verify with the parsed key cached: whether `signature_hex` is
    the key's signature of `message` (False if either is malformed)."""
    key = _public_key(public_key_hex)
    if key is None:
        return False
    try:
        key.verify(bytes.fromhex(signature_hex), message)
        return True
    except (InvalidSignature, ValueError):
        return False


class ReceivedAt:
    """ASGI middleware: every POST/PUT/DELETE is authenticated for the path it arrived at."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "DELETE"):
            await self.app(scope, receive, send)
            return
        try:
            purpose = request_purpose(scope["path"], scope["method"])
        except IdentityError:
            purpose = None  # no route has such a path: nothing will authenticate
        token = _RECEIVED_AT.set(purpose)
        try:
            await self.app(scope, receive, send)
        finally:
            _RECEIVED_AT.reset(token)


class Auth:
    """Signature and nonce checks over the peers' keys (covey.coordinator.peers) and the
    nonces table of `db`."""

    def __init__(self, db: Database, nonce_window_s: float) -> None:
        self.db = db
        self.peers = Peers(db)
        self.nonce_window_s = nonce_window_s

    def authenticate(
        self,
        raw: dict[str, Any],
        round: int,
        peer_id: str,
        public_key: str | None = None,
        nonces: Any = None,
    ) -> None:
        """Check `raw` (the request body as received) is signed by `peer_id`'s key (known
        from its join, or `public_key` for the join itself) for the endpoint that received
        it and for `round`, with a fresh nonce, and use the nonce up. Rejected(401/404)
        otherwise, also when no purpose is known (a path no client can sign for, or a call
        outside any request)."""
        purpose = _RECEIVED_AT.get()
        if purpose is None:
            raise Rejected(401, "no signature is valid for this path")
        if public_key is None:
            public_key = self.peers.public_key(peer_id)
            if public_key is None:
                raise Rejected(404, f"unknown peer {peer_id}: join first")
        signature = raw.get("signature")
        if not isinstance(signature, str) or not verify(
            public_key, request_message(raw, round, purpose), signature
        ):
            raise Rejected(
                401,
                f"signature does not verify for peer {peer_id[:12]}, run {raw.get('run_id')}, "
                f"round {round} at {purpose}: wrong key, altered body, or signed for another "
                f"endpoint, run or round",
            )
        nonce = str(raw.get("nonce"))
        now = time.time()
        age = now - nonce_time(nonce)
        window = self.nonce_window_s
        if abs(age) > window:
            raise Rejected(401, f"nonce is {age:.0f} s old; requests must be within {window:.0f} s")
        if nonces is not None:  # heartbeats: spent in memory, flushed in batches
            nonces.use_nonce(peer_id, nonce, now)
            return
        try:
            with self.db.transaction() as c:
                c.execute("INSERT INTO nonces VALUES (?, ?, ?)", (peer_id, nonce, now))
        except sqlite3.IntegrityError:
            raise Rejected(401, f"replayed request: nonce {nonce} was already used") from None

    def poll_signer(
        self,
        headers: Mapping[str, str],
        round_: int,
        run_id: str,
        public_key_of: Callable[[str], str | None],
        path: str = "",
    ) -> str | None:
        """The peer that signed this certificate long-poll (with `path`, the long-poll of
        that path: covey.trust.polls.ROUND_POLL), or None for an unsigned one (counted
        against its address). Rejected(401) for a signature that does not verify for the
        peer it names (or a peer `public_key_of` does not know) or a nonce outside the
        window: naming a peer proves nothing without its key."""
        peer_id = headers.get(POLL_PEER_HEADER)
        if peer_id is None:
            return None
        nonce = headers.get(POLL_NONCE_HEADER, "")
        signature = headers.get(POLL_SIGNATURE_HEADER, "")
        key = public_key_of(peer_id)
        message = poll_message(run_id, peer_id, round_, nonce, path)
        if key is None or not verify(key, message, signature):
            what = path or f"round {round_}"
            raise Rejected(
                401, f"long-poll signature does not verify for peer {peer_id[:12]}, {what}"
            )
        try:
            age = time.time() - nonce_time(nonce)
        except IdentityError as e:
            raise Rejected(401, f"long-poll: {e}") from None
        if abs(age) > self.nonce_window_s:
            raise Rejected(
                401, f"long-poll nonce is {age:.0f} s old (window {self.nonce_window_s:.0f} s)"
            )
        return peer_id

    def prune_nonces(self, now: float) -> None:
        """Forget nonces older than the window: requests that old are refused anyway."""
        with self.db.transaction() as c:
            c.execute("DELETE FROM nonces WHERE at < ?", (now - 2 * self.nonce_window_s,))
