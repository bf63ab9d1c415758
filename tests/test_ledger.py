"""The ledger (hash chain, signatures, canonical JSONL), the incentives replayed from it, the
audit of a data directory or an export, and `covey ledger`. Pure unit tests: no network."""

from __future__ import annotations

import itertools
import json
import random
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from covey.config import TrustConfig
from covey.io import audit
from covey.io.ledger_cli import register
from covey.trust.certify import canary_message, draw_value, sample
from covey.trust.identity import Identity
from covey.trust.incentives import Book, Policy
from covey.trust.ledger import (
    ENTRY_TYPES,
    GENESIS,
    LEDGER_SCHEMA,
    Entry,
    LedgerError,
    append,
    entry_hash,
    parse_line,
    read_entries,
    to_line,
    verify_chain,
)
from covey.trust.policy import Account

POLICY = Policy(
    min_stake=5.0,
    reward_per_token=0.001,
    slash_fraction=0.5,
    catch_reward=10.0,
    new_peer_rate=1.0,
    new_peer_contributions=2,
    low_reputation=0.5,
    sample_rate=0.25,
    min_validator_stake=2.0,
    validator_slash_fraction=0.5,
    check_reward=0.25,
    canary_rate=1.0,
)


class Run:
    """A coordinator's side of a ledger: a SQLite file in `dir`, entries appended the way the
    coordinator does (append + Book.apply in one transaction, rolled back on error)."""

    def __init__(
        self, dir: Path, policy: Policy = POLICY, spec: dict[str, Any] | None = None, **created: Any
    ) -> None:
        self.dir = dir
        self.coord = Identity.generate()
        self.conn = sqlite3.connect(dir / audit.DB_FILE, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA synchronous=OFF")  # a test: no fsync per entry
        self.conn.executescript(LEDGER_SCHEMA)
        self.book = Book()
        self.at = 1_700_000_000.0
        self.peers: dict[str, Identity] = {}
        self.add(
            "run created",
            run_id="r" * 16,
            name="test run",
            spec={"model": {"size": "nano"}, "lr": 1e-05, **(spec or {})},
            coordinator_key=self.coord.public_key,
            policy=policy.to_dict(),
            **created,
        )

    def add(self, type: str, apply: bool = True, **payload: Any) -> Entry:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            entry = append(self.conn, self.coord, type, payload, self.at)
            if apply:
                self.book.apply(entry)
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")
        self.at += 0.125
        return entry

    def join(self, name: str, role: str = "worker", stake: float | None = 10.0) -> str:
        me = Identity.generate()
        self.peers[name] = me
        self.add("join", peer_id=me.peer_id, public_key=me.public_key, name=name, role=role)
        if stake is not None:
            self.add("stake", peer_id=me.peer_id, amount=stake)
        return me.peer_id

    def accept(self, round: int, peer: str, tokens: int, sampled: bool = True) -> Entry:
        return self.add(
            "contribution accepted",
            round=round,
            peer_id=peer,
            cid="c" * 64,
            tokens=tokens,
            inner_steps=50,
            sampled=sampled,
            rate=self.book.sampling_rate(peer),
            draw="0.125",
            request_id="q" * 64,
            nonce="1700000000000-00112233aabbccdd",
            signature="5" * 128,
        )

    def assign(self, round: int, peer: str, reason: str = "draw") -> Entry:
        """The beacon's draw of validators for a sampled contribution, as the coordinator
        writes it."""
        validators = self.book.draw(round, peer, self.book.checks_needed(round, peer))
        return self.add(
            "assignment",
            round=round,
            peer_id=peer,
            beacon=self.book.beacon(round),
            validators=validators,
            reason=reason,
        )

    def canary(self, round: int, validator: str, worker: str, outcome: str, **override: Any):
        """A revealed canary, its draw signed by the coordinator."""
        draw = self.coord.sign(canary_message("r" * 16, round, validator))
        payload = {"draw": draw, **override}
        return self.add(
            "canary",
            round=round,
            peer_id=validator,
            worker_id=worker,
            cid="f" * 64,
            outcome=outcome,
            **payload,
        )

    def pay(self, round: int, peer: str, tokens: int, **override: Any) -> Entry:
        payload = {
            "round": round,
            "peer_id": peer,
            "amount": self.book.work_reward(tokens),
            "kind": "work",
            "tokens": tokens,
        }
        return self.add("reward", **(payload | override))

    def certify(self, round: int, accepted: list[str]) -> Entry:
        return self.add(
            "round certificate",
            round=round,
            new_hash="a" * 64,
            certificate_hash="b" * 64,
            accepted=accepted,
            rejected=[],
        )

    def entries(self) -> list[Entry]:
        return read_entries(self.conn)


def full_run(dir: Path) -> tuple[Run, dict[str, str]]:
    """Three workers and two validators over two rounds: work paid, one agreement (paid as a
    check), one proven fraud (slash + catch reward), a refused report and a false
    accusation (penalty) by the second validator, a rejection, a checkpoint, a leave."""
    run = Run(dir)
    ids = {name: run.join(name) for name in ("ada", "bob", "eve")}
    ids["val"] = run.join("val", role="validator", stake=3.0)
    tokens = {"ada": 4096, "bob": 2048, "eve": 1024}
    for rnd in (0, 1):
        for name, n in tokens.items():
            run.accept(rnd, ids[name], n)
            run.assign(rnd, ids[name])
        run.certify(rnd, [ids[n] for n in tokens])
    verdict = {"round": 0, "validator_id": ids["val"], "distance": 0.001, "exact": False}
    run.add("verification", peer_id=ids["ada"], outcome="agree", **verdict)
    run.add("verification", peer_id=ids["bob"], outcome="agree", **verdict)
    run.add("verification", peer_id=ids["ada"], outcome="agree", **verdict | {"round": 1})
    run.add("verification", peer_id=ids["eve"], outcome="disagree", **verdict | {"distance": 3.5})
    run.add(
        "dispute",
        round=0,
        peer_id=ids["eve"],
        validator_id=ids["val"],
        segment=3,
        outcome="fraud",
        detail="step 30-40 diverges",
    )
    run.add(
        "slash",
        round=0,
        peer_id=ids["eve"],
        amount=run.book.slash_amount(ids["eve"]),
        reason="fraud",
    )
    run.add("reward", round=0, peer_id=ids["val"], amount=10.0, kind="catch", tokens=0)
    run.add("reward", round=0, peer_id=ids["val"], amount=0.25, kind="check", tokens=0)
    ids["liar"] = run.join("liar", role="validator", stake=4.0)
    run.add(
        "report refused",
        round=1,
        peer_id=ids["liar"],
        worker_id=ids["eve"],
        task_id=7,
        field="segment",
        reason="99",
    )
    missed = {"round": 1, "peer_id": ids["bob"], "validator_id": ids["val"]}
    run.add("verification", outcome="expired", distance=None, exact=False, **missed)
    assert run.assign(1, ids["bob"], "reassign").payload["validators"] == [ids["liar"]]
    lie = {"round": 1, "peer_id": ids["bob"], "validator_id": ids["liar"]}
    run.add("verification", outcome="disagree", distance=2.0, exact=False, **lie)
    run.add("dispute", segment=0, outcome="validator wrong", detail="recomputed", **lie)
    run.add(
        "penalty",
        round=1,
        peer_id=ids["liar"],
        amount=run.book.penalty_amount(ids["liar"]),
        kind="false accusation",
        reason="recomputed",
    )
    for rnd in (0, 1):
        run.pay(rnd, ids["ada"], tokens["ada"])
        run.pay(rnd, ids["bob"], tokens["bob"])
    run.canary(1, ids["val"], ids["ada"], "caught")
    run.canary(1, ids["liar"], ids["ada"], "passed")
    run.add(
        "penalty",
        round=1,
        peer_id=ids["liar"],
        amount=run.book.penalty_amount(ids["liar"]),
        kind="canary",
        reason="agreed with a canary",
    )
    run.add("contribution rejected", round=2, peer_id=ids["eve"], reason="banned")
    run.add("checkpoint", round=2, cid="d" * 64, weights_hash="e" * 64)
    run.add("leave", peer_id=ids["bob"], reason="done")
    ids["ned"] = run.join("ned")  # joins rounds and never submits: two no-shows in a row
    run.add("no show", round=2, peer_id=ids["ned"], consecutive=1, sits_out_s=0.0)
    run.add("no show", round=3, peer_id=ids["ned"], consecutive=2, sits_out_s=30.0)
    return run, ids


def export(run: Run, path: Path) -> Path:
    audit.write_jsonl(run.entries(), path)
    return path


# -- the chain ------------------------------------------------------------------------


def test_append_chains_signs_and_reads_back(tmp_path: Path) -> None:
    run, _ = full_run(tmp_path)
    entries = run.entries()
    assert [e.index for e in entries] == list(range(len(entries)))
    assert entries[0].prev_hash == GENESIS and entries[0].type == "run created"
    assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(entries))
    e = entries[5]
    assert e.hash == entry_hash(e.index, e.type, e.at, e.payload, e.prev_hash)
    assert verify_chain(entries) == run.coord.public_key
    assert verify_chain(entries, run.coord.public_key) == run.coord.public_key
    assert read_entries(tmp_path / audit.DB_FILE, start=3, limit=2) == entries[3:5]
    # every type but "halt", which ends a run: tests/test_halt.py writes and replays it, and
    # "clawback" (a conviction of paid work): tests/test_checks.py writes and replays it, and
    # "house canary" (a rounds canary's reveal): tests/test_house_canaries.py, and the
    # treasury's (deposits, unbonding): tests/test_treasury.py
    treasury = {"deposit", "unbond", "rebond", "release"}
    later = {"halt", "clawback", "house canary", *treasury}
    assert {e.type for e in entries} == set(ENTRY_TYPES) - later
    assert all(parse_line(to_line(e), e.index) == e for e in entries)


