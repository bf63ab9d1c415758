"""Missed fraud costs in a real rounds run: a coordinator process, two honest workers and a
sign-flipping one (`covey worker --behavior sign-flip`), an honest `covey validator`
process and a rubber-stamp validator key that reports "agree" on every check it is given
(tests/test_assignment.py's Squatter). The honest validator's disagreement goes to the
referee, which convicts; the rubber stamp, which agreed on that contribution, loses
validator_slash_fraction of its stake and its pay for the check, the cheater's paid work
(if any) is clawed back, `covey ledger verify` replays it all, and fails on the ledger
with the missed-fraud entry edited or re-signed with another amount. The same accounting
on the RL side: tests/test_checks.py and tests/test_rl_attacks.py."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from covey.io import audit
from covey.local.cluster import LocalCluster
from covey.rl.validator import RolloutValidator
from covey.trust.identity import Identity
from covey.trust.incentives import Book
from covey.trust.ledger import Entry, LedgerError
from tests.rl_helpers import join_funded, joined_worker, trainer_process, wait_for
from tests.test_assignment import Squatter
from tests.test_checks import resigned
from tests.test_rl_attacks import claim, honest_body, post, report, signed, with_batch

pytestmark = pytest.mark.network

STAMP_STAKE = 8.0
SPEC = """
name = "missed-fraud"
seed = 5
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 32
[algorithm]
method = "diloco"
inner_steps = 4
codec = "fp32"
inner_state = "reset"
[rounds]
deadline_min_s = 4
eval_batches = 1
min_peers = 3
max_rounds = 40
[trust]
sample_rate = 1.0
min_stake = 10.0
min_validator_stake = 5.0
validators_per_check = 2
validator_round_cap = 8
check_reward = 0.5
challenge_rounds = 1
verify_timeout_s = 20
commit_every = 2
canary_rate = 0.0
validator_slash_fraction = 0.5
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Squatter]]:
    tmp: Path = tmp_path_factory.mktemp("missed-fraud")
    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    cluster = LocalCluster(spec, tmp)
    stamp = None
    try:
        cluster.start_coordinator()
        stamp = Squatter(cluster, stake=STAMP_STAKE, stamp=True)
        stamp.thread.start()
        cluster.start_validator("checker", "--stake", "5")
        for name in ("h0", "h1"):
            cluster.start_worker(name, "--stake", "20")
        cluster.start_worker("cheat", "--stake", "20", "--behavior", "sign-flip")
        yield cluster, stamp
    finally:
        if stamp is not None:
            stamp.stop.set()
        cluster.stop()


def _missed(entries: list[Entry], stamp: str) -> list[Entry]:
    return [
        e
        for e in entries
        if e.type == "penalty"
        and e.payload["peer_id"] == stamp
        and e.payload["kind"] == "missed fraud"
    ]


