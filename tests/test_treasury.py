"""The run's treasury (covey.trust.treasury): a key bonds only credits it holds, from the
owner's signed deposits, the spec's grants or pay it earned; leaving unbonds after a delay
in which slashes still land; `covey ledger verify` reports a bond above the balance, a
release before its time and a deposit the owner did not sign. Pure unit tests on a ledger
written the coordinator's way; the real processes are in tests/test_treasury_network.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from covey.config import RunConfig, TrustConfig
from covey.io import audit
from covey.trust.identity import Identity, request_purpose
from covey.trust.ledger import LedgerError
from covey.trust.policy import Policy, unbonding_delay
from covey.trust.treasury import DEPOSIT_PATH
from tests.test_ledger import POLICY, Run

HELD = dataclasses.replace(POLICY, held_stake=1, unbonding_s=100.0)
RUN_ID = "r" * 16


def deposit_payload(owner: Identity, key: Identity, credits: float) -> dict[str, Any]:
    """A "deposit" payload as the coordinator writes the owner's signed request."""
    body = {"run_id": RUN_ID, "owner_key": owner.public_key, "to": key.public_key}
    request = owner.sign_request({**body, "amount": credits}, purpose=request_purpose(DEPOSIT_PATH))
    return {
        "peer_id": key.peer_id,
        "public_key": key.public_key,
        "amount": credits,
        "source": "owner",
        "request": request,
    }


def owner_deposit(run: Run, owner: Identity, key: Identity, credits: float, **change: Any) -> Any:
    """Write the owner's deposit (with `change`: a payload that differs from its request)."""
    return run.add("deposit", **{**deposit_payload(owner, key, credits), **change})


def joined(run: Run, me: Identity, role: str = "worker") -> str:
    run.add("join", peer_id=me.peer_id, public_key=me.public_key, name="p", role=role)
    return me.peer_id


def test_a_key_bonds_only_what_the_owner_deposited(tmp_path: Path) -> None:
    run = Run(tmp_path, HELD)
    me = Identity.generate()
    peer = joined(run, me)
    with pytest.raises(LedgerError, match=r"more than key .* holds"):
        run.add("stake", peer_id=peer, amount=10.0)
    owner_deposit(run, run.coord, me, 10.0)  # the spec names no owner: the coordinator's key
    assert run.book.held(peer) == 10.0
    with pytest.raises(LedgerError, match=r"stake 12.0 is more than .* \(10 credits"):
        run.add("stake", peer_id=peer, amount=12.0)
    run.add("stake", peer_id=peer, amount=10.0)
    assert (run.book.accounts[peer].stake, run.book.held(peer)) == (10.0, 0.0)
    audit.verify(tmp_path)


def test_a_deposit_must_be_the_owners_signed_request(tmp_path: Path) -> None:
    owner = Identity.generate()
    run = Run(tmp_path, HELD, spec={"owner_key": owner.public_key})
    me, stranger = Identity.generate(), Identity.generate()
    for bad, words in (
        (dict(signer=run.coord), "not the owner"),  # the coordinator is not this run's owner
        (dict(signer=stranger), "not the owner"),
        (dict(amount=99.0), "differs from the owner's signed request"),
        (dict(public_key=stranger.public_key), "is not the id of key"),
    ):
        signer = bad.pop("signer", owner)
        with pytest.raises(LedgerError, match=words):
            owner_deposit(run, signer, me, 5.0, **bad)
    forged = deposit_payload(owner, me, 5.0)
    forged["request"]["signature"] = "0" * 128
    with pytest.raises(LedgerError, match="signature does not verify"):
        run.add("deposit", **forged)
    entry = owner_deposit(run, owner, me, 5.0)
    with pytest.raises(LedgerError, match="a replay"):  # one signed request, credited twice
        run.add("deposit", **entry.payload)
    assert run.book.held(me.peer_id) == 5.0 and run.book.deposited == 5.0


def test_the_specs_funds_credit_once_and_exactly(tmp_path: Path) -> None:
    me = Identity.generate()
    spec = {"trust": {"funds": {me.public_key: 7.5}}}
    run = Run(tmp_path, HELD, spec=spec)
    deposit = dict(peer_id=me.peer_id, public_key=me.public_key, source="spec")
    with pytest.raises(LedgerError, match=r"grant key .* 7.5, not 8"):
        run.add("deposit", amount=8.0, **deposit)
    run.add("deposit", amount=7.5, **deposit)
    with pytest.raises(LedgerError, match="deposited already"):
        run.add("deposit", amount=7.5, **deposit)
    joined(run, me)
    run.add("stake", peer_id=me.peer_id, amount=7.5)


def test_earned_pay_can_be_bonded(tmp_path: Path) -> None:
    run = Run(tmp_path, dataclasses.replace(HELD, min_stake=0.0))
    peer = joined(run, Identity.generate())
    run.add("stake", peer_id=peer, amount=0.0)  # zero stake where the run allows it
    run.accept(0, peer, 4000, sampled=False)
    run.add("reward", round=0, peer_id=peer, amount=4.0, kind="work", tokens=4000)
    assert run.book.held(peer) == 4.0
    run.add("stake", peer_id=peer, amount=4.0)
    assert run.book.accounts[peer].stake == 4.0 and run.book.held(peer) == 0.0


