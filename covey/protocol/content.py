"""Content ids: every blob (a contribution, a checkpoint) is named by the sha256 of its bytes.

A content id is 64 lowercase hex digits and nothing else, so it is safe to use as a file
name and cannot smuggle a path. Whoever receives bytes for an id checks the hash before
using them; a provider can be slow or absent, never wrong without being caught.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

_CID = re.compile(r"^[0-9a-f]{64}$")


def content_id(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def file_content_id(path: str | Path, piece_bytes: int = 1 << 20) -> str:
    """The content id of a file's bytes, read `piece_bytes` at a time (never whole into
    memory). OSError if it cannot be read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(piece_bytes):
            h.update(piece)
    return h.hexdigest()


def is_content_id(value: str) -> bool:
    return bool(_CID.fullmatch(value))


def check_content_id(value: str) -> str:
    """The id itself, or ValueError naming what is wrong with it."""
    if not is_content_id(value):
        raise ValueError(f"not a content id (64 lowercase hex digits): {value[:80]!r}")
    return value