def test_append_refuses_bad_entries_and_writes_nothing(tmp_path: Path) -> None:
    run = Run(tmp_path)
    n = len(run.entries())
    with pytest.raises(ValueError, match="unknown ledger entry type 'bonus'"):
        run.add("bonus", peer_id="x")
    with pytest.raises(ValueError, match="only entry 0 is 'run created'"):
        run.add("run created", coordinator_key=run.coord.public_key)
    with pytest.raises(ValueError, match="not finite JSON"):
        run.add("stake", peer_id="x", amount=float("nan"))
    assert len(run.entries()) == n
    other = sqlite3.connect(tmp_path / "other.db", isolation_level=None)
    other.executescript(LEDGER_SCHEMA)
    with pytest.raises(ValueError, match="only entry 0 is 'run created'"):
        append(other, run.coord, "join", {}, 1.0)
    with pytest.raises(ValueError, match="but the ledger is signed by"):
        append(other, run.coord, "run created", {"coordinator_key": "ab" * 32}, 1.0)


def test_verify_chain_catches_a_wrong_key_and_a_foreign_signature(tmp_path: Path) -> None:
    run, _ = full_run(tmp_path)
    entries = run.entries()
    stranger = Identity.generate()
    with pytest.raises(LedgerError, match="published key is") as e:
        verify_chain(entries, stranger.public_key)
    assert e.value.index == 0 and str(e.value).startswith("entry 0: ")
    forged = Entry(**{**entries[7].__dict__, "signature": stranger.sign(entries[7].hash.encode())})
    with pytest.raises(LedgerError, match="signature is not the coordinator's") as e:
        verify_chain([*entries[:7], forged, *entries[8:]])
    assert e.value.index == 7
    with pytest.raises(LedgerError, match="has index 9, expected 8") as e:
        verify_chain([*entries[:8], *entries[9:]])
    assert e.value.index == 8
    with pytest.raises(LedgerError, match="empty"):
        verify_chain([])


