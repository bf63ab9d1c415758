"""Missed-fraud accounting (covey.coordinator.checks.Checks over covey.trust.convictions),
on a real coordinator database and Accounts, as rounds' referee and RL's verdicts write
it: a validator that agreed on an item convicted later loses validator_slash_fraction of
its stake and that check's pay, the worker's paid work for it is clawed back from its
stake, and `covey ledger verify` recomputes all of it: it fails on an edited entry, and on
one a dishonest coordinator re-signs. Pure unit tests: no network (the processes:
tests/test_checks_network.py)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from covey.coordinator.accounts import Accounts
from covey.coordinator.checks import Checks, Verdict, judge_safely
from covey.coordinator.db import Database
from covey.io import audit
from covey.trust.identity import Identity
from covey.trust.ledger import LEDGER_SCHEMA, Entry, LedgerError, append, read_entries
from tests.test_ledger import POLICY

STAKE = 10.0
TOKENS = 4096


class World:
    """A coordinator's ledger with one worker and two validators, written through the
    coordinator's own Accounts and the shared Checks."""

    def __init__(self, dir: Path) -> None:
        dir.mkdir(parents=True, exist_ok=True)
        self.dir = dir
        self.coord = Identity.generate()
        self.accounts = Accounts(Database(dir / audit.DB_FILE), self.coord, dir)
        self.checks = Checks(self.accounts)
        self.add(
            "run created",
            run_id="r" * 16,
            name="checks",
            spec={"model": {"size": "nano"}},
            coordinator_key=self.coord.public_key,
            policy=POLICY.to_dict(),
        )
        self.w, self.v1, self.v2 = (
            self.join(n, r) for n, r in (("w", "worker"), ("v1", "validator"), ("v2", "validator"))
        )

    def add(self, type: str, **payload: Any) -> None:
        with self.accounts.transaction() as c:
            self.accounts.append(c, type, payload, time.time())

    def join(self, name: str, role: str) -> str:
        me = Identity.generate()
        self.add("join", peer_id=me.peer_id, public_key=me.public_key, name=name, role=role)
        self.add("stake", peer_id=me.peer_id, amount=STAKE)
        return me.peer_id

    def verification(self, round: int, validator: str, outcome: str) -> None:
        self.add(
            "verification",
            round=round,
            peer_id=self.w,
            validator_id=validator,
            outcome=outcome,
            distance=None,
            exact=True,
        )

    def accept(self, round: int) -> None:
        self.add(
            "contribution accepted",
            round=round,
            peer_id=self.w,
            cid="c" * 64,
            tokens=TOKENS,
            inner_steps=8,
            sampled=False,
            rate=0.25,
            draw="0.5",
            request_id="q" * 64,
            nonce="1700000000000-00112233aabbccdd",
            signature="5" * 128,
        )

    def agree_and_pay(self, round: int) -> None:
        """v1 agrees on w's item (paid its check), w is paid its work."""
        self.verification(round, self.v1, "agree")
        with self.accounts.transaction() as c:
            self.checks.pay_check(c, round, self.w, self.v1, POLICY.check_reward, time.time())
        book = self.accounts.book
        self.add(
            "reward",
            round=round,
            peer_id=self.w,
            amount=book.work_reward(TOKENS),
            kind="work",
            tokens=TOKENS,
        )

    def convict_by_referee(self, round: int) -> list[str]:
        """Rounds: v2 disagrees, the referee finds fraud (covey.coordinator.disputes)."""
        self.verification(round, self.v2, "disagree")
        book, now = self.accounts.book, time.time()
        with self.accounts.transaction() as c:
            for type, payload in (
                (
                    "dispute",
                    {
                        "validator_id": self.v2,
                        "segment": 1,
                        "outcome": "fraud",
                        "detail": "recomputed",
                    },
                ),
                ("slash", {"amount": book.slash_amount(self.w), "reason": "fraud"}),
            ):
                self.accounts.append(c, type, {"round": round, "peer_id": self.w, **payload}, now)
            return self.checks.convict(c, round, self.w, "recomputed", now)

    def stake(self, peer: str) -> float:
        return self.accounts.book.accounts[peer].stake

    def entries(self, type: str) -> list[Any]:
        return [e for e in read_entries(self.accounts.db._conn) if e.type == type]


def test_a_rounds_conviction_costs_who_agreed_and_claws_back_the_work(tmp_path: Path) -> None:
    world = World(tmp_path)
    world.accept(0)
    world.agree_and_pay(0)
    paid = world.accounts.book.work_reward(TOKENS)
    assert world.convict_by_referee(0) == [world.v1]
    # v1: validator_slash_fraction of its stake, then its check pay
    penalty = STAKE * POLICY.validator_slash_fraction
    assert world.stake(world.v1) == STAKE - penalty - POLICY.check_reward
    # the worker: slash_fraction of its stake, then its paid work
    assert world.stake(world.w) == STAKE * (1 - POLICY.slash_fraction) - paid
    assert world.stake(world.v2) == STAKE  # it disagreed: nothing taken
    [missed] = world.entries("penalty")
    assert missed.payload["kind"] == "missed fraud" and missed.payload["amount"] == penalty
    claws = {e.payload["kind"]: e.payload for e in world.entries("clawback")}
    assert claws["check"]["peer_id"] == world.v1 and claws["check"]["worker_id"] == world.w
    assert claws["check"]["amount"] == POLICY.check_reward
    assert claws["work"]["peer_id"] == world.w and claws["work"]["amount"] == paid
    result = audit.verify(tmp_path)  # the whole ledger replays, balances file included
    assert result.summary["accounts"][world.v1]["stake"] == world.stake(world.v1)
    assert result.summary["totals"]["clawbacks"] == POLICY.check_reward + paid