def test_unbonding_keeps_the_stake_slashable_until_its_release(tmp_path: Path) -> None:
    run = Run(tmp_path, HELD)
    me = Identity.generate()
    peer = joined(run, me, role="validator")
    owner_deposit(run, run.coord, me, 10.0)
    run.add("stake", peer_id=peer, amount=10.0)
    run.add("leave", peer_id=peer, reason="shutdown")
    with pytest.raises(LedgerError, match=r"before the entry.s time \+ unbonding_s"):
        run.add("unbond", peer_id=peer, amount=10.0, release_at=run.at + 50.0)
    with pytest.raises(LedgerError, match=r"is not peer .* stake"):
        run.add("unbond", peer_id=peer, amount=4.0, release_at=run.at + 100.0)
    release_at = run.at + 100.0
    run.add("unbond", peer_id=peer, amount=10.0, release_at=release_at)
    assert run.book.draw(0, "w" * 32, 1) == []  # an unbonding validator is drawn no more
    # a penalty that reaches it during the unbonding takes from what is unbonding
    run.add("penalty", round=0, peer_id=peer, amount=5.0, kind="false accusation", reason="x")
    with pytest.raises(LedgerError, match="release: before its time"):
        run.add("release", peer_id=peer, amount=5.0)
    run.at = release_at
    with pytest.raises(LedgerError, match="what is left"):
        run.add("release", peer_id=peer, amount=10.0)  # the slash is not undone
    run.add("release", peer_id=peer, amount=5.0)
    account = run.book.accounts[peer]
    assert (account.stake, account.slashed, run.book.held(peer)) == (0.0, 5.0, 5.0)
    with pytest.raises(LedgerError, match="not unbonding"):
        run.add("release", peer_id=peer, amount=0.0)
    run.add("stake", peer_id=peer, amount=5.0)  # bonds again what it got back
    with pytest.raises(LedgerError, match="more than"):
        run.add("stake", peer_id=peer, amount=0.5)
    audit.verify(tmp_path)


def test_a_rejoin_during_unbonding_rebonds(tmp_path: Path) -> None:
    run = Run(tmp_path, HELD)
    me = Identity.generate()
    peer = joined(run, me)
    owner_deposit(run, run.coord, me, 10.0)
    run.add("stake", peer_id=peer, amount=10.0)
    with pytest.raises(LedgerError, match="not unbonding"):
        run.add("rebond", peer_id=peer)
    run.add("unbond", peer_id=peer, amount=10.0, release_at=run.at + 100.0)
    with pytest.raises(LedgerError, match="unbonding: rebond first"):
        run.add("stake", peer_id=peer, amount=0.0)
    run.add("rebond", peer_id=peer)
    with pytest.raises(LedgerError, match="not unbonding"):
        run.add("release", peer_id=peer, amount=10.0)


def test_older_ledgers_replay_declared_stakes(tmp_path: Path) -> None:
    """A "run created" policy without the treasury's fields (written before it) replays as
    it did: stakes were declared."""
    old = {k: v for k, v in POLICY.to_dict().items() if k not in ("held_stake", "unbonding_s")}
    assert Policy.from_dict(old).held_stake == 0
    run = Run(tmp_path, POLICY)
    run.join("a", stake=10.0)


def test_the_unbonding_period_covers_every_pending_slash() -> None:
    trust = TrustConfig()
    rounds = RunConfig().rounds
    policy = Policy.from_config(trust, rounds.deadline_max_s, held_stake=True)
    assert policy.held_stake == 1
    # (challenge_rounds + 1) x deadline_max_s + (2 k + 2 + dispute_attempts) x
    # verify_timeout_s + 2 x shard_publish_timeout_s
    expected = (
        (trust.challenge_rounds + 1) * rounds.deadline_max_s
        + (2 * trust.validators_per_check + 2 + trust.dispute_attempts) * trust.verify_timeout_s
        + 2 * trust.shard_publish_timeout_s
    )
    assert policy.unbonding_s == expected == 2040.0
    longer = unbonding_delay(
        round_s=rounds.deadline_max_s, challenge_rounds=trust.challenge_rounds + 1,
        verify_timeout_s=trust.verify_timeout_s,
        validators_per_check=trust.validators_per_check,
        dispute_attempts=trust.dispute_attempts,
        shard_publish_timeout_s=trust.shard_publish_timeout_s,
    )  # fmt: skip
    assert longer > expected


def test_the_specs_funds_are_checked_and_leave_run_ids_alone() -> None:
    key = Identity.generate().public_key
    assert "funds" not in TrustConfig().model_dump()  # specs that name none hash as before
    assert TrustConfig(funds={key: 3}).model_dump()["funds"] == {key: 3.0}
    with pytest.raises(ValueError, match="not a public key"):
        TrustConfig(funds={"alice": 3.0})
    with pytest.raises(ValueError, match="a positive amount"):
        TrustConfig(funds={key: 0.0})


def test_a_rounds_policy_must_carry_its_specs_treasury_terms() -> None:
    """`covey ledger verify` holds a rounds run's "run created" policy to the unbonding
    period and held stake its spec gives (a coordinator cannot shorten either)."""
    spec = RunConfig()
    honest = Policy.from_config(spec.trust, spec.rounds.deadline_max_s, held_stake=True)
    created = {"spec": spec.model_dump(mode="json"), "policy": honest.to_dict()}
    audit._check_treasury_terms(created)
    for name, value in (("unbonding_s", 1.0), ("held_stake", 0)):
        bent = {**created, "policy": {**honest.to_dict(), name: value}}
        with pytest.raises(LedgerError, match=f"policy.{name} is {value!r}, but the spec"):
            audit._check_treasury_terms(bent)
    older = {k: v for k, v in honest.to_dict().items() if k not in ("held_stake", "unbonding_s")}
    audit._check_treasury_terms({**created, "policy": older})  # written before the treasury