# -- incentives -------------------------------------------------------------------------


def test_a_passed_canary_voids_a_validators_checks() -> None:
    """A validator that agreed with a canary has shown it agrees without re-executing: its
    many agreements earn nothing, and one that checks honestly but misses some ranks above."""
    stamp = Account("s", "stamp", "validator", "", checks=40, canaries_passed=1)
    honest = Account("h", "honest", "validator", "", checks=2, missed_checks=2)
    assert stamp.reputation == 1 / 3 and honest.reputation == 3 / 6
    assert Account("n", "new", "validator", "").reputation == 0.5
    assert Account("f", "liar", "validator", "", checks=4, false_accusations=1).reputation == 4 / 6


def test_a_withheld_contribution_costs_reputation_and_nothing_else(tmp_path: Path) -> None:
    """A "contribution rejected" that says withheld (drawn for verification, its local
    states never delivered) lowers the worker's reputation like a fraud, and a second one
    excludes it, but no stake is taken; a plain rejection, or a withheld field that is not
    exactly true, counts for nothing."""
    run = Run(tmp_path)
    w = run.join("w")
    for i, withheld in enumerate((True, None, "yes")):
        extra = {} if withheld is None else {"withheld": withheld}
        run.add("contribution rejected", round=i, peer_id=w, reason="not delivered", **extra)
    account = run.book.accounts[w]
    assert account.rejected == 3 and account.withheld == 1
    assert account.reputation == 1 / 3 and not account.banned
    run.add("contribution rejected", round=3, peer_id=w, reason="not delivered", withheld=True)
    assert account.withheld == 2 and account.reputation == 1 / 4
    assert account.banned and account.stake == 10.0 and account.slashed == 0.0
    assert Book.replay(run.entries()).summary()["accounts"][w]["counts"]["withheld"] == 2


