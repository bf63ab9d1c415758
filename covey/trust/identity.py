"""Ed25519 identities and signed requests.

A peer's identity is an Ed25519 key pair kept in a file only its owner can read
(`~/.covey/identity` by default, mode 600). Its peer id is the hash of the public key, so
nobody can claim an id without holding the key.

A signed request carries a nonce and a signature over (purpose, run id, round, content id,
nonce), where the content id is the sha256 of the request body's canonical JSON without the
signature. The purpose is the endpoint the request is sent to (`POST /v1/leave`), so a body
signed for one endpoint is refused at every other one: a heartbeat captured on its way to
the coordinator cannot be played back as a leave. The run id and round bind the signature
to one run and one round (round -1 for requests that belong to no round: join, heartbeat,
leave); the nonce, which embeds its creation time and is accepted once, stops replays.

Every other kind of message signed with these keys (certificates, ledger entries, sampling
draws, HALT records) starts with its own `covey-<kind>/v1` prefix, so a signature over one
kind never verifies as another.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

DEFAULT_PATH = Path("~/.covey/identity")
NO_ROUND = -1
_NONCE = re.compile(r"^(\d{13})-([0-9a-f]{16})$")
_API_PATH = re.compile(r"/[A-Za-z0-9_./{}-]{0,200}")
_PURPOSE = re.compile(r"(POST|PUT|DELETE) " + _API_PATH.pattern)


class IdentityError(ValueError):
    """An identity file that cannot be used, or a malformed key or signature."""


def peer_id_of(public_key_hex: str) -> str:
    """The id of the peer holding this public key: 32 hex digits of its sha256."""
    return hashlib.sha256(_key_bytes(public_key_hex)).hexdigest()[:32]


class Identity:
    """A private key and what follows from it. Create with `load_or_create`."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        raw = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.public_key = raw.hex()
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | Path | None = None) -> Identity:
        """The key at `path` (default ~/.covey/identity), created with mode 600 (its folder
        700) on first use. IdentityError if the file is unreadable or not a key, or if
        others can read it."""
        path = Path(path or DEFAULT_PATH).expanduser()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            identity = cls.generate()
            raw = identity._key.private_bytes(
                serialization.Encoding.Raw,
                serialization.PrivateFormat.Raw,
                serialization.NoEncryption(),
            )
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(raw.hex() + "\n")
            return identity
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise IdentityError(
                f"{path} is readable by others (mode {mode:o}); run: chmod 600 {path}"
            )
        text = path.read_text().strip()
        try:
            raw = bytes.fromhex(text)
            if len(raw) != 32:
                raise ValueError(f"{len(raw)} bytes")
            return cls(Ed25519PrivateKey.from_private_bytes(raw))
        except ValueError as e:
            raise IdentityError(f"{path} is not a covey identity (64 hex digits): {e}") from None

    def sign(self, message: bytes) -> str:
        return self._key.sign(message).hex()

    def sign_request(
        self, body: dict[str, Any], round: int = NO_ROUND, *, purpose: str
    ) -> dict[str, Any]:
        """`body` with a fresh nonce and the signature over it added, valid only at the
        endpoint `purpose` (see `request_purpose`) and for `round`."""
        signed = {k: v for k, v in body.items() if k != "signature"}
        signed["nonce"] = make_nonce()
        signed["signature"] = self.sign(request_message(signed, round, purpose))
        return signed


def make_nonce(now: float | None = None) -> str:
    """Milliseconds since the epoch, a dash, 64 random bits."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"{ms:013d}-{secrets.token_hex(8)}"


def nonce_time(nonce: str) -> float:
    """When the nonce was made (seconds); IdentityError if it is not a covey nonce."""
    m = _NONCE.fullmatch(nonce)
    if not m:
        raise IdentityError(f"malformed nonce {nonce[:40]!r}")
    return int(m.group(1)) / 1000


def canonical_json(value: Any) -> str:
    """The one JSON text of a value: sorted keys, no spaces, ASCII only."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def body_content_id(body: dict[str, Any]) -> str:
    """sha256 of the body's canonical JSON, the signature left out."""
    unsigned = {k: v for k, v in body.items() if k != "signature"}
    return hashlib.sha256(canonical_json(unsigned).encode()).hexdigest()


def request_purpose(path: str, method: str = "POST") -> str:
    """The purpose tag of a request to `path` (the API path, no query): `POST /v1/leave`.
    IdentityError for a path that is not one (no leading slash, whitespace, a query)."""
    if not _API_PATH.fullmatch(path):
        raise IdentityError(f"not an API path: {path[:80]!r}")
    if method not in ("POST", "PUT", "DELETE"):
        raise IdentityError(f"requests with method {method!r} are not signed")
    return f"{method} {path}"


def request_message(body: dict[str, Any], round: int, purpose: str) -> bytes:
    """The bytes a request's signature covers: (purpose, run id, round, content id, nonce).
    IdentityError if `purpose` is not a `request_purpose` (a newline in it could make two
    different messages read the same)."""
    if not _PURPOSE.fullmatch(purpose):
        raise IdentityError(f"not a request purpose: {purpose[:80]!r}")
    return (
        f"covey-request/v2\n{purpose}\n{body.get('run_id')}\n{round}\n"
        f"{body_content_id(body)}\n{body.get('nonce')}"
    ).encode()


def verify(public_key_hex: str, message: bytes, signature_hex: str) -> bool:
    """Whether `signature_hex` is the key's signature of `message` (False if malformed)."""
    try:
        key = Ed25519PublicKey.from_public_bytes(_key_bytes(public_key_hex))
        key.verify(bytes.fromhex(signature_hex), message)
        return True
    except (InvalidSignature, ValueError, IdentityError):
        return False


def _key_bytes(public_key_hex: str) -> bytes:
    try:
        raw = bytes.fromhex(public_key_hex)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise IdentityError(f"not an Ed25519 public key (64 hex digits): {public_key_hex[:80]!r}")
    return raw
