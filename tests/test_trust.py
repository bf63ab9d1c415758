"""Trust end to end, with real processes on 127.0.0.1: cheating workers are rejected at
intake or caught by a validator's re-execution and slashed; honest workers over 50 rounds
(with different thread counts) never are; the ledger of a real run verifies, from the
data directory and over HTTP, and one flipped byte makes it fail naming the entry."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from covey.io import audit
from covey.local.cluster import ClusterError, LocalCluster
from covey.trust.identity import canonical_json
from covey.trust.ledger import Entry, check_entry, parse_line

pytestmark = [pytest.mark.network, pytest.mark.slow]

SPEC = """
name = "trust"
seed = 3
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 10
codec = "fp32"
inner_state = "reset"
outer_momentum = 0.5
[rounds]
deadline_min_s = 8
eval_batches = 1
{rounds}
[trust]
min_stake = 10.0
commit_every = 5
"""


def spec(tmp: Path, rounds: str = "") -> Path:
    path = tmp / "run.toml"
    path.write_text(SPEC.format(rounds=rounds))
    return path


def entries(cluster: LocalCluster) -> list[Entry]:
    found, _, _ = audit.load(cluster.url)
    return found


def certified_rounds(ledger: list[Entry], peer: str) -> list[int]:
    """Rounds whose certificate names the peer (accepted or rejected)."""
    return [
        e.payload["round"]
        for e in ledger
        if e.type == "round certificate" and peer in e.payload["accepted"] + e.payload["rejected"]
    ]


def refusals(cluster: LocalCluster, ledger: list[Entry], behavior: str, peer: str) -> list[int]:
    """Rounds in which the peer's contribution was refused at intake: its "contribution
    rejected" ledger entries. A replayed request is refused before it is authenticated (a
    copy proves nothing about who sent it), so it is never written against the peer it
    claims to be: for the replay, the rounds are those its own log says were refused as
    replays."""
    if behavior == "replay":
        log = (cluster.logs / "replay.log").read_text(errors="replace")
        found = re.findall(r"round (\d+)\] replay refused: 401: replayed request", log)
        return sorted(int(r) for r in found)
    return sorted(
        e.payload["round"]
        for e in ledger
        if e.type == "contribution rejected" and e.payload["peer_id"] == peer
    )


def position(ledger: list[Entry], type: str, **match: Any) -> int | None:
    """Index of the first entry of `type` whose payload has these values."""
    for e in ledger:
        if e.type == type and all(e.payload.get(k) == v for k, v in match.items()):
            return e.index
    return None


# payload cheats need a validator's re-execution; the others are refused at intake
CAUGHT_BY_REEXECUTION = ("sign-flip", "scaled", "noise", "free-rider", "lazy", "wrong-data")
REFUSED_AT_INTAKE = ("stale", "replay", "copycat", "nan")


# intake refusals have fast HTTP tests (test_coordinator_input.py); the process run is long
@pytest.fixture(params=["re-execution", pytest.param("intake", marks=pytest.mark.long)])
def cheaters(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, ...]]:
    behaviors = CAUGHT_BY_REEXECUTION if request.param == "re-execution" else REFUSED_AT_INTAKE
    # rounds wait for 4 workers: a round that is one cheater's alone (a x100 update as the
    # first certificate) wrecks the model, after which honest and cheating work alike are
    # numerically unstable and the referee can convict nobody (docs/trust.md, "Robust
    # aggregation": runs that expect cheaters set min_peers >= 3)
    cluster = LocalCluster(spec(tmp_path, "min_peers = 4"), tmp_path)
    try:
        cluster.start_coordinator()
        # workers emulate hardware 3x slower than the validators': with every newcomer's
        # first contributions sampled, 8 new peers are 8x one peer's work to re-execute
        slow = ("--stake", "100", "--slowdown", "3")
        for name in ("h0", "h1"):
            cluster.start_worker(name, *slow)
        for behavior in behaviors:
            cluster.start_worker(behavior, *slow, "--behavior", behavior)
        for i in range(2 if request.param == "re-execution" else 1):
            cluster.start_validator(f"v{i}")
        yield cluster, behaviors
    finally:
        cluster.stop()


def diagnosis(cluster: LocalCluster, behaviors: tuple[str, ...]) -> str:
    """What a failed wait prints: who is who, the ledger's checks and disputes, the
    referee's lines of the coordinator log, and the tails of the other logs."""
    names = {p[:8]: n for n, p in cluster.ids.items()}
    checks = [
        f"{e.index} {e.type} round {e.payload['round']} "
        f"{names.get(e.payload['peer_id'][:8], e.payload['peer_id'][:8])}: "
        f"{e.payload.get('outcome', '')} "
        f"{e.payload.get('detail', e.payload.get('distance', e.payload.get('reason')))}"
        for e in entries(cluster)
        if e.type in ("verification", "dispute", "slash")
    ]
    log = (cluster.logs / "coordinator.log").read_text(errors="replace").splitlines()
    referee = [line for line in log if "dispute" in line or "referee" in line or "Error" in line]
    tails = "\n".join(cluster.tail(n, 15) for n in ("coordinator", "v0", "v1", *behaviors))
    return (
        "\n".join(
            [f"peers: {names}", "--- ledger checks ---", *checks, "--- referee ---", *referee[-60:]]
        )
        + "\n"
        + tails
    )