def test_replay_recomputes_what_the_coordinator_kept(tmp_path: Path) -> None:
    run, ids = full_run(tmp_path)
    summary = run.book.summary()
    assert Book.replay(run.entries()).summary() == summary
    assert json.loads(json.dumps(summary)) == summary
    assert list(summary["accounts"]) == sorted(ids.values())
    ada, bob, eve, val = (summary["accounts"][ids[n]] for n in ("ada", "bob", "eve", "val"))
    assert ada["balance"] == 2 * (4096 * 0.001) and ada["tokens_paid"] == 8192
    assert ada["ownership"] == 8192 / (8192 + 4096) and eve["ownership"] == 0.0
    assert eve["banned"] and eve["stake"] == 5.0 and eve["slashed"] == 5.0
    assert eve["counts"]["frauds"] == 1 and eve["counts"]["rejected"] == 1
    assert val["balance"] == 10.25 and val["counts"]["catches"] == 1 and val["role"] == "validator"
    assert val["counts"]["checks"] == 5 and val["counts"]["missed_checks"] == 1
    assert summary["totals"]["check_rewards"] == 0.25
    liar = summary["accounts"][ids["liar"]]
    assert liar["stake"] == 1.0 and liar["slashed"] == 3.0 and not liar["banned"]
    assert liar["counts"]["false_accusations"] == 1 and liar["counts"]["refused_reports"] == 1
    assert liar["reputation"] < val["reputation"]
    assert ada["reputation"] == 3 / 4 and eve["reputation"] == 1 / 3 and bob["reputation"] == 2 / 3
    assert summary["totals"]["tokens_paid"] == 12288 and summary["totals"]["banned"] == 1
    assert summary["entries"] == len(run.entries()) and summary["certificates"] == 2
    # Sampling: eve's reputation is low, ada and bob are no longer new, strangers are new.
    rates = {n: run.book.sampling_rate(ids[n]) for n in ("ada", "bob", "eve")}
    assert rates == {"ada": 0.25, "bob": 0.25, "eve": 1.0}
    assert run.book.sampling_rate("unknown") == 1.0
    # a first no-show is forgiven, a repeated one costs reputation: sampled as a new peer
    ned = summary["accounts"][ids["ned"]]
    assert ned["counts"]["no_shows"] == 1 and ned["reputation"] == 1 / 3


def test_no_show_entries_are_checked(tmp_path: Path) -> None:
    run, ids = full_run(tmp_path)
    with pytest.raises(LedgerError, match="is a validator, not a worker"):
        run.add("no show", round=4, peer_id=ids["val"], consecutive=2, sits_out_s=30.0)
    with pytest.raises(LedgerError, match="consecutive must be at least 1"):
        run.add("no show", round=4, peer_id=ids["ned"], consecutive=0, sits_out_s=0.0)
    with pytest.raises(LedgerError, match="unknown peer"):
        run.add("no show", round=4, peer_id="f" * 32, consecutive=1, sits_out_s=0.0)


def test_policy_from_config_and_payload() -> None:
    cfg = TrustConfig()
    policy = Policy.from_config(cfg)
    assert policy.reward_per_token == cfg.reward_per_token
    assert Policy.from_dict(policy.to_dict()) == policy
    with pytest.raises(ValueError, match="exactly the fields"):
        Policy.from_dict({**policy.to_dict(), "bonus": 1.0})
    with pytest.raises(ValueError, match=r"policy.new_peer_contributions must be .* int, got 2.5"):
        Policy.from_dict({**policy.to_dict(), "new_peer_contributions": 2.5})


