"""A check's deadline follows its evidence (covey.trust.policy.check_timeout_s): a drawn
check may be held for verify_timeout_s plus its evidence at the worker's paced rate, so an
honest check of a big model's private state is not expired; the validator's fetch (and
its withheld attestation), the coordinator's expiry and the unbonding period all count it
with `evidence_deadline_s`. Unit tests of the numbers, the in-process coordinator's sweep
(tests/test_evidence.py's harness), the auditor's hold on the policy, and a real run:
coordinator, worker and validator processes on 127.0.0.1 whose check takes longer than
verify_timeout_s and is not expired."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from covey.config import RunConfig, TrustConfig, load_run_config
from covey.coordinator.service import Coordinator
from covey.io import audit
from covey.local.cluster import LocalCluster
from covey.trust.ledger import LedgerError, read_entries
from covey.trust.policy import (
    CHECK_EVIDENCE_STATES,
    EVIDENCE_FETCHERS,
    Policy,
    check_timeout_s,
    evidence_deadline_s,
    unbonding_delay,
)
from tests import test_evidence
from tests.test_evidence import Peer, entries_of, overdue
from tests.test_offpath import HandValidator

GPT2_SMALL = 124_439_808  # parameters of the 124M GPT
PRIVATE_BYTES = 16  # a parameter's private state: AdamW's two moments, residual and pending


def test_a_big_models_check_outlasts_verify_timeout_by_its_evidence() -> None:
    trust = TrustConfig()
    state = GPT2_SMALL * PRIVATE_BYTES  # 1.99 GB
    one_fetch = state * 8 * EVIDENCE_FETCHERS / (trust.evidence_mbps * 1e6)
    assert one_fetch > 3000  # ~2,000 s alone at 8 Mbit/s, shared by two fetches
    assert evidence_deadline_s(30.0, state, trust.evidence_mbps) == pytest.approx(30 + one_fetch)
    held = check_timeout_s(trust.verify_timeout_s, state, trust.evidence_mbps)
    assert held == pytest.approx(trust.verify_timeout_s + CHECK_EVIDENCE_STATES * one_fetch)
    # a validator's fetches (a request timeout and one state each) end within it
    fetches = CHECK_EVIDENCE_STATES * evidence_deadline_s(
        RunConfig().limits.request_timeout_s, state, trust.evidence_mbps
    )
    assert fetches < held
    # a method with no private state: verify_timeout_s, as before
    assert check_timeout_s(trust.verify_timeout_s, 0, trust.evidence_mbps) == 120.0


def test_the_unbonding_period_counts_each_checks_evidence() -> None:
    trust, rounds = TrustConfig(), RunConfig().rounds
    state = GPT2_SMALL * PRIVATE_BYTES
    none = Policy.from_config(trust, rounds.deadline_max_s, held_stake=True)
    assert none.evidence_bytes == 0 and none.unbonding_s == 2040.0  # docs/trust.md
    big = Policy.from_config(trust, rounds.deadline_max_s, held_stake=True, evidence_bytes=state)
    checks = 2 * trust.validators_per_check + 2 + trust.dispute_attempts
    evidence_s = check_timeout_s(0.0, state, trust.evidence_mbps)
    assert big.evidence_bytes == state
    assert big.unbonding_s == pytest.approx(2040.0 + checks * evidence_s)
    assert big.unbonding_s == unbonding_delay(
        round_s=rounds.deadline_max_s, challenge_rounds=trust.challenge_rounds,
        verify_timeout_s=trust.verify_timeout_s,
        validators_per_check=trust.validators_per_check,
        dispute_attempts=trust.dispute_attempts,
        shard_publish_timeout_s=trust.shard_publish_timeout_s,
        state_bytes=state, evidence_mbps=trust.evidence_mbps,
    )  # fmt: skip
    assert Policy.from_dict(big.to_dict()) == big
    older = {k: v for k, v in big.to_dict().items() if k != "evidence_bytes"}
    assert Policy.from_dict(older).evidence_bytes == 0  # a ledger written before it


def test_the_auditor_holds_the_unbonding_period_to_the_policys_evidence() -> None:
    spec = RunConfig()
    honest = Policy.from_config(
        spec.trust, spec.rounds.deadline_max_s, held_stake=True, evidence_bytes=1 << 20
    )
    created = {"spec": spec.model_dump(mode="json"), "policy": honest.to_dict()}
    audit._check_treasury_terms(created)
    short = {**honest.to_dict(), "unbonding_s": 2040.0}  # the evidence left out
    with pytest.raises(LedgerError, match=r"policy\.unbonding_s is 2040\.0, but the spec"):
        audit._check_treasury_terms({**created, "policy": short})
    for bad in (-1, "big", 1.5, True):
        with pytest.raises(LedgerError, match=r"policy\.evidence_bytes"):
            audit._check_treasury_terms(
                {**created, "policy": {**honest.to_dict(), "evidence_bytes": bad}}
            )


SLOW = """
evidence_mbps = 0.05
verify_timeout_s = 5
"""


@pytest.fixture
def slow(tmp_path: Path):
    """tests/test_evidence.py's coordinator, its workers' evidence paced at 0.05 Mbit/s."""
    spec = tmp_path / "run.toml"
    spec.write_text(test_evidence.SPEC.format(min_peers=1, new=0) + SLOW)
    coord = Coordinator(load_run_config(spec), tmp_path / "data")
    yield coord
    coord.stop()


def test_the_coordinator_expires_a_check_at_its_evidence_deadline(slow: Any) -> None:
    """A drawn check held past verify_timeout_s is not missed while its evidence may still
    be moving at the paced rate; held past `check_timeout_s`, it is."""
    coord = slow
    size = coord.rounds.evidence_size
    assert size > 0
    held = coord.verification.check_timeout_s
    assert held == check_timeout_s(5.0, size, 0.05) > 5.0 + 60
    entries = read_entries(coord.data_dir / "coordinator.db")
    [created] = [e for e in entries if e.type == "run created"]
    assert created.payload["policy"]["evidence_bytes"] == size
    peer = Peer(coord, "drawn")
    coord.tick(time.time())
    assert isinstance(peer.submit(peer.k_drawn(want=True)), dict)
    overdue(coord)
    coord.tick(time.time())
    validator = HandValidator(coord, "v")
    assert validator.claim() is not None
    [row] = coord.db.query("SELECT assigned_at FROM checks WHERE validator_id = ?", (validator.id,))
    at = row["assigned_at"]

    def sweep(now: float) -> list[Any]:
        with coord.verification.accounts.transaction() as c:
            coord.verification._sweep(c, now)
        return [
            e for e in entries_of(coord, peer.id)
            if e.type == "verification" and e.payload["outcome"] == "expired"
        ]  # fmt: skip

    assert sweep(at + 5.0 + 1) == []  # past verify_timeout_s: its evidence may be moving
    assert sweep(at + held - 1) == []
    [expired] = sweep(at + held + 1)
    assert expired.payload["validator_id"] == validator.id


REAL = """
name = "check-deadline"
seed = 3
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 32
[algorithm]
method = "diloco"
inner_steps = 4
[rounds]
deadline_min_s = 4
eval_batches = 1
min_peers = 1
max_rounds = 40
[limits]
request_timeout_s = 2
[trust]
sample_rate = 1.0
new_peer_contributions = 0
validators_per_check = 1
audit_rate = 0.0
canary_rate = 0.0
verify_timeout_s = {verify}
evidence_mbps = {mbps}
"""
VERIFY_S = 3.0


@pytest.mark.network
@pytest.mark.long  # about 40 s: three processes, the evidence paced to take 3-4 s a fetch
def test_an_honest_check_slower_than_verify_timeout_is_not_expired(tmp_path: Path) -> None:
    """A worker whose evidence (its private state) takes longer than verify_timeout_s at the
    run's paced rate is checked and agreed with, and no check expires while a second
    validator's claims sweep the checks: the coordinator holds a check for
    `check_timeout_s`."""
    from covey.algorithms import build_strategy
    from covey.models.source import build_run_model
    from covey.trust.verify import published_state_nbytes

    probe = tmp_path / "probe.toml"
    probe.write_text(REAL.format(verify=VERIFY_S, mbps=1.0))
    cfg = load_run_config(probe)
    model, loss, _, _ = build_run_model(cfg.model, cfg.seed, tokenizer_vocab=256, seq_len=32)
    size = published_state_nbytes(build_strategy(cfg.algorithm, model, loss))
    mbps = size * 8 / (1.5 * VERIFY_S * 1e6)  # one state alone takes 1.5 x verify_timeout_s
    spec = tmp_path / "run.toml"
    spec.write_text(REAL.format(verify=VERIFY_S, mbps=f"{mbps:.6f}"))
    cluster = LocalCluster(spec, tmp_path / "run")
    with cluster:
        cluster.start_coordinator()
        cluster.start_worker("w", "--stake", "10")
        for name in ("v0", "v1"):  # an idle one's claims sweep while the other fetches
            cluster.start_validator(name)
        deadline = time.monotonic() + 240
        while True:
            entries = audit.load(cluster.url)[0]
            checked = {
                e.payload["round"]: e
                for e in entries
                if e.type == "verification" and e.payload["outcome"] == "agree"
            }
            if any(r >= 1 for r in checked):  # a check that fetched a start state
                break
            assert time.monotonic() < deadline, cluster.tail("v0") + cluster.tail()
            time.sleep(1.0)  # polling the ledger under a deadline
    assigned = {
        e.payload["round"]: e.at
        for e in entries
        if e.type == "assignment" and e.payload["peer_id"] == cluster.ids["w"]
    }
    chained = min(r for r in checked if r >= 1)
    took = checked[chained].at - assigned[chained]
    assert took > VERIFY_S, took  # slower than verify_timeout_s: the old expiry missed it
    assert [e for e in entries if e.type == "verification"
            and e.payload["outcome"] in ("expired", "withheld")] == []  # fmt: skip