def test_every_cheat_is_refused_or_slashed_within_three_rounds(
    cheaters: tuple[LocalCluster, tuple[str, ...]],
) -> None:
    cluster, behaviors = cheaters
    ids = {b: cluster.ids[b] for b in behaviors}

    def settled(status: dict[str, Any]) -> bool:
        ledger = entries(cluster)
        return all(
            refusals(cluster, ledger, b, p)
            if b in REFUSED_AT_INTAKE
            else position(ledger, "slash", peer_id=p)
            for b, p in ids.items()
        )

    try:
        cluster.wait_for(settled, 240, "every cheat to be refused or slashed")
    except ClusterError as e:
        raise AssertionError(f"{e}\n{diagnosis(cluster, behaviors)}") from None
    ledger = entries(cluster)
    for behavior, peer in ids.items():
        # its first round: the first certificate naming it, or its first refusal (which
        # may come before the certificate of a round it was not yet a member of)
        refused = refusals(cluster, ledger, behavior, peer)
        first = min(certified_rounds(ledger, peer) + refused)
        slash = position(ledger, "slash", peer_id=peer)
        if behavior in REFUSED_AT_INTAKE:
            assert refused and refused[0] <= first + 2, (behavior, first, refused)
            continue
        assert slash is not None, f"{behavior} was not slashed"
        caught = ledger[slash].payload["round"]
        assert caught <= first + 2, f"{behavior}: first round {first}, caught in {caught}"
        # and the slash landed before the certificate of its fourth round after that: checks
        # run off the critical path (a disputed end state is fetched at the paced evidence
        # rate, then refereed) while this run's rounds of a few seconds go on
        later = position(ledger, "round certificate", round=first + 4)
        assert later is None or slash < later, f"{behavior}: slashed only after {first + 4}"
        assert any(
            e.type == "dispute" and e.payload["outcome"] == "fraud" and e.payload["peer_id"] == peer
            for e in ledger
        )
    for honest in ("h0", "h1"):
        assert position(ledger, "slash", peer_id=cluster.ids[honest]) is None
    report = audit.verify(cluster.url)  # chain, signatures, balances = the coordinator's
    assert report.entries >= len(ledger) and report.compared_at is not None
    if "replay" in behaviors:
        assert "replayed request" in cluster.tail("coordinator", 2000)
    # each refusal at intake says what was wrong
    why = {"nan": "NaN or Inf", "stale": "same bytes", "copycat": "same bytes"}
    for behavior in set(behaviors) & set(why):
        reasons = [
            e.payload["reason"]
            for e in ledger
            if e.type == "contribution rejected" and e.payload["peer_id"] == ids[behavior]
        ]
        assert any(why[behavior] in r for r in reasons), (behavior, reasons)
    summary = cluster.get("/v1/ledger/balances")
    for behavior in set(behaviors) & set(CAUGHT_BY_REEXECUTION):
        account = summary["accounts"][ids[behavior]]
        # banned, and at least one slash of half its stake of 100 (one per proven fraud)
        assert account["banned"] and account["stake"] <= 50.0, (behavior, account)