def test_an_rl_rejection_after_an_agree_goes_through_the_same_accounting(
    tmp_path: Path,
) -> None:
    """RL's verdicts: the validator agreed (and was paid), then the trainer's check
    rejected the batch ("contribution rejected", no dispute): the same Checks.convict."""
    world = World(tmp_path)
    world.verification(3, world.v1, "agree")
    now = time.time()
    with world.accounts.transaction() as c:
        world.checks.pay_check(c, 3, world.w, world.v1, POLICY.check_reward, now)
        world.accounts.append(
            c, "contribution rejected", {"round": 3, "peer_id": world.w, "reason": "proof"}, now
        )
        assert world.checks.convict(c, 3, world.w, "proof", now) == [world.v1]
    assert world.stake(world.v1) == STAKE * (1 - POLICY.validator_slash_fraction) - (
        POLICY.check_reward
    )
    assert [e.payload["kind"] for e in world.entries("clawback")] == ["check"]  # no work paid
    with world.accounts.transaction() as c:  # a second conviction charges nothing again
        assert world.checks.convict(c, 3, world.w, "proof", time.time()) == []
    assert len(world.entries("penalty")) == 1 and len(world.entries("clawback")) == 1
    audit.verify(tmp_path)


def test_an_edited_missed_fraud_entry_fails_the_audit(tmp_path: Path) -> None:
    world = World(tmp_path)
    world.accept(0)
    world.agree_and_pay(0)
    world.convict_by_referee(0)
    [target] = world.entries("penalty")
    changed = json.dumps({**target.payload, "amount": 0.0}, sort_keys=True, separators=(",", ":"))
    world.accounts.db._conn.execute(
        "UPDATE ledger SET payload = ? WHERE idx = ?", (changed, target.index)
    )
    with pytest.raises(LedgerError, match="hash does not match its contents") as e:
        audit.verify(tmp_path)
    assert e.value.index == target.index


def resigned(entries: list[Entry], key: Identity, dir: Path, change: Any) -> Path:
    """A coordinator data directory holding `entries` as a dishonest coordinator re-signs
    them: each appended again with its own `key`, `change(entry)` giving its (type,
    payload), or None to drop it."""
    dir.mkdir()
    conn = sqlite3.connect(dir / audit.DB_FILE, isolation_level=None)
    conn.executescript(LEDGER_SCHEMA)
    conn.execute("BEGIN")
    for entry in entries:
        if (new := change(entry)) is not None:
            append(conn, key, new[0], new[1], entry.at)
    conn.execute("COMMIT")
    conn.close()
    return dir


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("a smaller missed-fraud penalty", "is not validator_slash_fraction"),
        ("a smaller check clawback", r"clawback \(check\).*is not the pay"),
        ("a larger work clawback", r"clawback \(work\).*is not the pay"),
        ("a clawback from the validator that disagreed", "did not agree on the item"),
        ("a penalty with no conviction", "agreed on no contribution rejected in round 0"),
        ("a clawback with no conviction", "the item was not convicted"),
        ("work clawed back twice", "no work pay for it is left"),
    ],
)
def test_a_resigned_ledger_that_bends_the_accounting_fails_the_audit(
    tmp_path: Path, case: str, error: str
) -> None:
    world = World(tmp_path / "honest")
    world.accept(0)
    world.agree_and_pay(0)
    world.convict_by_referee(0)
    audit.verify(tmp_path / "honest")

    def change(e: Any) -> Any:
        p, kind = dict(e.payload), e.payload.get("kind")
        smaller = {
            "penalty": "a smaller missed-fraud penalty",
            "clawback": f"a smaller {kind} clawback",
        }
        dropped = ("dispute", "slash") + (("penalty",) if "a clawback" in case else ())
        if case == smaller.get(e.type):
            p["amount"] /= 2
        elif e.type == "clawback" and case == f"a larger {kind} clawback":
            p["amount"] += 1.0
        elif e.type == "clawback" and kind == "check" and "disagreed" in case:
            p["peer_id"] = world.v2
        elif "no conviction" in case and e.type in dropped:
            return None
        return e.type, p

    honest = read_entries(world.accounts.db._conn)
    dishonest = resigned(honest, world.coord, tmp_path / "dishonest", change)
    if case == "work clawed back twice":  # the same claw-back once more
        conn = sqlite3.connect(dishonest / audit.DB_FILE, isolation_level=None)
        [work] = [e for e in world.entries("clawback") if e.payload["kind"] == "work"]
        conn.execute("BEGIN")
        append(conn, world.coord, "clawback", work.payload, work.at)
        conn.execute("COMMIT")
        conn.close()
    with pytest.raises(LedgerError, match=error):
        audit.verify(dishonest)


class _Raises:
    def judge(self, item: int) -> Verdict:
        raise ZeroDivisionError("division by zero")


class _Convicts:
    def judge(self, item: int) -> Verdict:
        return Verdict("convicted", f"item {item} is bad")


def test_a_referee_that_fails_convicts_nobody() -> None:
    failed = judge_safely(_Raises(), 7)
    assert failed.outcome == "inconclusive" and not failed.convicted
    assert "ZeroDivisionError" in failed.detail
    assert judge_safely(_Convicts(), 7) == Verdict("convicted", "item 7 is bad")
