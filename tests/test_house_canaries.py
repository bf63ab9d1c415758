"""Canaries a validator cannot tell from real checks (covey.trust.house,
covey.coordinator.canary): in a real rounds run (a coordinator process, two honest
`covey worker` processes and a house worker, `covey worker --house-of`), two lazy validator
keys: one agrees with every check at once (tests/test_assignment.py's Squatter), another
looks for the tells canaries used to have (a task whose content id is not the accepted
contribution's in the ledger, or that no assignment entry gave it) and disputes those,
agreeing with the rest. Neither finds a tell: every task either got is an accepted
contribution in the ledger under the same content id, assigned to it by a public
"assignment" entry. A third rubber stamp takes the audits (every contribution is checked
by two validators, as a new peer's, and audit_rate 1 has every cleared one checked once
more by the validator not yet drawn: all three check each). The house worker's
canary round is revealed once all reported; the coordinator's referee convicts it, and
the lazy ones lose validator_slash_fraction of their stake (below min_validator_stake:
they can no longer check) and all standing as checkers.
`covey ledger verify` replays it, and refuses the reveal forged or edited."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.io import audit
from covey.local.cluster import LocalCluster
from covey.trust.certify import canary_message, draw_value
from covey.trust.house import house_identity, house_proof
from covey.trust.identity import Identity
from covey.trust.ledger import Entry, LedgerError
from tests.test_assignment import Squatter
from tests.test_checks import resigned
from tests.test_ledger import Run

STAKE = 8.0  # one missed-fraud penalty (x0.5) leaves 4, below min_validator_stake 5
SPEC = """
name = "house-canaries"
seed = 11
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
new_peer_contributions = 100
validator_round_cap = 8
check_reward = 0.5
challenge_rounds = 1
verify_timeout_s = 20
commit_every = 2
canary_rate = 0.5
audit_rate = 1.0
validator_slash_fraction = 0.5
"""


def ledger(cluster: LocalCluster) -> list[Entry]:
    found, _, _ = audit.load(cluster.url)
    return found


class TellSeeker(Squatter):
    """A lazy validator that re-executes nothing: it disputes a task that looks like a
    canary by the old tells (its content id is not the ledger's accepted one for that round
    and worker, or no assignment entry drew this validator for it) and agrees with the
    rest. `tells` counts the tasks it found a tell in."""

    def __init__(self, cluster: LocalCluster, stake: float) -> None:
        super().__init__(cluster, stake=stake)
        self.url = cluster.url
        self.tells = 0
        self.thread = threading.Thread(target=self._seek, daemon=True)

    def _looks_like_canary(self, task: dict[str, Any]) -> bool:
        entries, _, _ = audit.load(self.url)
        key = (task["round"], task["peer_id"])
        accepted = {
            (e.payload["round"], e.payload["peer_id"]): e.payload["cid"]
            for e in entries
            if e.type == "contribution accepted"
        }
        drawn = any(
            e.type == "assignment"
            and (e.payload["round"], e.payload["peer_id"]) == key
            and self.id in e.payload["validators"]
            for e in entries
        )
        return accepted.get(key) != task["cid"] or not drawn

    def _seek(self) -> None:
        while not self.stop.wait(0.2):
            try:
                reply = self.post(
                    "/v1/verify/claim", {"run_id": self.run_id, "validator_id": self.id}
                )
                if reply.status_code != 200 or (task := reply.json()["task"]) is None:
                    continue
                self.tasks.append(task)
                tell = self._looks_like_canary(task)
                self.tells += tell
                body: dict[str, Any] = {
                    "run_id": self.run_id,
                    "round": task["round"],
                    "validator_id": self.id,
                    "task_id": task["task_id"],
                    "outcome": "disagree" if tell else "agree",
                    "distance": 1.0 if tell else 0.0,
                }
                if tell:
                    body["segment"] = 0
                self.post("/v1/verify/report", body, round=task["round"])
            except httpx.HTTPError:
                continue


def house_run(tmp_path: Path, outcome: str) -> tuple[Run, str, list[str], int]:
    """A ledger in which house key 0 contributes to the first round its draw picks, two
    validators agree on it, and the reveal says `outcome` (its draw and proof genuine)."""
    tmp_path.mkdir()
    run = Run(tmp_path)
    house = house_identity(run.coord, "r" * 16, 0)
    run.add("join", peer_id=house.peer_id, public_key=house.public_key, name="h", role="worker")
    run.add("stake", peer_id=house.peer_id, amount=10.0)
    validators = [run.join(f"v{i}", role="validator", stake=8.0) for i in range(2)]
    rnd = next(
        r
        for r in range(100)
        if draw_value(run.coord.sign(canary_message("r" * 16, r, house.peer_id))) < 0.5
    )
    run.accept(rnd, house.peer_id, 100)
    validators = run.assign(rnd, house.peer_id).payload["validators"]  # the beacon's draw
    assert validators
    for v in validators:
        check = {"round": rnd, "peer_id": house.peer_id, "validator_id": v}
        run.add("verification", outcome="agree", distance=0.0, exact=True, **check)
    run.add(
        "house canary",
        round=rnd,
        peer_id=house.peer_id,
        draw=run.coord.sign(canary_message("r" * 16, rnd, house.peer_id)),
        proof=house_proof(run.coord, "r" * 16, house.peer_id),
        outcome=outcome,
        detail="recomputed",
    )
    return run, house.peer_id, validators, rnd


def test_a_revealed_house_canary_convicts_and_costs_those_that_agreed(tmp_path: Path) -> None:
    """The book's side, in one process: a "convicted" reveal convicts the contribution, so
    a missed-fraud penalty of each validator that agreed is due (and only then), their
    agreements stop counting, the key is burned; "caught" needs a dispute's conviction."""
    run, house, validators, rnd = house_run(tmp_path / "a", "convicted")
    for v in validators:
        assert run.book.missed_fraud_due(rnd, v)
        run.add(
            "penalty",
            round=rnd,
            peer_id=v,
            amount=run.book.penalty_amount(v),
            kind="missed fraud",
            reason="house canary",
        )
        account = run.book.accounts[v]
        assert account.stake == 4.0 and account.canaries_passed == 1
        assert account.reputation < 0.5
    assert run.book.accounts[house].banned
    with pytest.raises(LedgerError, match="no dispute convicted it"):
        house_run(tmp_path / "b", "caught")
    unchecked, _, validators, rnd = house_run(tmp_path / "c", "unchecked")
    assert not any(unchecked.book.missed_fraud_due(rnd, v) for v in validators)


