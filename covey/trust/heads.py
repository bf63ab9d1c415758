"""Signed ledger heads: the coordinator's statement "run R's ledger has N entries, the last
with hash H", signed with its key behind a prefix of its own (`covey-ledger-head/v1`), so a
head's signature verifies as no other kind of message and no other message's as a head.

The ledger is append-only, so every head the coordinator ever signed must stay true of every
later copy of its ledger: the copy has at least N entries and entry N-1 has hash H. Peers
keep the heads they are given (in replies to their submissions and in round certificates);
`covey ledger verify --heads` holds a copy of the ledger to them. A copy shorter than a head,
or with another entry at that length, was cut short, rolled back or rewritten; two validly
signed heads with different hashes at one length prove that the coordinator forked its
ledger. A head whose signature or run does not check out is no evidence of anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from covey.trust.identity import Identity, canonical_json, verify
from covey.trust.ledger import Entry, LedgerError

HEADS_FILE = "ledger-heads.jsonl"  # where a peer keeps them, in its store directory
HEAD_FIELDS = ("hash", "length", "run_id", "signature")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_RUN_ID = re.compile(r"[0-9a-z_-]{1,64}")  # a run id (16 hex digits) never needs more
_SIGNATURE = re.compile(r"[0-9a-f]{128}")
MAX_LENGTH = 2**53  # a length any JSON reader holds exactly


@dataclass(frozen=True)
class Head:
    """A signed head: `length` entries in run `run_id`'s ledger, the last with `hash`."""

    run_id: str
    length: int
    hash: str
    signature: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "length": self.length,
            "hash": self.hash,
            "signature": self.signature,
        }

    def describe(self) -> str:
        return f"length {self.length}, hash {self.hash[:16]}..., signature {self.signature[:16]}..."


class HeadError(ValueError):
    """Something that is not a well-formed head (its signature is not checked here)."""


class ForkError(LedgerError):
    """Two heads, both validly signed by the run's coordinator, that disagree at one length:
    the coordinator signed two different ledgers. `heads`: the two, with where each came
    from."""

    def __init__(self, first: tuple[Head, str], second: tuple[Head, str]) -> None:
        self.heads = (first, second)
        (a, where_a), (b, where_b) = first, second
        super().__init__(
            None,
            f"the coordinator signed two different heads at length {a.length}: "
            f"{a.describe()} ({where_a}) and {b.describe()} ({where_b})",
        )


def head_message(run_id: str, length: int, digest: str) -> bytes:
    """What a head's signature covers: run id, length and last entry hash, behind the heads'
    own prefix (no other signed kind of message starts with it)."""
    return f"covey-ledger-head/v1\n{run_id}\n{length}\n{digest}".encode("ascii")


def sign_head(identity: Identity, run_id: str, length: int, digest: str) -> Head:
    """The head of a ledger of `length` entries whose last has hash `digest`, signed."""
    head = Head(run_id, length, digest, "0" * 128)
    _check_form(head.to_dict())
    return Head(run_id, length, digest, identity.sign(head_message(run_id, length, digest)))


def head_is_signed(head: Head, coordinator_key: str) -> bool:
    message = head_message(head.run_id, head.length, head.hash)
    return verify(coordinator_key, message, head.signature)


def parse_head(value: Any) -> Head:
    """A Head from its JSON object (exactly HEAD_FIELDS), or from a receipt that carries one
    under "ledger_head". HeadError naming what is wrong; the signature is not checked."""
    if isinstance(value, dict) and "ledger_head" in value and "length" not in value:
        value = value["ledger_head"]
    if not isinstance(value, dict):
        raise HeadError(f"a head is a JSON object, got {value.__class__.__name__}")
    if sorted(value) != list(HEAD_FIELDS):
        raise HeadError(f"a head has the fields {list(HEAD_FIELDS)}, got {sorted(value)[:8]}")
    _check_form(value)
    return Head(value["run_id"], value["length"], value["hash"], value["signature"])


def _check_form(value: dict[str, Any]) -> None:
    length = value["length"]
    if not isinstance(length, int) or isinstance(length, bool) or not 0 < length <= MAX_LENGTH:
        raise HeadError(f"length must be a positive integer, got {length!r:.40}")
    for name, pattern in (("run_id", _RUN_ID), ("hash", _HEX64), ("signature", _SIGNATURE)):
        field = value[name]
        if not isinstance(field, str) or not pattern.fullmatch(field):
            raise HeadError(f"{name} is not lowercase hex of the right length: {field!r:.80}")


def usable(
    heads: list[tuple[Head, str]], run_id: str, coordinator_key: str
) -> tuple[list[tuple[Head, str]], list[str]]:
    """(the heads that are evidence about this run, a warning for each that is not): a head
    of another run or whose signature is not the coordinator's proves nothing and is left
    out. Each head comes with where it was found (`where`), which the messages name."""
    kept, warnings = [], []
    for head, where in heads:
        if head.run_id != run_id:
            warnings.append(f"{where}: a head of run {head.run_id[:16]}..., not this run: ignored")
        elif not head_is_signed(head, coordinator_key):
            warnings.append(f"{where}: not signed by the run's coordinator key: ignored")
        else:
            kept.append((head, where))
    return kept, warnings


def check_heads(entries: list[Entry], heads: list[tuple[Head, str]]) -> int:
    """Hold `entries` (a verified chain) to `heads` (validly signed, see `usable`). First any
    two heads at one length with different hashes: ForkError. Then each head: LedgerError
    naming it if the ledger is shorter than it (cut short or rolled back) or its entry at
    that length has another hash (rewritten). Returns the longest head's length (0: none)."""
    by_length: dict[int, tuple[Head, str]] = {}
    for head, where in heads:
        seen = by_length.setdefault(head.length, (head, where))
        if seen[0].hash != head.hash:
            raise ForkError(seen, (head, where))
    for length in sorted(by_length):
        head, where = by_length[length]
        if length > len(entries):
            raise LedgerError(
                None,
                f"signed head at length {length} ({where}; hash {head.hash[:16]}...): the "
                f"ledger has only {len(entries)} entries: it was cut short or rolled back",
            )
        if entries[length - 1].hash != head.hash:
            raise LedgerError(
                length - 1,
                f"signed head at length {length} ({where}) names hash {head.hash[:16]}..., the "
                f"ledger's entry has {entries[length - 1].hash[:16]}...: it was rewritten",
            )
    return max(by_length, default=0)


def head_line(head: Head) -> str:
    """A head as one canonical JSON line (no newline): the format peers keep them in."""
    return canonical_json(head.to_dict())