@pytest.mark.long  # about 35 s: five processes, a few rounds
def test_a_validator_that_agreed_with_a_convicted_contribution_pays_for_it(
    run: tuple[LocalCluster, Squatter], tmp_path: Path
) -> None:
    cluster, stamp = run
    cheat = cluster.ids["cheat"]
    end = time.monotonic() + 240
    while not _missed(entries := audit.load(cluster.url)[0], stamp.id):
        assert time.monotonic() < end, "\n".join(
            cluster.tail(n) for n in ("coordinator", "checker")
        )
        time.sleep(1.0)  # polling the ledger under a deadline
    [penalty, *_] = _missed(entries, stamp.id)
    rnd = penalty.payload["round"]
    before = [e for e in entries if e.index < penalty.index]
    # convicted by the referee on the honest validator's report, after the stamp agreed
    frauds = [
        e
        for e in before
        if e.type == "dispute" and e.payload["outcome"] == "fraud" and e.payload["round"] == rnd
    ]
    assert [e.payload["peer_id"] for e in frauds] == [cheat]
    assert frauds[0].payload["validator_id"] == cluster.ids["checker"]
    agreed = [
        e
        for e in before
        if e.type == "verification"
        and e.payload["validator_id"] == stamp.id
        and (e.payload["round"], e.payload["peer_id"], e.payload["outcome"])
        == (rnd, cheat, "agree")
    ]
    assert len(agreed) == 1
    # validator_slash_fraction of the stake it had then: replay up to the penalty
    stake_then = Book.replay(before).accounts[stamp.id].stake
    assert penalty.payload["amount"] == 0.5 * stake_then > 0
    # and its pay for that check, taken back
    claws = [e for e in entries if e.type == "clawback" and e.payload["worker_id"] == cheat]
    [check] = [e for e in claws if e.payload["kind"] == "check"]
    assert check.payload["peer_id"] == stamp.id and check.payload["amount"] == 0.5
    assert check.payload["round"] == rnd
    # the cheater's work for the round: never paid, or paid and clawed back
    work = [
        e
        for e in entries
        if e.type == "reward"
        and e.payload["kind"] == "work"
        and (e.payload["round"], e.payload["peer_id"]) == (rnd, cheat)
    ]
    assert len([e for e in claws if e.payload["kind"] == "work"]) == len(work)
    # the honest validator, which disagreed, lost nothing
    balances = cluster.get("/v1/ledger/balances")["accounts"]
    assert balances[cluster.ids["checker"]]["stake"] == 5.0
    taken = penalty.payload["amount"] + check.payload["amount"]
    assert balances[stamp.id]["stake"] <= STAMP_STAKE - taken + 1e-9
    audit.verify(cluster.url)  # the whole ledger replays

    # an edited missed-fraud entry fails the audit, naming it
    export = tmp_path / "ledger.jsonl"
    audit.write_jsonl(entries, export)
    lines = export.read_text().splitlines()
    line = json.loads(lines[penalty.index])
    line["payload"]["amount"] = 0.0
    lines[penalty.index] = json.dumps(line, sort_keys=True, separators=(",", ":"))
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join(lines) + "\n")
    with pytest.raises(LedgerError) as e:
        audit.verify(tampered)
    assert e.value.index == penalty.index

    # and so does one the coordinator re-signs with its own key at a smaller amount
    key = Identity.load_or_create(cluster.data_dir / "coordinator.key")

    def smaller(entry: Entry) -> tuple[str, dict[str, Any]]:
        if entry.index == penalty.index:
            return entry.type, {**entry.payload, "amount": entry.payload["amount"] / 2}
        return entry.type, entry.payload

    dishonest = resigned(entries, key, tmp_path / "dishonest", smaller)
    with pytest.raises(LedgerError, match="is not validator_slash_fraction") as e:
        audit.verify(dishonest)
    assert e.value.index == penalty.index


# -- the same accounting on the RL side --------------------------------------------------


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with trainer_process(tmp_path_factory.mktemp("rl-missed") / "run") as url:
        yield url


def test_an_rl_validator_that_agreed_with_a_bad_batch_pays_for_it_the_same_way(
    trainer: str,
) -> None:
    """A validator reports "agree" on a batch whose proofs are garbage; the trainer's audit
    (audit_rate 1.0) rejects it, and covey.coordinator.checks.Checks.convict, the code the
    rounds referee calls, charges the validator validator_slash_fraction of its stake; its
    check was not paid, so nothing is clawed back; the ledger replays."""
    checker = RolloutValidator(trainer, Identity.generate(), name="v-agrees")
    join_funded(trainer, checker, "validator")
    w = joined_worker(trainer)
    try:
        body, v = honest_body(trainer, w)
        garbage = base64.b64encode(b"\x00" * 7).decode()
        attack = with_batch(
            body, samples=[{**s, "proof": garbage} for s in body["batch"]["samples"]]
        )
        r = post(trainer, "/v1/rl/batch", signed(w.identity, "/v1/rl/batch", attack, v))
        assert r.status_code == 200, r.text
        cid = r.json()["cid"]
        task = wait_for(lambda: claim(trainer, checker), 10, "the checker's assignment")
        assert task["batch_cid"] == cid
        r = report(trainer, checker, cid, ok=True)
        assert r.status_code == 200 and r.json()["outcome"] == "missed", r.text
        entries = audit.load(trainer)[0]
        me = checker.identity.peer_id
        [penalty] = [e for e in entries if e.type == "penalty" and e.payload["peer_id"] == me]
        assert penalty.payload["kind"] == "missed fraud"
        before = Book.replay([e for e in entries if e.index < penalty.index])
        fraction = before.policy.validator_slash_fraction  # type: ignore[union-attr]
        assert penalty.payload["amount"] == fraction * before.accounts[me].stake > 0
        paid = [
            e
            for e in entries
            if e.type == "reward" and e.payload["peer_id"] == me and e.payload["kind"] == "check"
        ]
        assert not paid and not [e for e in entries if e.type == "clawback"]
        audit.verify(trainer)
    finally:
        w.membership.leave()
        checker.membership.leave("shutdown")