@pytest.fixture(scope="module")
def run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalCluster, Squatter, TellSeeker, str]]:
    tmp: Path = tmp_path_factory.mktemp("house")
    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    cluster = LocalCluster(spec, tmp)
    stamp = seeker = auditor = None
    try:
        cluster.start_coordinator()
        stamp = Squatter(cluster, stake=STAKE, stamp=True)
        seeker = TellSeeker(cluster, stake=STAKE)
        auditor = Squatter(cluster, stake=STAKE, stamp=True)  # the third: audits (rate 1)
        for lazy in (stamp, seeker, auditor):
            lazy.thread.start()
        cluster.start_worker("ada", "--stake", "20")
        cluster.start_worker("bob", "--stake", "20")
        coordinator_key = cluster.data_dir / "coordinator.key"
        cluster.start_worker(
            "house", "--stake", "20", "--house-of", str(coordinator_key), "--house-index", "0"
        )
        house = house_identity(Identity.load_or_create(coordinator_key), cluster.run_id, 0)
        yield cluster, stamp, seeker, house.peer_id
    finally:
        for lazy in (stamp, seeker, auditor):
            if lazy is not None:
                lazy.stop.set()
        cluster.stop()


@pytest.mark.network
@pytest.mark.long
def test_lazy_validators_find_no_tell_and_lose_their_stake_to_a_house_canary(
    run: tuple[LocalCluster, Squatter, TellSeeker, str],
) -> None:
    cluster, stamp, seeker, house = run

    def convicted(entries: list[Entry]) -> list[Entry]:
        return [
            e
            for e in entries
            if e.type == "house canary"
            and e.payload["peer_id"] == house
            and e.payload["outcome"] == "convicted"
        ]

    end = time.monotonic() + 150
    while not convicted(entries := ledger(cluster)):
        assert time.monotonic() < end, cluster.tail() + cluster.tail("house")
        time.sleep(1.0)  # polling the ledger under a deadline
    reveal = convicted(entries)[0]
    rnd = reveal.payload["round"]
    # before it reported, nothing told either lazy validator this check was a canary
    assert seeker.tells == 0
    assert any(t["round"] == rnd and t["peer_id"] == house for t in stamp.tasks)
    assert any(t["round"] == rnd and t["peer_id"] == house for t in seeker.tasks)
    revealed_at = entries.index(reveal)
    for lazy in (stamp, seeker):
        agreed = [
            i
            for i, e in enumerate(entries)
            if e.type == "verification"
            and (e.payload["round"], e.payload["peer_id"]) == (rnd, house)
            and e.payload["validator_id"] == lazy.id
        ]
        assert agreed and max(agreed) < revealed_at, "revealed before it reported"
        penalties = [
            e
            for e in entries[revealed_at:]
            if e.type == "penalty"
            and e.payload["peer_id"] == lazy.id
            and e.payload["kind"] == "missed fraud"
        ]
        assert penalties, f"{lazy.id[:8]} agreed on the canary and paid nothing"
    accounts = cluster.get("/v1/ledger/balances")["accounts"]
    for lazy in (stamp, seeker):
        account = accounts[lazy.id]
        assert account["stake"] < 5.0 and account["counts"]["canaries_passed"] >= 1
        reply = lazy.post("/v1/verify/claim", {"run_id": lazy.run_id, "validator_id": lazy.id})
        assert reply.status_code == 403, reply.text  # its stake is gone below the minimum
    assert accounts[house]["banned"]  # the reveal burned the house key
    # every cleared contribution was audited by the validator not yet drawn (audit_rate 1),
    # and the canary was revealed only after its audit reported
    audits = [e for e in entries if e.type == "assignment" and e.payload["reason"] == "audit"]
    assert any((e.payload["round"], e.payload["peer_id"]) == (rnd, house) for e in audits)
    assert all(
        e.payload["round"] < rnd or entries.index(e) < revealed_at
        for e in audits
        if e.payload["peer_id"] == house
    )
    audit.verify(cluster.url)  # the draw, the proof and every penalty recomputed