Violation = Callable[[Run, dict[str, str]], Entry]
VIOLATIONS: dict[str, tuple[str, Violation]] = {
    "unknown peer": (
        "unknown peer 'nobody'",
        lambda r, ids: r.add("stake", peer_id="nobody", amount=10.0),
    ),
    "stake below min_validator_stake": (
        "below the minimum stake 2.0 of a validator",
        lambda r, ids: _poor_validator(r),
    ),
    "assignment off the beacon's draw": (
        "the beacon's draw is",
        lambda r, ids: (
            r.accept(2, ids["ada"], 4096),
            r.add(
                "assignment",
                round=2,
                peer_id=ids["ada"],
                beacon=r.book.beacon(2),
                validators=[
                    v for v in (ids["val"], ids["liar"]) if v not in r.book.draw(2, ids["ada"], 1)
                ],
                reason="draw",
            ),
        )[1],
    ),
    "assignment on another beacon": (
        "assignment: beacon",
        lambda r, ids: (
            r.accept(2, ids["ada"], 4096),
            r.add(
                "assignment",
                round=2,
                peer_id=ids["ada"],
                beacon="0" * 64,
                validators=r.book.draw(2, ids["ada"], 1),
                reason="draw",
            ),
        )[1],
    ),
    "verification by an unassigned validator": (
        "holds no assignment",
        lambda r, ids: (
            r.accept(2, ids["ada"], 4096),
            r.add(
                "verification",
                round=2,
                peer_id=ids["ada"],
                validator_id=ids["val"],
                outcome="agree",
                distance=0.0,
                exact=True,
            ),
        )[1],
    ),
    "canary drawn by another key": (
        "draw is not the coordinator's signature",
        lambda r, ids: r.canary(
            0, ids["val"], ids["bob"], "caught", draw=Identity.generate().sign(b"covey")
        ),
    ),
    "second canary in a round": (
        "a second one for",
        lambda r, ids: r.canary(1, ids["val"], ids["bob"], "caught"),
    ),
    "work paid with its checks skipped": (
        "its required checks were skipped",
        lambda r, ids: (r.accept(2, ids["ada"], 4096), r.pay(2, ids["ada"], 4096))[1],
    ),
    "penalty of a wrong amount": (
        "is not validator_slash_fraction 0.5 x stake 1.0 = 0.5",
        lambda r, ids: r.add(
            "penalty", round=1, peer_id=ids["liar"], amount=4.0, kind="canary", reason="x"
        ),
    ),
    "penalty of a worker": (
        "is a worker, not a validator",
        lambda r, ids: r.add(
            "penalty", round=1, peer_id=ids["ada"], amount=0.0, kind="canary", reason="x"
        ),
    ),
    "check reward for no check": (
        "no unpaid check reported by validator",
        lambda r, ids: r.add(
            "reward", round=5, peer_id=ids["val"], amount=0.25, kind="check", tokens=0
        ),
    ),
    "second join of a key": (
        "a second join of public key",
        lambda r, ids: r.add(
            "join",
            peer_id=ids["ada"],
            public_key=r.peers["ada"].public_key,
            name="ada again",
            role="worker",
        ),
    ),
    "peer id not from its key": (
        "is not the id of key",
        lambda r, ids: r.add(
            "join",
            peer_id="f" * 32,
            public_key=Identity.generate().public_key,
            name="x",
            role="worker",
        ),
    ),
    "work reward for no contribution": (
        "no accepted contribution of peer",
        lambda r, ids: r.pay(7, ids["ada"], 4096),
    ),
    "work reward paid twice": (
        "was already paid",
        lambda r, ids: r.pay(0, ids["ada"], 4096),
    ),
    "work reward for other tokens": (
        "pays for 999 tokens, but 4096 were accepted",
        lambda r, ids: (r.accept(2, ids["ada"], 4096, False), r.pay(2, ids["ada"], 999))[1],
    ),
    "work reward of a wrong amount": (
        "is not 4096 tokens x reward_per_token",
        lambda r, ids: (
            r.accept(2, ids["ada"], 4096, False),
            r.pay(2, ids["ada"], 4096, amount=5.0),
        )[1],
    ),
    "reward to a banned peer": (
        "a reward to banned peer",
        lambda r, ids: r.pay(0, ids["eve"], 1024),
    ),
    "slash of a wrong amount": (
        "is not slash_fraction 0.5 x stake 10.0 = 5.0",
        lambda r, ids: r.add("slash", round=1, peer_id=ids["ada"], amount=10.0, reason="fraud"),
    ),
    "catch without a fraud dispute": (
        "no unpaid 'fraud' dispute won by validator",
        lambda r, ids: r.add(
            "reward", round=1, peer_id=ids["val"], amount=10.0, kind="catch", tokens=0
        ),
    ),
    "catch paid twice": (
        "no unpaid 'fraud' dispute won by validator",
        lambda r, ids: r.add(
            "reward", round=0, peer_id=ids["val"], amount=10.0, kind="catch", tokens=0
        ),
    ),
    "catch of a wrong amount": (
        "is not catch_reward 10.0",
        lambda r, ids: (
            r.add(
                "dispute",
                round=1,
                peer_id=ids["bob"],
                validator_id=ids["val"],
                segment=0,
                outcome="fraud",
                detail="",
            ),
            r.add("reward", round=1, peer_id=ids["val"], amount=99.0, kind="catch", tokens=0),
        )[1],
    ),
    "contribution without stake": (
        "below min_stake",
        lambda r, ids: r.accept(1, ids["val"], 100),
    ),
    "second acceptance in a round": (
        "a second one of peer",
        lambda r, ids: r.accept(1, ids["ada"], 100),
    ),
    "missing payload field": (
        "payload lacks field 'reason'",
        lambda r, ids: r.add("leave", peer_id=ids["ada"]),
    ),
    "field of the wrong kind": (
        "field 'outcome' must be one of",
        lambda r, ids: r.add(
            "verification",
            round=0,
            peer_id=ids["ada"],
            validator_id=ids["val"],
            outcome="maybe",
            distance=None,
            exact=True,
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(VIOLATIONS))
def test_rule_violations_name_the_entry(tmp_path: Path, case: str) -> None:
    message, violate = VIOLATIONS[case]
    (tmp_path / "honest").mkdir()
    run, ids = full_run(tmp_path / "honest")
    # The honest coordinator: apply fails, its transaction rolls back, and the book still
    # equals the replay of what the table holds.
    with pytest.raises(LedgerError, match=message) as e:
        violate(run, ids)
    assert e.value.index is not None and str(e.value).startswith(f"entry {e.value.index}: ")
    assert len(run.entries()) == e.value.index
    assert run.book.summary() == Book.replay(run.entries()).summary()
    # A dishonest one writes it anyway: the audit names that entry.
    (tmp_path / "dishonest").mkdir()
    run, ids = full_run(tmp_path / "dishonest")
    run.add = _unchecked(run)  # type: ignore[method-assign]
    bad = violate(run, ids)
    with pytest.raises(LedgerError, match=message) as e:
        audit.verify(tmp_path / "dishonest")
    assert e.value.index == bad.index


def _poor_validator(run: Run) -> Entry:
    """A validator joining with less than min_validator_stake (its stake entry breaks)."""
    me = Identity.generate()
    run.add("join", peer_id=me.peer_id, public_key=me.public_key, name="poor", role="validator")
    return run.add("stake", peer_id=me.peer_id, amount=1.0)


def _unchecked(run: Run) -> Callable[..., Entry]:
    add = Run.add

    def unchecked(type: str, apply: bool = True, **payload: Any) -> Entry:
        return add(run, type, apply=False, **payload)

    return unchecked


def test_book_apply_refuses_entries_out_of_order(tmp_path: Path) -> None:
    run, _ = full_run(tmp_path)
    entries = run.entries()
    with pytest.raises(LedgerError, match="applied out of order") as e:
        Book.replay([entries[0], entries[2]])
    assert e.value.index == 2
    with pytest.raises(LedgerError, match="before the 'run created' entry"):
        Book().apply(Entry(0, "join", 0.0, {}, GENESIS, GENESIS, "0" * 128))


# -- tampering --------------------------------------------------------------------------


def _assert_every_flip_names_its_line(path: Path, flips: list[tuple[int, int]], out: Path) -> None:
    data = path.read_bytes()
    for pos, value in flips:
        out.write_bytes(data[:pos] + bytes([value]) + data[pos + 1 :])
        with pytest.raises(LedgerError) as e:
            audit.verify(out)
        assert e.value.index == data.count(b"\n", 0, pos), (pos, value, str(e.value))


def test_every_flipped_byte_of_an_export_names_its_entry(tmp_path: Path) -> None:
    """Exhaustive on a short ledger (every byte, bit 0 and bit 5 flipped), sampled on the full
    one: random values at random places (non-UTF-8 bytes, newlines, quotes) and case swaps
    of hex digits (the same signature bytes, but not the same line)."""
    (tmp_path / "short").mkdir()
    short = Run(tmp_path / "short")
    ada = short.join("ada")
    short.accept(0, ada, 4096, sampled=False)
    short.pay(0, ada, 4096)
    path = export(short, tmp_path / "short.jsonl")
    assert audit.verify(path).entries == 5
    flips = [(i, b ^ bit) for bit in (1, 32) for i, b in enumerate(path.read_bytes())]
    _assert_every_flip_names_its_line(path, flips, tmp_path / "tampered.jsonl")

    run, _ = full_run(tmp_path)
    path = export(run, tmp_path / "ledger.jsonl")
    data = path.read_bytes()
    rng = random.Random(0)
    flips = [
        (i, rng.choice([b for b in range(256) if b != data[i]]))
        for i in rng.sample(range(len(data)), 120)
    ]
    hex_letters = [i for i, b in enumerate(data) if b in b"abcdef"]
    flips += [(i, data[i] ^ 32) for i in rng.sample(hex_letters, 40)]
    _assert_every_flip_names_its_line(path, flips, tmp_path / "tampered.jsonl")


def test_non_canonical_lines_are_rejected() -> None:
    coord = Identity.generate()
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.executescript(LEDGER_SCHEMA)
    payload = {"coordinator_key": coord.public_key, "lr": 1e-05, "name": "é"}
    line = to_line(append(conn, coord, "run created", payload, 5.0))
    assert '"lr":1e-05' in line and "\\u00e9" in line and '"at":5.0' in line
    for before, after in (("1e-05", "1E-05"), ("\\u00e9", "\\u00E9"), ("5.0", "5"), (",", ", ")):
        with pytest.raises(LedgerError, match=r"^entry 4: ") as e:
            parse_line(line.replace(before, after, 1), 4)
        assert e.value.index == 4
    with pytest.raises(LedgerError, match="not valid UTF-8"):
        parse_line(line.encode()[:-1] + b"\xff", 0)
    with pytest.raises(LedgerError, match=r"unexpected \['x'\]"):
        parse_line(line[:-1] + ',"x":1}', 0)


def test_a_payload_changed_in_sqlite_names_its_entry(tmp_path: Path) -> None:
    run, _ = full_run(tmp_path)
    entries = run.entries()
    target = next(e for e in entries if e.type == "reward" and e.payload["kind"] == "catch")
    changed = json.dumps(
        {**target.payload, "amount": 1000.0}, sort_keys=True, separators=(",", ":")
    )
    run.conn.execute("UPDATE ledger SET payload = ? WHERE idx = ?", (changed, target.index))
    with pytest.raises(LedgerError, match="hash does not match its contents") as e:
        audit.verify(tmp_path)
    assert e.value.index == target.index
    # The same value written in another JSON spelling is caught before hashing.
    spaced = json.dumps(target.payload, sort_keys=True)
    run.conn.execute("UPDATE ledger SET payload = ? WHERE idx = ?", (spaced, target.index))
    with pytest.raises(LedgerError, match="payload text is not canonical JSON") as e:
        audit.verify(tmp_path)
    assert e.value.index == target.index
    run.conn.execute(
        "UPDATE ledger SET payload = ? WHERE idx = ?", (to_payload(target), target.index)
    )
    assert audit.verify(tmp_path).entries == len(entries)
    run.conn.execute("DELETE FROM ledger WHERE idx = 4")
    with pytest.raises(LedgerError, match="has index 5, expected 4") as e:
        audit.verify(tmp_path)
    assert e.value.index == 4


def to_payload(entry: Entry) -> str:
    return json.dumps(entry.payload, sort_keys=True, separators=(",", ":"))


# -- audit ------------------------------------------------------------------------------


def test_audit_load_directory_and_jsonl(tmp_path: Path) -> None:
    run, _ = full_run(tmp_path)
    entries = run.entries()
    assert audit.load(tmp_path) == (entries, None, None)
    (tmp_path / audit.BALANCES_FILE).write_text(json.dumps(run.book.summary()))
    assert audit.load(tmp_path) == (entries, run.book.summary(), None)
    assert audit.load(tmp_path / audit.DB_FILE) == (entries, None, None)
    path = export(run, tmp_path / "out" / "ledger.jsonl")
    assert path.read_text() == "".join(to_line(e) + "\n" for e in entries)
    assert audit.load(path) == (entries, None, None)
    with pytest.raises(audit.SourceError, match="no such directory, file or URL"):
        audit.load(tmp_path / "missing")
    with pytest.raises(audit.SourceError, match="not a coordinator's data directory"):
        audit.load(tmp_path / "out")


def test_audit_compares_the_reported_balances(tmp_path: Path) -> None:
    run, ids = full_run(tmp_path)
    balances = tmp_path / audit.BALANCES_FILE
    balances.write_text(json.dumps(run.book.summary()))
    report = audit.verify(tmp_path)
    assert report.compared_at == report.entries == len(run.entries())
    assert report.summary == run.book.summary() and report.accounts == 6
    # Balances written before the last entries were appended cover a prefix: still checked.
    run.accept(5, ids["ada"], 10)
    assert audit.verify(tmp_path).compared_at == report.entries
    lying = run.book.summary()
    lying["accounts"][ids["bob"]]["balance"] += 1.0
    balances.write_text(json.dumps(lying))
    with pytest.raises(LedgerError, match=f"account {ids['bob']} \\(bob\\): balance is") as e:
        audit.verify(tmp_path)
    assert e.value.index is None
    lying = run.book.summary() | {"certificates": 7}
    balances.write_text(json.dumps(lying))
    with pytest.raises(LedgerError, match="certificates is 7 reported, 2 recomputed"):
        audit.verify(tmp_path)


# -- the command line -------------------------------------------------------------------


@pytest.fixture
def cli() -> Callable[..., Any]:
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["ledger", *map(str, args)])


def test_cli_verify_ok_and_invalid(tmp_path: Path, cli: Callable[..., Any]) -> None:
    run, _ = full_run(tmp_path)
    (tmp_path / audit.BALANCES_FILE).write_text(json.dumps(run.book.summary()))
    n = len(run.entries())
    result = cli("verify", tmp_path)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"ledger OK: {n} entries, chain and {n} signatures valid")
    assert run.coord.public_key[:16] in result.output
    assert "balances recomputed for 6 accounts match the coordinator's" in result.output
    path = export(run, tmp_path / "ledger.jsonl")
    data = bytearray(path.read_bytes())
    third = data.index(b"\n", data.index(b"\n") + 1) + 1  # first byte of entry 2
    data[data.index(b'"at":', third) + 6] ^= 1
    path.write_bytes(bytes(data))
    result = cli("verify", path)
    assert result.exit_code == 1
    assert result.output.strip() == "ledger INVALID: entry 2: hash does not match its contents"
    result = cli("verify", tmp_path / "nowhere")
    assert result.exit_code == 2 and "error: no such directory" in result.output


