"""The run's ledger: an append-only, hash-chained table of entries signed by the coordinator.

Each entry carries the hash of the one before it (entry 0 carries `GENESIS`), its own hash
over (index, type, time, payload, previous hash) and the coordinator's Ed25519 signature of
that hash. Changing, dropping, inserting or reordering anything breaks the chain at the first
entry touched, and nobody without the coordinator's key can re-sign a rewritten tail. Every
balance, stake, slash and ownership share is replayed from these entries
(covey.trust.incentives); nothing else is authoritative.

The exchange format is JSONL, one `to_line` per entry. A line must be byte-identical to the
canonical JSON of what it parses to, so even changes that keep the value (`1e-05` ->
`1E-05`, `\\u00e9` -> `\\u00E9`) are rejected: every flipped byte names its entry.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from covey.trust.identity import Identity, canonical_json, verify

LEDGER_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS ledger (idx INTEGER PRIMARY KEY, type TEXT NOT NULL, "
    "at REAL NOT NULL, payload TEXT NOT NULL, prev_hash TEXT NOT NULL, hash TEXT NOT NULL, "
    "signature TEXT NOT NULL);"
)
ENTRY_TYPES: tuple[str, ...] = (
    "run created",
    "join",
    "leave",
    "stake",
    "contribution accepted",
    "contribution rejected",
    "verification",
    "dispute",
    "slash",
    "reward",
    "report refused",
    "penalty",
    "assignment",
    "canary",
    "house canary",
    "round certificate",
    "checkpoint",
    "halt",
    "no show",
    "clawback",
    "deposit",
    "unbond",
    "rebond",
    "release",
)
GENESIS = "0" * 64
LINE_FIELDS = ("at", "hash", "index", "payload", "prev_hash", "signature", "type")
_HASH = re.compile(r"[0-9a-f]{64}")
_SIGNATURE = re.compile(r"[0-9a-f]{128}")


class LedgerError(ValueError):
    """A ledger that fails verification. `index` is the entry it names (None when the fault
    belongs to no single entry, e.g. an empty ledger); the message starts `entry N: `."""

    def __init__(self, index: int | None, reason: str) -> None:
        self.index = index
        self.reason = reason
        super().__init__(reason if index is None else f"entry {index}: {reason}")


@dataclass(frozen=True)
class Entry:
    """One ledger entry. `payload` is JSON data (see covey.trust.incentives for each type's)."""

    index: int
    type: str
    at: float
    payload: dict[str, Any]
    prev_hash: str
    hash: str
    signature: str


def entry_hash(index: int, type: str, at: float, payload: dict[str, Any], prev_hash: str) -> str:
    """sha256 (hex) of the canonical JSON of the entry's signed fields."""
    fields = {"index": index, "type": type, "at": at, "payload": payload, "prev_hash": prev_hash}
    return hashlib.sha256(canonical_json(fields).encode("ascii")).hexdigest()


def signed_message(digest: str) -> bytes:
    """What an entry's signature covers: its hash, after a prefix of the ledger's own (so
    no other signed kind of message can pass for an entry)."""
    return f"covey-ledger/v1\n{digest}".encode("ascii")


def legacy_signed_message(digest: str) -> bytes:
    """What covey 0.1.0 signed for an entry: its bare hash (no ledger prefix)."""
    return digest.encode("ascii")


def resign_legacy(conn: sqlite3.Connection, identity: Identity) -> int:
    """Re-sign, inside the caller's transaction, every entry that `identity` signed the
    covey 0.1.0 way (over the bare hash) with today's prefixed message; returns how many.
    Hashes and the chain do not change: the same key attests the same hash, now behind the
    ledger's own prefix, so a migrated run directory audits with `covey ledger verify`. An
    entry whose signature is neither form is left alone (verification will name it)."""
    rows = conn.execute("SELECT idx, hash, signature FROM ledger ORDER BY idx").fetchall()
    changed = 0
    for idx, digest, signature in rows:
        if verify(identity.public_key, signed_message(digest), signature):
            continue
        if verify(identity.public_key, legacy_signed_message(digest), signature):
            conn.execute(
                "UPDATE ledger SET signature = ? WHERE idx = ?",
                (identity.sign(signed_message(digest)), idx),
            )
            changed += 1
    return changed


def append(
    conn: sqlite3.Connection, identity: Identity, type: str, payload: dict[str, Any], at: float
) -> Entry:
    """Append one entry signed by `identity`, inside the caller's open transaction (the
    caller commits or rolls back). ValueError, with nothing written, for an unknown type, a
    payload that is not finite JSON data, a first entry that is not "run created" (or whose
    coordinator_key is not `identity`'s), or a later "run created"."""
    if type not in ENTRY_TYPES:
        raise ValueError(f"unknown ledger entry type {type!r}; known: {list(ENTRY_TYPES)}")
    if not isinstance(payload, dict):
        raise ValueError(f"a {type!r} payload must be a dict, got {payload.__class__.__name__}")
    try:
        json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{type!r} payload is not finite JSON data: {e}") from None
    text = canonical_json(payload)
    payload = json.loads(text)  # the entry holds exactly what a reader will get back
    at = float(at)
    if not math.isfinite(at):
        raise ValueError(f"entry time must be finite, got {at}")
    last = conn.execute("SELECT idx, hash FROM ledger ORDER BY idx DESC LIMIT 1").fetchone()
    index, prev = (0, GENESIS) if last is None else (int(last[0]) + 1, str(last[1]))
    if (index == 0) != (type == "run created"):
        raise ValueError(f"entry {index} cannot be {type!r}: only entry 0 is 'run created'")
    if index == 0 and payload.get("coordinator_key") != identity.public_key:
        raise ValueError(
            f"'run created' names coordinator_key {payload.get('coordinator_key')!r}, "
            f"but the ledger is signed by {identity.public_key}"
        )
    digest = entry_hash(index, type, at, payload, prev)
    signature = identity.sign(signed_message(digest))
    conn.execute(
        "INSERT INTO ledger (idx, type, at, payload, prev_hash, hash, signature) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (index, type, at, text, prev, digest, signature),
    )
    return Entry(index, type, at, payload, prev, digest, signature)


def read_entries(
    conn_or_path: sqlite3.Connection | str | Path, start: int = 0, limit: int | None = None
) -> list[Entry]:
    """Entries with index >= `start` in index order, at most `limit`. A path is opened
    read-only. LedgerError naming the row if a row's payload is not canonical JSON of a dict
    or a field has the wrong type; LedgerError (index None) if there is no ledger table."""
    if not isinstance(conn_or_path, (str, Path)):  # an open connection (SQLite, PostgreSQL)
        return _read(conn_or_path, start, limit)
    path = Path(conn_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"no SQLite database at {path}")
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        return _read(conn, start, limit)
    finally:
        conn.close()


def _read(conn: sqlite3.Connection, start: int, limit: int | None) -> list[Entry]:
    sql = "SELECT idx, type, at, payload, prev_hash, hash, signature FROM ledger WHERE idx >= ?"
    sql += " ORDER BY idx LIMIT ?"
    try:
        rows = conn.execute(sql, (start, -1 if limit is None else limit)).fetchall()
    except sqlite3.OperationalError as e:
        raise LedgerError(None, f"cannot read the ledger table: {e}") from None
    entries = []
    for row in rows:
        idx, type_, at, text, prev, digest, signature = tuple(row)
        name = idx if isinstance(idx, int) else None
        if not isinstance(text, str):
            raise LedgerError(name, f"payload is {text.__class__.__name__}, not text")
        payload = _loads(text, name, "payload")
        if canonical_json(payload) != text:
            raise LedgerError(name, "payload text is not canonical JSON")
        fields = {"index": idx, "type": type_, "at": at, "payload": payload}
        fields |= {"prev_hash": prev, "hash": digest, "signature": signature}
        entries.append(_entry(fields, name))
    return entries


def to_line(entry: Entry) -> str:
    """The entry as one canonical JSON line (no newline): the JSONL export format."""
    return canonical_json(
        {
            "index": entry.index,
            "type": entry.type,
            "at": entry.at,
            "payload": entry.payload,
            "prev_hash": entry.prev_hash,
            "hash": entry.hash,
            "signature": entry.signature,
        }
    )


def parse_line(text: str | bytes, lineno: int) -> Entry:
    """The entry on line `lineno` (0-based, which is the index it must have). LedgerError
    naming `lineno` if the line is not UTF-8 JSON, lacks or adds fields, has a field of the
    wrong type or shape, or is not byte-identical to `to_line` of what it parses to. Whether
    the entry belongs in the chain is `verify_chain`'s question."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LedgerError(lineno, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    fields = _loads(text, lineno, "line")
    if not isinstance(fields, dict):
        raise LedgerError(lineno, f"a line must be a JSON object, got {fields.__class__.__name__}")
    if sorted(fields) != list(LINE_FIELDS):
        missing = sorted(set(LINE_FIELDS) - set(fields))
        extra = sorted(set(fields) - set(LINE_FIELDS))
        raise LedgerError(lineno, f"wrong fields: missing {missing}, unexpected {extra}")
    entry = _entry(fields, lineno)
    canonical = to_line(entry)
    if canonical != text:
        pairs = zip(canonical, text, strict=False)
        at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(canonical), len(text)))
        raise LedgerError(lineno, f"not in canonical form (first difference at character {at})")
    return entry


def verify_chain(entries: list[Entry], coordinator_key: str | None = None) -> str:
    """Check the whole chain: indices 0, 1, 2, ... in order, known types, entry 0 (and only
    it) "run created" naming the coordinator key (`coordinator_key` if given, which it must
    equal), each prev_hash the hash before it, each hash recomputed from its contents, each
    signature the coordinator's. Returns the key. LedgerError naming the first bad entry."""
    if not entries:
        raise LedgerError(None, "the ledger is empty (no 'run created' entry)")
    first = entries[0]
    if first.type != "run created" or first.index != 0:
        raise LedgerError(0, f"the first entry must be 'run created', got {first.type!r}")
    key = first.payload.get("coordinator_key")
    if not isinstance(key, str) or not _HASH.fullmatch(key):
        raise LedgerError(0, f"coordinator_key is not a public key (64 hex digits): {key!r}")
    if coordinator_key is not None and key != coordinator_key:
        raise LedgerError(
            0, f"signed by coordinator key {key}, but the published key is {coordinator_key}"
        )
    prev = GENESIS
    for position, e in enumerate(entries):
        if e.index != position:
            raise LedgerError(position, f"has index {e.index}, expected {position}")
        if e.type not in ENTRY_TYPES:
            raise LedgerError(position, f"unknown type {e.type!r}")
        if position > 0 and e.type == "run created":
            raise LedgerError(position, "a second 'run created' entry")
        if e.prev_hash != prev:
            raise LedgerError(position, "prev_hash is not the previous entry's hash")
        if entry_hash(e.index, e.type, e.at, e.payload, e.prev_hash) != e.hash:
            raise LedgerError(position, "hash does not match its contents")
        if not _SIGNATURE.fullmatch(e.signature) or not verify(
            key, signed_message(e.hash), e.signature
        ):
            raise LedgerError(position, "signature is not the coordinator's")
        prev = e.hash
    return key


def check_entry(e: Entry, coordinator_key: str) -> None:
    """Check one entry on its own (a receipt): its hash is its contents' and it carries
    the coordinator's signature. LedgerError naming the entry otherwise."""
    if entry_hash(e.index, e.type, e.at, e.payload, e.prev_hash) != e.hash:
        raise LedgerError(e.index, "hash does not match its contents")
    if not _SIGNATURE.fullmatch(e.signature) or not verify(
        coordinator_key, signed_message(e.hash), e.signature
    ):
        raise LedgerError(e.index, "signature is not the coordinator's")


def _loads(text: str, index: int | None, what: str) -> Any:
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(text, parse_constant=no_constant)
    except ValueError as e:
        raise LedgerError(index, f"{what} is not valid JSON ({e})") from None


def _entry(fields: dict[str, Any], index: int | None) -> Entry:
    """An Entry from its seven fields, each checked for type and shape."""
    checks: dict[str, tuple[type, re.Pattern[str] | None]] = {
        "index": (int, None),
        "type": (str, None),
        "at": (float, None),
        "payload": (dict, None),
        "prev_hash": (str, _HASH),
        "hash": (str, _HASH),
        "signature": (str, _SIGNATURE),
    }
    for name, (kind, pattern) in checks.items():
        value = fields[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            got = value.__class__.__name__
            raise LedgerError(index, f"field {name!r} must be {kind.__name__}, got {got}")
        if pattern is not None and not pattern.fullmatch(value):
            digits = 128 if name == "signature" else 64
            raise LedgerError(
                index, f"field {name!r} is not {digits} lowercase hex digits: {value[:140]!r}"
            )
    if not math.isfinite(fields["at"]):
        raise LedgerError(index, f"field 'at' is not finite: {fields['at']}")
    return Entry(**fields)
