"""Signed ledger heads (covey.trust.heads): a copy of the ledger cut short or rolled back is
refused when `covey ledger verify` is shown a head the coordinator signed; two signed heads
that disagree at one length prove a forked ledger; a head that is not the run coordinator's
is no evidence. Unit tests on a ledger written in-process, then a real coordinator and
worker: the heads the worker kept refuse a truncated copy and an older snapshot of the
coordinator's database."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from covey.io import audit
from covey.io.ledger_cli import register
from covey.local.cluster import LocalCluster
from covey.peer.heads import HeadKeeper
from covey.protocol import schemas
from covey.trust.certify import certificate_is_signed, certificate_message
from covey.trust.heads import (
    HEADS_FILE,
    ForkError,
    Head,
    check_heads,
    head_is_signed,
    head_line,
    head_message,
    sign_head,
    usable,
)
from covey.trust.identity import Identity, verify
from covey.trust.ledger import LedgerError, read_entries, signed_message
from tests.test_ledger import full_run


@pytest.fixture
def cli() -> Callable[..., Any]:
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["ledger", *map(str, args)])


def heads_file(path: Path, heads: list[Head]) -> Path:
    path.write_text("".join(head_line(h) + "\n" for h in heads))
    return path


# -- the signature's purpose tag ------------------------------------------------------------


def test_a_heads_signature_is_valid_for_a_head_only() -> None:
    coord = Identity.generate()
    digest = "ab" * 32
    head = sign_head(coord, "0123456789abcdef", 7, digest)
    assert head_is_signed(head, coord.public_key)
    assert head_message("0123456789abcdef", 7, digest).startswith(b"covey-ledger-head/v1\n")
    # not as the ledger entry with that hash, nor the bare hash, nor another head
    assert not verify(coord.public_key, signed_message(digest), head.signature)
    assert not verify(coord.public_key, digest.encode(), head.signature)
    for other in (("0123456789abcdee", 7, digest), ("0123456789abcdef", 8, digest)):
        assert not head_is_signed(Head(*other, head.signature), coord.public_key)
    # nor does an entry's signature of that hash pass as a head
    entry_signature = coord.sign(signed_message(digest))
    assert not head_is_signed(
        Head("0123456789abcdef", 7, digest, entry_signature), coord.public_key
    )
    assert not head_is_signed(head, Identity.generate().public_key)


def test_a_certificate_names_a_head_under_its_own_signature() -> None:
    coord = Identity.generate()
    head = sign_head(coord, "0123456789abcdef", 3, "cd" * 32)
    fields: dict[str, Any] = dict(
        run_id="0123456789abcdef", round=0, attempt=0, start_hash="a" * 64, new_hash="b" * 64,
        new_cid="c" * 64, new_size=1, accepted=[], rejected=[], closed_at=1.0, reason="all in",
    )  # fmt: skip
    old = schemas.Certificate(**fields)  # a certificate from before heads: signed without
    assert b"ledger_head" not in certificate_message(old)
    cert = schemas.Certificate(**fields, ledger_head=schemas.LedgerHead(**head.to_dict()))
    cert = cert.model_copy(update={"signature": coord.sign(certificate_message(cert))})
    assert certificate_is_signed(cert, coord.public_key)
    swapped = sign_head(coord, "0123456789abcdef", 2, "ef" * 32)
    forged = cert.model_copy(update={"ledger_head": schemas.LedgerHead(**swapped.to_dict())})
    assert not certificate_is_signed(forged, coord.public_key)


# -- holding a ledger to its heads ----------------------------------------------------------


def test_heads_refuse_a_truncated_or_rewritten_copy(
    tmp_path: Path, cli: Callable[..., Any]
) -> None:
    run, _ = full_run(tmp_path)
    entries = run.entries()
    n = len(entries)
    head = sign_head(run.coord, "r" * 16, n, entries[-1].hash)
    early = sign_head(run.coord, "r" * 16, 5, entries[4].hash)
    given = heads_file(tmp_path / "heads.jsonl", [early, head])
    result = cli("verify", tmp_path, "--heads", given)
    assert result.exit_code == 0, result.output
    assert f"held to 2 signed head(s): the ledger reaches the longest (length {n})" in (
        result.output
    )
    # cut short from entry 9 onward: refused, naming the head; without heads: OK, honestly
    run.conn.execute("DELETE FROM ledger WHERE idx >= 9")
    result = cli("verify", tmp_path, "--heads", given)
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (
        f"ledger INVALID: signed head at length {n} ({given} line 2; hash {head.hash[:16]}...): "
        "the ledger has only 9 entries: it was cut short or rolled back"
    )
    result = cli("verify", tmp_path)
    assert result.exit_code == 0, result.output
    assert "no signed heads given: a truncated copy cannot be detected" in result.output
    # a head whose entry differs at its length (a rewritten ledger, re-signed)
    other = sign_head(run.coord, "r" * 16, 5, entries[3].hash)
    with pytest.raises(LedgerError, match=r"signed head at length 5 .* it was rewritten") as e:
        check_heads(read_entries(run.conn), [(other, "x")])
    assert e.value.index == 4


def test_unsigned_balances_decide_nothing(tmp_path: Path, cli: Callable[..., Any]) -> None:
    """The balances file claiming more entries than a truncated copy holds is no proof (it
    can be edited or deleted); it is reported, and only a signed head refuses the copy."""
    run, _ = full_run(tmp_path)
    (tmp_path / audit.BALANCES_FILE).write_text(json.dumps(run.book.summary()))
    run.conn.execute("DELETE FROM ledger WHERE idx >= 9")
    result = cli("verify", tmp_path)
    assert result.exit_code == 0, result.output
    assert "unsigned balances file claims" in result.output
    assert "no signed heads given" in result.output


def test_two_signed_heads_at_one_length_prove_a_fork(
    tmp_path: Path, cli: Callable[..., Any]
) -> None:
    run, _ = full_run(tmp_path)
    entries = run.entries()
    a = sign_head(run.coord, "r" * 16, 6, entries[5].hash)
    b = sign_head(run.coord, "r" * 16, 6, "9" * 64)  # what a forked ledger had at 6
    first = heads_file(tmp_path / "peer-a.jsonl", [a])
    second = heads_file(tmp_path / "peer-b.jsonl", [b])
    result = cli("verify", tmp_path, "--heads", first, "--heads", second)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("ledger FORKED: the coordinator signed two different heads at ")
    assert json.loads(lines[1].split(": ", 1)[1]) == a.to_dict()
    assert json.loads(lines[2].split(": ", 1)[1]) == b.to_dict()
    with pytest.raises(ForkError):
        check_heads(entries, [(a, "a"), (b, "b")])


def test_heads_of_another_run_or_signer_are_ignored_with_a_warning(
    tmp_path: Path, cli: Callable[..., Any]
) -> None:
    run, _ = full_run(tmp_path)
    entries = run.entries()
    n = len(entries)
    stranger = Identity.generate()
    forged = sign_head(stranger, "r" * 16, n + 5, "1" * 64)  # would refuse the ledger
    elsewhere = sign_head(run.coord, "s" * 16, n + 5, "1" * 64)  # the same key, another run
    bad = Head("r" * 16, n + 5, "1" * 64, "0" * 128)
    path = heads_file(tmp_path / "h.jsonl", [forged, elsewhere, bad])
    with path.open("a") as f:
        f.write('{"not": "a head"}\n')
    kept, warnings = usable(
        [(forged, "1"), (elsewhere, "2"), (bad, "3")], "r" * 16, run.coord.public_key
    )
    assert kept == [] and len(warnings) == 3 and "another" not in warnings[0]
    result = cli("verify", tmp_path, "--heads", path)
    assert result.exit_code == 0, result.output
    assert "no valid signed heads: a truncated copy cannot be detected" in result.output
    assert result.output.count("warning: ") == 4  # three ignored heads, one line no head
    assert "not this run: ignored" in result.output
    assert "not signed by the run's coordinator key: ignored" in result.output
    result = cli("verify", tmp_path, "--heads", tmp_path / "nowhere.jsonl")
    assert result.exit_code == 2


def test_a_peer_keeps_one_valid_head_per_length(tmp_path: Path) -> None:
    coord = Identity.generate()
    keeper = HeadKeeper(tmp_path, "r" * 16, coord.public_key)
    a = sign_head(coord, "r" * 16, 4, "4" * 64)
    assert keeper.keep(a.to_dict(), "receipt") == a
    assert keeper.keep(a.to_dict(), "certificate") == a  # the same head: kept once
    assert keeper.keep(sign_head(Identity.generate(), "r" * 16, 5, "5" * 64).to_dict(), "x") is None
    assert keeper.keep({"length": "many"}, "x") is None and keeper.keep(None, "x") is None
    fork = sign_head(coord, "r" * 16, 4, "f" * 64)
    again = HeadKeeper(tmp_path, "r" * 16, coord.public_key)  # after a restart
    assert again.keep(a.to_dict(), "receipt") == a and again.keep(fork.to_dict(), "y") == fork
    lines = (tmp_path / HEADS_FILE).read_text().splitlines()
    assert lines == [head_line(a), head_line(fork)]


# -- real processes -------------------------------------------------------------------------

SPEC = """
name = "heads"
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 4
[rounds]
target_compute_s = 2
heartbeat_s = 1.0
dead_after_s = 6.0
min_peers = 1
deadline_min_s = 5
deadline_max_s = 30
checkpoint_every = 1
"""


def snapshot(db: Path, out: Path) -> Path:
    """A consistent copy of a live SQLite database (its backup API), as a data directory."""
    out.mkdir(parents=True)
    src = sqlite3.connect(db)  # read-write: a read-only one may miss the writer's WAL
    dst = sqlite3.connect(out / audit.DB_FILE)
    with dst:
        src.backup(dst)
    src.close(), dst.close()
    return out


def covey(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "covey", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.network
def test_a_workers_kept_heads_refuse_a_truncated_copy_and_an_old_snapshot(
    tmp_path: Path,
) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    with LocalCluster(spec, tmp_path) as c:
        c.start_coordinator()
        c.start_worker("w1")
        c.wait_for(lambda s: s["committed_rounds"] >= 1, 180, "a first committed round")
        old = snapshot(c.data_dir / audit.DB_FILE, tmp_path / "old")
        old_length = len(read_entries(old / audit.DB_FILE))
        c.wait_for(lambda s: s["committed_rounds"] >= 2, 180, "two committed rounds")
        kept = c.run_dir / "peers" / "w1" / HEADS_FILE
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:  # the heads in the receipts and certificates
            lines = kept.read_text().splitlines() if kept.is_file() else []
            lengths = [json.loads(x)["length"] for x in lines]
            if max(lengths, default=0) > old_length:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the worker kept no head past {old_length}: {c.tail('w1')}")
        served = c.get("/v1/ledger/head")
        assert served["run_id"] == c.run_id and served["length"] >= max(lengths)
        # live: the heads are read first, the ledger after them (it only grows)
        ok = covey("ledger", "verify", c.url, "--heads", kept, "--heads", c.url)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "signed head(s): the ledger reaches the longest" in ok.stdout
    latest = snapshot(c.data_dir / audit.DB_FILE, tmp_path / "latest")  # the run is over
    ok = covey("ledger", "verify", latest, "--heads", kept)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # the whole run's copy, cut short from an entry the worker holds a head beyond
    cut = snapshot(latest / audit.DB_FILE, tmp_path / "cut")
    with sqlite3.connect(cut / audit.DB_FILE) as conn:
        conn.execute("DELETE FROM ledger WHERE idx >= ?", (old_length,))
    for copy in (cut, old):
        refused = covey("ledger", "verify", copy, "--heads", kept.parent)  # the peer's directory
        assert refused.returncode == 1, refused.stdout + refused.stderr
        line = refused.stdout.strip()
        assert line.startswith("ledger INVALID: signed head at length "), line
        assert "cut short or rolled back" in line and len(refused.stdout.splitlines()) == 1
        alone = covey("ledger", "verify", copy)  # without the heads: nothing to tell by
        assert alone.returncode == 0, alone.stdout + alone.stderr
        assert "no signed heads given: a truncated copy cannot be detected" in alone.stdout
