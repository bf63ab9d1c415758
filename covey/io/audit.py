"""Audit a run's ledger from outside the coordinator: `covey ledger verify`.

A ledger comes from a coordinator's data directory, its SQLite file, a JSONL export, or a
live coordinator's HTTP API. Verifying it checks the hash chain and every signature
(covey.trust.ledger), holds it to the signed ledger heads it is shown (covey.trust.heads:
a copy shorter than one, or different at its length, was cut short or rolled back),
replays every entry through the incentive rules (covey.trust.incentives), and compares the
balances the coordinator reports with the replay's.

The balances a data directory holds (`ledger-balances.json`) are unsigned: anyone holding
the copy can edit or delete them, so they decide nothing about the ledger's length. Balances
that claim more entries than the ledger holds are reported, not compared, and are no
evidence; only signed heads are.

Reading a source that does not exist or cannot be reached is a `SourceError`; anything
wrong with what was read is a `LedgerError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from covey.protocol.content import content_id
from covey.trust.heads import Head, check_heads, usable
from covey.trust.identity import canonical_json
from covey.trust.incentives import Book
from covey.trust.ledger import Entry, LedgerError, parse_line, read_entries, to_line, verify_chain
from covey.trust.shard_evidence import check_slashes
from covey.trust.shard_evidence import recompute as recompute_shards
from covey.trust.swarm_evidence import check_disputes

#: recomputes a mode's convictions from the ledger's entries and the run's blobs
#: (`fetch(cid, max_bytes)`), progress lines to `progress`: how many it recomputed, or
#: LedgerError. A mode above this layer hands its own in (covey.swarm.ledger_evidence).
Recompute = Callable[[list[Entry], Callable[[str, int], bytes], Callable[[str], None] | None], int]
#: a mode's treasury terms: the incentive policy (covey.trust.policy.Policy) the spec of
#: the ledger's "run created" entry gives, None for a ledger of another mode; LedgerError
#: when that spec does not hash to the run id. A mode above this layer hands its own in
#: (covey.rl.runspec.ledger_terms, covey.swarm.ledger_evidence.ledger_terms,
#: covey.serve.config.ledger_terms); the rounds mode's are checked here.
Terms = Callable[[list[Entry]], Any]

DB_FILE = "coordinator.db"
BALANCES_FILE = "ledger-balances.json"
PAGE = 1000
HTTP_TIMEOUT_S = 30.0
_SQLITE_HEADER = b"SQLite format 3\x00"


class SourceError(OSError):
    """The ledger could not be read at all: a missing file, an unreachable coordinator."""


@dataclass(frozen=True)
class VerifyReport:
    """A verified ledger. `compared_at` is the number of entries the coordinator's reported
    balances covered (they matched the replay of that prefix), None if it reported none.
    `shard_slashes`: slashes of aggregators whose evidence held (covey.trust.
    shard_evidence); `recomputed`: whether their shards were recomputed too."""

    entries: int
    coordinator_key: str
    summary: dict[str, Any]
    compared_at: int | None
    shard_slashes: int = 0
    recomputed: bool = False
    pending_slashes: int = 0  # of aggregators in a round not certified yet
    # signed heads the ledger was held to (None: none given), the longest one's length,
    # and why each head given was no evidence (another run's, a bad signature)
    heads: int | None = None
    head_length: int = 0
    head_warnings: tuple[str, ...] = ()
    balances_ahead: int | None = None  # unsigned balances claiming more entries: not compared
    # convictions of SWARM stage servers whose evidence held (covey.trust.swarm_evidence),
    # and how many of them were recomputed from the blobs
    swarm_convictions: int = 0
    swarm_recomputed: int = 0

    @property
    def accounts(self) -> int:
        return len(self.summary["accounts"])


def load(source: str | Path) -> tuple[list[Entry], dict[str, Any] | None, str | None]:
    """(entries, the coordinator's reported summary or None, its published key or None).

    `source`: a coordinator data directory (`coordinator.db`, opened read-only, and
    `ledger-balances.json` if present), a SQLite file, a `.jsonl` export, or an http(s) URL
    of a running coordinator. SourceError if it cannot be read; LedgerError if what it
    holds is malformed (this checks form only: `verify` checks the chain and the rules)."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        return _load_url(text.rstrip("/"))
    path = Path(source)
    if path.is_dir():
        db, balances = path / DB_FILE, path / BALANCES_FILE
        if not db.is_file():
            raise SourceError(f"{path} holds no {DB_FILE}: not a coordinator's data directory")
        reported = _json_file(balances) if balances.is_file() else None
        return read_entries(db), reported, None
    if not path.is_file():
        raise SourceError(f"no such directory, file or URL: {text}")
    if path.suffix == ".jsonl":
        return read_jsonl(path), None, None
    with path.open("rb") as f:
        if f.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER:
            return read_entries(path), None, None
    raise SourceError(f"{path} is neither a SQLite database nor a .jsonl ledger export")


def verify(
    source: str | Path,
    recompute: bool = False,
    progress: Callable[[str], None] | None = None,
    heads: list[tuple[Head, str]] | None = None,
    recomputers: Sequence[Recompute] = (),
    terms: Sequence[Terms] = (),
) -> VerifyReport:
    """Load, check the chain and signatures, hold the ledger to `heads` (signed heads, each
    with where it was found; None: none given), replay every entry, check every slash of an
    aggregator against its evidence, and compare the reported balances (if any) with the
    replay of the entries they cover. A head of another run or with a bad signature is no
    evidence: left out, with a warning in the report. Two validly signed heads that differ
    at one length: covey.trust.heads.ForkError; a ledger shorter than a head or different
    at its length: LedgerError naming the head. `recompute`: also recompute each such
    slash's shard from the run's blobs (a data directory's, or a URL's over HTTP;
    SourceError for an export, which holds none), and each conviction of a SWARM stage
    server with each of `recomputers`. A ledger of a mode whose `terms` know it is held
    to the treasury terms its spec gives (held stake, the unbonding period). LedgerError
    on the first failure: a bad entry by its index, differing balances by the first
    differing account."""
    if recompute and not _has_blobs(source):
        raise SourceError(
            f"{source}: --recompute needs the run's blobs: a coordinator's data directory "
            "or URL, not a database file or an export"
        )
    entries, reported, published_key = load(source)
    key = verify_chain(entries, published_key)
    head_warnings: list[str] = []
    head_length = 0
    if heads is not None:
        run_id = str(entries[0].payload.get("run_id"))
        heads, head_warnings = usable(heads, run_id, key)
        head_length = check_heads(entries, heads)
    covered, ahead = None, None
    if reported is not None:
        covered = reported.get("entries") if isinstance(reported, dict) else None
        if not isinstance(covered, int) or isinstance(covered, bool) or covered <= 0:
            raise LedgerError(None, f"the coordinator's balances lack an entry count: {covered!r}")
        if covered > len(entries):  # unsigned: no proof of a longer ledger, and no check
            covered, ahead, reported = None, covered, None
    book, snapshot = Book(), None
    for entry in entries:
        book.apply(entry)
        if book.entries == covered:
            snapshot = book.summary()
    if reported is not None and snapshot is not None:
        _compare(reported, snapshot)
    created = entries[0].payload  # verify_chain: entry 0 is "run created"
    spec_checked = _check_spec(created)
    if not spec_checked:
        _check_mode_terms(entries, terms)
    verdicts, pending = check_slashes(entries)
    if recompute and verdicts:
        if not spec_checked:
            raise LedgerError(
                0,
                "run created names no corpus_fingerprint: its spec cannot be checked against "
                "the run id, so no shard can be recomputed under it",
            )
        recompute_shards(verdicts, created["spec"], _blob_fetcher(source), progress)
    convictions, recomputed = len(check_disputes(entries)), 0
    if recompute and convictions:
        fetch = _blob_fetcher(source)
        recomputed = sum(r(entries, fetch, progress) for r in recomputers)
    return VerifyReport(
        len(entries),
        key,
        book.summary(),
        covered,
        len(verdicts),
        recompute,
        len(pending),
        None if heads is None else len(heads),
        head_length,
        tuple(head_warnings),
        ahead,
        convictions,
        recomputed,
    )


def _check_spec(created: dict[str, Any]) -> bool:
    """Whether "run created" names its data fingerprint; LedgerError when it does and its
    spec and fingerprint do not hash to its run id (the spec peers checked the run id
    against): a coordinator could otherwise write another spec than the one it served."""
    fingerprint = created.get("corpus_fingerprint")
    if fingerprint is None:
        return False  # an older run
    from pydantic import ValidationError

    from covey.config import RunConfig, run_id_of

    try:
        got = run_id_of(RunConfig.model_validate(created["spec"]), str(fingerprint))
    except (ValidationError, ValueError) as e:
        raise LedgerError(0, f"run created: spec or corpus_fingerprint is malformed: {e}") from None
    if got != created["run_id"]:
        why = f"spec and corpus_fingerprint hash to {got}, not run id {created['run_id']}"
        raise LedgerError(0, f"run created: {why}")
    _check_treasury_terms(created)
    return True


def _check_treasury_terms(created: dict[str, Any]) -> None:
    """LedgerError when a rounds run's policy names treasury terms (held stake, the
    unbonding period) other than its spec gives (covey.trust.treasury); a policy written
    before the treasury names none."""
    from covey.config import RunConfig
    from covey.trust.policy import Policy

    spec = RunConfig.model_validate(created["spec"])
    policy = created.get("policy")
    # the published state's size is the model's and method's, which the spec alone does not
    # give without building the model: the policy names it, and every contribution's
    # signed end_state_size must equal it (covey.coordinator.intake)
    size = policy.get("evidence_bytes", 0) if isinstance(policy, dict) else 0
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise LedgerError(0, f"run created: policy.evidence_bytes is {size!r}, not a size")
    terms = Policy.from_config(
        spec.trust, spec.rounds.deadline_max_s, held_stake=True, evidence_bytes=size
    )
    for name in ("held_stake", "unbonding_s"):
        if isinstance(policy, dict) and name in policy and policy[name] != getattr(terms, name):
            raise LedgerError(
                0,
                f"run created: policy.{name} is {policy[name]!r}, but the spec gives "
                f"{getattr(terms, name)!r}",
            )


def _check_mode_terms(entries: list[Entry], terms: Sequence[Terms]) -> None:
    """LedgerError when a ledger of a mode that `terms` know (RL, SWARM, serving) names
    treasury terms other than its spec gives; every field counts, present or not (a
    policy that omits `held_stake` would replay its stakes as declared)."""
    from covey.trust.policy import Policy

    created = entries[0].payload
    for of_mode in terms:
        given = of_mode(entries)
        if given is None:
            continue
        try:
            policy = Policy.from_dict(created.get("policy"))  # type: ignore[arg-type]
        except ValueError as e:
            raise LedgerError(0, f"run created: {e}") from None
        for name in ("held_stake", "unbonding_s"):
            if getattr(policy, name) != getattr(given, name):
                raise LedgerError(
                    0,
                    f"run created: policy.{name} is {getattr(policy, name)!r}, but the "
                    f"spec gives {getattr(given, name)!r}",
                )
        return


def _has_blobs(source: str | Path) -> bool:
    text = str(source)
    return text.startswith(("http://", "https://")) or Path(source).is_dir()


def _blob_fetcher(source: str | Path) -> Callable[[str, int], bytes]:
    """`fetch(cid, max_bytes)`: a blob's bytes by content id from the source's blob plane,
    checked against the id, at most `max_bytes` (what the blob can be: a contribution, a
    state). Over HTTP, covey's blob client: bounded waits and a minimum rate, so a source
    can neither hold the audit nor fill its memory. SourceError when it cannot be read or
    is not what its id names."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        from covey.blobs import BlobClient, BlobError

        def over_http(cid: str, max_bytes: int) -> bytes:
            client = BlobClient(timeout_s=HTTP_TIMEOUT_S, max_bytes=max_bytes)
            try:
                return client.fetch(cid, [text.rstrip("/")])
            except (BlobError, ValueError) as e:
                raise SourceError(f"cannot fetch blob {cid[:16]} from {text}: {e}") from None

        return over_http
    root = Path(source) / "blobs"

    def from_disk(cid: str, max_bytes: int) -> bytes:
        if len(cid) != 64 or not all(ch in "0123456789abcdef" for ch in cid):
            raise SourceError(f"{cid[:80]!r} is not a content id")
        path = root / cid[:2] / cid
        if not path.is_file():
            raise SourceError(f"blob {cid[:16]} is not in {root} (collected already?)")
        if path.stat().st_size > max_bytes:
            raise SourceError(f"blob {cid[:16]} is larger than it can be ({max_bytes} bytes)")
        data = path.read_bytes()
        if content_id(data) != cid:
            raise SourceError(f"blob {cid[:16]} in {root} is not what its id names")
        return data

    return from_disk


def read_jsonl(path: Path) -> list[Entry]:
    """Entries of a JSONL export, line N holding entry N. Only b"\\n" ends a line (so a
    flipped newline cannot pass as another line break); a final newline is optional."""
    lines = path.read_bytes().split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return [parse_line(line, n) for n, line in enumerate(lines)]


def write_jsonl(entries: list[Entry], path: Path) -> None:
    """Write `entries` as a JSONL export, atomically (a temporary file, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(to_line(e) + "\n" for e in entries), encoding="ascii")
    os.replace(tmp, path)


def _compare(reported: dict[str, Any], replayed: dict[str, Any]) -> None:
    """LedgerError naming the first account (by peer id) whose reported standing differs
    from the replayed one, else the first differing top-level field. A count that a
    report written by an older covey lacks (e.g. `withheld`) reads as 0."""
    reported = _with_later_counts(reported, replayed)
    if reported == replayed:
        return
    head = (
        f"the coordinator's balances (after {replayed['entries']} entries) differ from the ledger's"
    )
    mine = replayed["accounts"]
    theirs = reported.get("accounts")
    if not isinstance(theirs, dict):
        raise LedgerError(None, f"{head}: 'accounts' is {theirs!r:.80}")
    for peer_id in sorted(set(mine) | set(theirs)):
        a, b = theirs.get(peer_id), mine.get(peer_id)
        if a == b:
            continue
        if a is None or b is None:
            where = "the ledger" if a is None else "the coordinator's report"
            raise LedgerError(None, f"{head}: account {peer_id} is missing from {where}")
        name = b.get("name", "?")
        field = _first_difference(a, b)
        raise LedgerError(
            None,
            f"{head}: account {peer_id} ({name}): {field} is {_at(a, field)!r} reported, "
            f"{_at(b, field)!r} recomputed",
        )
    field = _first_difference(reported, replayed)
    raise LedgerError(
        None,
        f"{head}: {field} is {_at(reported, field)!r} reported, {_at(replayed, field)!r} "
        "recomputed",
    )


def _with_later_counts(reported: dict[str, Any], replayed: dict[str, Any]) -> dict[str, Any]:
    """`reported` with each account's missing counts (those this covey adds) set to 0."""
    theirs, mine = reported.get("accounts"), replayed["accounts"]
    if not isinstance(theirs, dict):
        return reported
    accounts = {}
    for peer_id, a in theirs.items():
        b = mine.get(peer_id)
        if isinstance(a, dict) and isinstance(a.get("counts"), dict) and isinstance(b, dict):
            later = {k: 0 for k in b.get("counts", {}) if k not in a["counts"]}
            a = {**a, "counts": {**a["counts"], **later}}
        accounts[peer_id] = a
    return {**reported, "accounts": accounts}


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    """Dotted path of the first differing field of two summaries (sorted key order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key, _MISSING) != b.get(key, _MISSING):
                return _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
    return prefix.rstrip(".") or "the summary"


def _at(value: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
    return value


class _Missing:
    def __repr__(self) -> str:
        return "(missing)"


_MISSING = _Missing()


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise LedgerError(None, f"{path} is not valid JSON: {e}") from None


def _load_url(base: str) -> tuple[list[Entry], dict[str, Any] | None, str | None]:
    """Balances first, then the ledger: entries appended between the two requests are
    beyond what the balances cover, and `verify` compares only the prefix they cover."""
    import httpx

    try:
        with httpx.Client(base_url=base, timeout=HTTP_TIMEOUT_S) as client:
            run = _get(client, "/v1/run")
            key = run.get("coordinator_key") if isinstance(run, dict) else None
            if not isinstance(key, str):
                raise LedgerError(None, f"{base}/v1/run publishes no coordinator_key: {key!r}")
            reported = _get(client, "/v1/ledger/balances")
            entries: list[Entry] = []
            while page := _get(client, "/v1/ledger", start=len(entries), limit=PAGE):
                if not isinstance(page, list):
                    raise LedgerError(len(entries), f"{base}/v1/ledger returned {page!r:.80}")
                for item in page:
                    n = len(entries)
                    if not isinstance(item, dict) or item.get("index") != n:
                        raise LedgerError(n, f"{base}/v1/ledger returned {item!r:.120} here")
                    entries.append(parse_line(canonical_json(item), n))
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise SourceError(f"cannot read the ledger from {base}: {e}") from None
    return entries, reported, key


def _get(client: Any, path: str, **params: int) -> Any:
    response = client.get(path, params=params)
    response.raise_for_status()
    try:
        return response.json()
    except ValueError as e:
        raise LedgerError(None, f"{path} did not return JSON: {e}") from None