@pytest.mark.long  # over a minute: `scripts/dev.py test --all`
def test_honest_run_of_50_rounds_is_never_slashed_and_its_ledger_verifies(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(spec(tmp_path, "max_rounds = 50"), tmp_path)
    with cluster:
        cluster.start_coordinator()
        # the validator runs 2 threads, the workers 1: every re-execution is on another
        # thread count than the work it checks, so float sums differ in their last bits
        cluster.start_worker("t1", "--stake", "20", "--threads", "1")
        cluster.start_worker("t2", "--stake", "20", "--threads", "1")
        cluster.start_validator("v0", "--threads", "2")
        cluster.wait_for(lambda s: s["committed_rounds"] >= 50, 400, "50 rounds")
        ledger = entries(cluster)
        checks = [e for e in ledger if e.type == "verification"]
        # no honest worker is ever convicted. A cross-thread re-execution may (rarely: once
        # in three full-suite runs on 2026-11-23) drift past the tolerance; the validator
        # then disputes, and the referee, recomputing, must side with the worker
        assert not [e for e in ledger if e.type == "slash"], "an honest peer was slashed"
        disputes = [e for e in ledger if e.type == "dispute"]
        assert all(e.payload["outcome"] != "fraud" for e in disputes), disputes
        assert len(disputes) <= 1, f"honest work disputed {len(disputes)} times: {disputes}"
        assert len(checks) >= 6, "the first contributions of new peers are all re-executed"
        outcomes = [e.payload["outcome"] for e in checks]
        assert set(outcomes) <= {"agree", "expired", "disagree"}, outcomes
        assert outcomes.count("disagree") <= len(disputes), outcomes
        inexact = [e for e in checks if e.payload["outcome"] == "agree" and not e.payload["exact"]]
        assert inexact, "no re-execution differed in the last bits: the tolerance went untested"
        # balances the coordinator reports equal the ledger replayed from scratch
        report = audit.verify(cluster.url)
        assert report.compared_at is not None
        paid = {p: a["balance"] for p, a in cluster.get("/v1/ledger/balances")["accounts"].items()}
        assert all(paid[cluster.ids[n]] > 0 for n in ("t1", "t2"))
        # every worker kept verifiable receipts of its accepted contributions
        key = cluster.get("/v1/run")["coordinator_key"]
        for name in ("t1", "t2"):
            lines = (tmp_path / "peers" / name / "receipts.jsonl").read_text().splitlines()
            assert len(lines) >= 40, name
            for i, line in enumerate(lines):
                check_entry(parse_line(line, i), key)
    coord_dir = tmp_path / "coordinator"
    cli = [sys.executable, "-m", "covey", "ledger"]
    ok = subprocess.run([*cli, "verify", str(coord_dir)], capture_output=True, text=True)
    assert ok.returncode == 0 and "ledger OK" in ok.stdout, ok.stdout + ok.stderr
    exported = tmp_path / "ledger.jsonl"
    subprocess.run([*cli, "export", str(coord_dir), "--out", str(exported)], check=True)
    lines = exported.read_bytes().split(b"\n")
    victim = len(lines) // 2
    flipped = bytearray(lines[victim])
    at = flipped.index(b'"tokens":') + 9 if b'"tokens":' in flipped else len(flipped) // 2
    flipped[at] ^= 0x01
    lines[victim] = bytes(flipped)
    exported.write_bytes(b"\n".join(lines))
    bad = subprocess.run([*cli, "verify", str(exported)], capture_output=True, text=True)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"entry {victim}" in bad.stdout, bad.stdout
    # the same tampering inside the coordinator's database is caught too
    import sqlite3

    with sqlite3.connect(coord_dir / "coordinator.db") as db:
        row = db.execute("SELECT payload FROM ledger WHERE idx = ?", (victim,)).fetchone()
        payload = json.loads(row[0])
        payload["tampered"] = True
        db.execute("UPDATE ledger SET payload = ? WHERE idx = ?", (canonical_json(payload), victim))
    bad = subprocess.run([*cli, "verify", str(coord_dir)], capture_output=True, text=True)
    assert bad.returncode == 1 and f"entry {victim}" in bad.stdout, bad.stdout + bad.stderr