def test_cli_show_and_export(tmp_path: Path, cli: Callable[..., Any]) -> None:
    run, ids = full_run(tmp_path)
    result = cli("show", tmp_path)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:3] == ["name", "peer", "id"]
    eve = next(line for line in lines if line.startswith("eve"))
    assert ids["eve"][:12] in eve and eve.endswith("BANNED")
    ada = next(line for line in lines if line.startswith("ada"))
    assert "66.67" in ada and "8,192" in ada
    result = cli("show", tmp_path, "--json")
    assert result.exit_code == 0 and json.loads(result.output) == run.book.summary()
    out = tmp_path / "exported.jsonl"
    result = cli("export", tmp_path, "--out", out)
    assert result.exit_code == 0 and f"wrote {len(run.entries())} entries" in result.output
    assert [parse_line(line, i) for i, line in enumerate(out.read_text().splitlines())] == (
        run.entries()
    )
    assert cli("verify", out).exit_code == 0
    assert cli("export", tmp_path, "--out", tmp_path / "x.txt").exit_code == 2


def test_a_training_runs_sampling_draws_are_checked(tmp_path: Path) -> None:
    """A training coordinator's ledger (its "run created" names the corpus fingerprint):
    each accepted contribution's draw must be the coordinator's signature of its cid,
    `sampled` must follow from the draw and the rate, and the rate must be one the policy
    gives the peer; a ledger that leaves a contribution unchecked otherwise fails."""
    run = Run(tmp_path, corpus_fingerprint="f" * 16)
    w, other = run.join("w"), Identity.generate()

    def accept(round: int, peer: str, cid: str, rate: float, **override: Any) -> Entry:
        sampled, draw = sample(run.coord, "r" * 16, round, peer, cid, rate)
        payload = {"round": round, "peer_id": peer, "cid": cid, "tokens": 64,
                   "inner_steps": 50, "sampled": sampled, "rate": rate, "draw": draw,
                   "request_id": "q" * 64, "nonce": "1700000000000-00112233aabbccdd",
                   "signature": "5" * 128, **override}  # fmt: skip
        return run.add("contribution accepted", **payload)

    def cid_drawn(round: int, peer: str, below: bool) -> str:
        """A cid whose draw at rate 0.25 falls below it (or not)."""
        for n in itertools.count():
            cid = f"{n:064x}"
            if (draw_value(sample(run.coord, "r" * 16, round, peer, cid, 0.25)[1]) < 0.25) == below:
                return cid
        raise AssertionError  # unreachable

    with pytest.raises(LedgerError, match=r"rate 0.25; the policy's are \[1.0\]"):
        accept(0, w, "a" * 64, 0.25)  # a new peer is drawn at the new-peer rate
    for r in (0, 1):  # new: every contribution drawn
        assert accept(r, w, f"{r:064x}", 1.0).payload["sampled"]
    bad = {
        "says sampled=False": {"sampled": False},  # the draw says checked: it is not
        "not the coordinator's signature": {"draw": other.sign(b"covey-sample/v1")},
    }
    for match, override in bad.items():
        with pytest.raises(LedgerError, match=match):
            accept(2, w, cid_drawn(2, w, True), 0.25, **override)
    moved = sample(run.coord, "r" * 16, 2, w, "e" * 64, 0.25)[1]  # another cid's draw
    with pytest.raises(LedgerError, match="not the coordinator's signature"):
        accept(2, w, "d" * 64, 0.25, draw=moved)
    with pytest.raises(LedgerError, match=r"rate 0.5; the policy's are \[0.25, 1.0\]"):
        accept(2, w, "d" * 64, 0.5)
    with pytest.raises(LedgerError, match=r"rate 0\.0; the run's others were drawn at the policy"):
        accept(2, w, "d" * 64, 0.0)  # a friend left unchecked while the others are drawn
    assert not accept(2, w, cid_drawn(2, w, False), 0.25).payload["sampled"]
    assert accept(3, w, cid_drawn(3, w, True), 0.25).payload["sampled"]
    assert accept(4, w, cid_drawn(4, w, False), 1.0).payload["sampled"]  # low reputation
    assert Book.replay(run.entries()).summary() == run.book.summary()
    # a run nobody re-executes: every contribution at rate 0, none sampled
    (tmp_path / "quiet").mkdir()
    quiet = Run(tmp_path / "quiet", corpus_fingerprint="f" * 16)
    q = quiet.join("q")
    sampled, draw = sample(quiet.coord, "r" * 16, 0, q, "a" * 64, 0.0)
    quiet.add("contribution accepted", round=0, peer_id=q, cid="a" * 64, tokens=64,
              inner_steps=50, sampled=sampled, rate=0.0, draw=draw, request_id="q" * 64,
              nonce="1700000000000-00112233aabbccdd", signature="5" * 128)  # fmt: skip
    assert not sampled and quiet.book.accounts[q].contributions == 1
