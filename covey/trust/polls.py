"""Signed long-polls: who holds a certificate (or round) long-poll, proven by a signature
in headers.

The coordinator bounds the long-polls one peer may hold at once. Keyed on a `peer_id` query
parameter, that bound is no bound: an attacker spreads its polls over made-up ids, or names
a victim's id until the victim's own polls are refused. So a poll is counted against a peer
only when it carries that peer's signature over (this run, this round's certificate, a
fresh nonce) in the headers below; an unsigned poll is counted against its client address
(covey.coordinator.app). A GET has no body, so the signature lives in headers, as an
upload's does (covey.blobs.store.upload_message), under its own prefix, so it never
verifies as any other signed message.

The nonce bounds a signature's life to the run's nonce window; it is not spent (a poll
retried after a lost reply reuses its headers), so someone who can read a peer's traffic
could replay its poll headers within the window: TLS in front of the coordinator is the
answer to that observer, as to every other one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covey.trust.identity import make_nonce

if TYPE_CHECKING:
    from covey.trust.identity import Identity

POLL_PEER_HEADER = "X-Covey-Peer"
POLL_NONCE_HEADER = "X-Covey-Nonce"
POLL_SIGNATURE_HEADER = "X-Covey-Signature"


ROUND_POLL = "/v1/round"  # the other long-poll: held until the round view changes


def poll_message(run_id: str, peer_id: str, round_: int, nonce: str, path: str = "") -> bytes:
    """The bytes a long-poll's signature covers: its purpose (the certificate of `round_`,
    or with `path` = ROUND_POLL the round view, for which `round_` is not used), the run,
    the poller and a nonce (covey.trust.identity.make_nonce)."""
    purpose = f"GET {path or f'/v1/rounds/{round_}/certificate'}"
    return "\n".join(("covey-poll/v1", purpose, run_id, peer_id, nonce)).encode()


def poll_headers(
    identity: Identity, run_id: str, round_: int = -1, path: str = ""
) -> dict[str, str]:
    """Headers that sign long-polls by `identity` for round `round_`'s certificate, or with
    `path` = ROUND_POLL for the round view (valid for the run's nonce window: make new ones
    for each round or wait)."""
    nonce = make_nonce()
    message = poll_message(run_id, identity.peer_id, round_, nonce, path)
    return {
        POLL_PEER_HEADER: identity.peer_id,
        POLL_NONCE_HEADER: nonce,
        POLL_SIGNATURE_HEADER: identity.sign(message),
    }