@pytest.mark.network
@pytest.mark.long
def test_a_forged_or_edited_reveal_does_not_verify(
    run: tuple[LocalCluster, Squatter, TellSeeker, str], tmp_path: Path
) -> None:
    """The coordinator re-signing its ledger cannot call another key its own, nor a round
    its draw did not pick a canary round, nor a canary caught that no dispute convicted."""
    cluster, _, _, house = run
    entries = ledger(cluster)
    reveal = next(e for e in entries if e.type == "house canary")
    coordinator = Identity.load_or_create(cluster.data_dir / "coordinator.key")
    rnd = reveal.payload["round"]
    impostor = Identity.generate()
    not_drawn = next(  # a round whose draw is not below canary_rate
        r
        for r in range(200)
        if draw_value(coordinator.sign(canary_message(cluster.run_id, r, house))) >= 0.5
    )
    cases = {
        "proof": ({"proof": house_proof(impostor, cluster.run_id, house)}, "proof is not"),
        "draw": (
            {"draw": coordinator.sign(canary_message(cluster.run_id, rnd + 1, house))},
            "draw is not",
        ),
        "round": (
            {
                "round": not_drawn,
                "draw": coordinator.sign(canary_message(cluster.run_id, not_drawn, house)),
            },
            "not below",
        ),
        "outcome": ({"outcome": "caught"}, "no dispute convicted it"),
    }
    for name, (change, error) in cases.items():

        def edit(e: Entry, change: dict[str, Any] = change) -> tuple[str, dict[str, Any]]:
            return e.type, ({**e.payload, **change} if e.index == reveal.index else e.payload)

        with pytest.raises(LedgerError, match=error):
            audit.verify(resigned(entries, coordinator, tmp_path / name, edit))
