"""The coordinator's signed statements that peers check: round certificates, and the
sampling draw that decides which contributions validators re-execute.

The draw is the coordinator's Ed25519 signature over (run id, round, peer id, content id):
nobody without the coordinator's key can predict it before submitting (so a cheater cannot
know which rounds are checked), and anyone can verify it afterwards from the ledger (so
the coordinator cannot pick whom to check). Ed25519 signatures are deterministic, which
makes the draw a verifiable random function of those four values.
"""

from __future__ import annotations

import hashlib

from covey.protocol import schemas
from covey.trust.identity import Identity, canonical_json, verify


def certificate_message(cert: schemas.Certificate) -> bytes:
    """What a certificate's signature covers: the certificate without its signature, after
    a prefix of its own (no other signed kind of message starts with it). A certificate
    without a ledger head is signed without the field, as before heads existed."""
    left_out = {"signature"} | ({"ledger_head"} if cert.ledger_head is None else set())
    body = canonical_json(cert.model_dump(mode="json", exclude=left_out))
    return f"covey-certificate/v1\n{body}".encode()


def sign_certificate(cert: schemas.Certificate, identity: Identity) -> schemas.Certificate:
    return cert.model_copy(update={"signature": identity.sign(certificate_message(cert))})


def certificate_is_signed(cert: schemas.Certificate, coordinator_key: str) -> bool:
    return verify(coordinator_key, certificate_message(cert), cert.signature)


def draw_message(run_id: str, round: int, peer_id: str, cid: str) -> bytes:
    return f"covey-sample/v1\n{run_id}\n{round}\n{peer_id}\n{cid}".encode()


def draw_value(draw: str) -> float:
    """A draw (signature hex) as a number uniform in [0, 1)."""
    return int(hashlib.sha256(bytes.fromhex(draw)).hexdigest()[:16], 16) / 2.0**64


def sample(identity: Identity, run_id: str, round: int, peer_id: str, cid: str, rate: float):
    """(sampled, draw): whether validators re-execute this contribution, and the proof."""
    draw = identity.sign(draw_message(run_id, round, peer_id, cid))
    return draw_value(draw) < rate, draw


def check_draw(
    coordinator_key: str, run_id: str, round: int, peer_id: str, cid: str, draw: str
) -> bool:
    """Whether `draw` is the coordinator's genuine draw for this contribution."""
    return verify(coordinator_key, draw_message(run_id, round, peer_id, cid), draw)


def canary_message(run_id: str, round: int, validator_id: str) -> bytes:
    """What the coordinator signs to decide whether `validator_id` gets a canary in round
    `round`: secret until revealed in the ledger (so a validator cannot tell a canary from
    a real check), verifiable afterwards (so none can be made up to punish a validator)."""
    return f"covey-canary/v1\n{run_id}\n{round}\n{validator_id}".encode()


def canary_draw(identity: Identity, run_id: str, round: int, validator_id: str, rate: float):
    """(planted, draw): whether this validator gets a canary this round, and the proof."""
    draw = identity.sign(canary_message(run_id, round, validator_id))
    return draw_value(draw) < rate, draw


def audit_message(run_id: str, round: int, peer_id: str) -> bytes:
    """What the coordinator signs to decide whether a cleared contribution is audited (one
    more check by a validator not yet tried): unknown to anyone before, checkable after."""
    return f"covey-audit/v1\n{run_id}\n{round}\n{peer_id}".encode()


def audit_draw(identity: Identity, run_id: str, round: int, peer_id: str, rate: float):
    """(audited, draw): whether this cleared contribution gets an audit, and the proof."""
    draw = identity.sign(audit_message(run_id, round, peer_id))
    return draw_value(draw) < rate, draw


def check_canary_draw(
    coordinator_key: str, run_id: str, round: int, validator_id: str, draw: str
) -> bool:
    """Whether `draw` is the coordinator's genuine canary draw for this validator and round."""
    return verify(coordinator_key, canary_message(run_id, round, validator_id), draw)
