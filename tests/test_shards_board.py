"""Sharded aggregation's draws and board, in one process: who aggregates
which shard, who checks it, fallback, fraud, certification; a peer refuses a shard whose
hash is not certified."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import pytest
import torch

from covey.algorithms.shards import plan_shards, shard_hash, shard_to_bytes
from covey.coordinator.sharding import (
    ShardBoard,
    ShardError,
    assign_shards,
    drawn_for_check,
    shard_rank,
)
from covey.peer.aggregator import (
    certified_shard,
    check_certificate,
    computed_from,
    shard_purpose,
)
from covey.trust.identity import Identity

BEACON = hashlib.sha256(b"certificate of round 6").hexdigest()


def test_assignment_is_a_balanced_public_draw_with_a_fallback_order() -> None:
    peers = [f"{i:02d}" * 8 for i in range(7)]
    orders = assign_shards(BEACON, 7, 32, peers)
    assert orders == assign_shards(BEACON, 7, 32, list(reversed(peers)))  # order-free
    assert all(sorted(o) == sorted(peers) for o in orders)  # everyone, once, per shard
    firsts = Counter(o[0] for o in orders)
    assert max(firsts.values()) <= -(-32 // 7)  # balanced
    # a shard's fallbacks follow the public rank: anyone recomputes them
    for s, order in enumerate(orders):
        rest = sorted(order[1:], key=lambda p: shard_rank(BEACON, 7, s, p))
        assert list(order[1:]) == rest
    assert assign_shards("0" * 64, 7, 32, peers) != orders  # the beacon decides
    with pytest.raises(ValueError, match="no staked aggregators"):
        assign_shards(BEACON, 7, 4, [])
    drawn = sum(drawn_for_check(BEACON, r, s, 0.25) for r in range(40) for s in range(50))
    assert 400 < drawn < 600  # about a quarter of 2000
    assert not any(drawn_for_check(BEACON, 1, s, 0.0) for s in range(100))
    assert all(drawn_for_check(BEACON, 1, s, 1.0) for s in range(100))


class Run:
    """A board over three aggregator keys with a referee that knows the true hashes."""

    def __init__(self, check_rate: float = 1.0) -> None:
        self.coordinator = Identity.generate()
        self.keys = {k.peer_id: k for k in (Identity.generate() for _ in range(3))}
        self.banned: set[str] = set()
        self.slashed: list[tuple[int, str, str]] = []
        self.plan = plan_shards(100, 4)
        self.truth = {s: f"{s}" * 64 for s in range(4)}
        self.board = ShardBoard(
            "run1",
            self.coordinator,
            public_key=lambda p: self.keys[p].public_key if p in self.keys else None,
            is_banned=lambda p: p in self.banned,
            referee=lambda r, s: self.truth[s],
            slash=self.slash,
            check_rate=check_rate,
            publish_timeout_s=30.0,
        )
        work = [{"peer_id": "w" * 16, "cid": "d" * 64, "size": 10}]
        inputs = {"start_cid": "c" * 64, "weights": [1.0], "norms": None, "contributions": work}
        self.board.open(3, "a" * 64, BEACON, self.plan, list(self.keys), inputs, 0.0)
        self.evidence: list[dict[str, Any]] = []

    def slash(self, round: int, peer: str, reason: str, evidence: dict[str, Any]) -> None:
        self.slashed.append((round, peer, reason))
        self.evidence.append(evidence)
        self.banned.add(peer)

    def signed(self, who: str, action: str, **body: Any) -> dict[str, Any]:
        if action == "publish" and "board" not in body:  # what it computed from
            body["board"] = computed_from(self.board.view(3), body["index"])
        body = {"run_id": "run1", "peer_id": who, **body}
        return self.keys[who].sign_request(body, 3, purpose=shard_purpose(3, action))

    def shard(self, s: int) -> dict[str, Any]:
        return self.board.view(3)["shards"][s]


def test_a_lying_aggregator_is_slashed_and_its_shards_pass_on() -> None:
    """Everyone acts on the board as an aggregator does; one key lies on every shard."""
    run = Run()
    liar = run.shard(2)["aggregator"]
    outcomes: list[str] = []
    for _ in range(20):  # passes over the board, as aggregators poll it
        view = run.board.view(3)
        if view["certificate"] is not None:
            break
        for s in range(len(view["shards"])):
            shard = run.shard(s)  # fresh: a fraud moves turns and checkers
            who = shard["aggregator"]
            if shard["published"] is None and who not in run.banned:
                value = "f" * 64 if who == liar else run.truth[s]
                run.board.publish(3, run.signed(who, "publish", index=s, hash=value, url="u"))
            elif shard["published"] and shard["checker"] and not shard["agreed"]:
                body = run.signed(shard["checker"], "check", index=s, hash=run.truth[s])
                outcomes.append(run.board.check(3, body, 1.0)["outcome"])
    cert = run.board.view(3)["certificate"]
    assert cert is not None, run.board.view(3)
    assert [x["hash"] for x in cert["shards"]] == list(run.truth.values())
    assert liar not in {x["aggregator"] for x in cert["shards"]}
    assert [(r, p) for r, p, _ in run.slashed] == [(3, liar)]  # once, however many lies
    # the slash cites the liar's own signed publish, the inputs and the referee's hash
    (ev,) = run.evidence
    assert ev["published"]["peer_id"] == liar and ev["published"]["hash"] == "f" * 64
    assert ev["truth"] == run.truth[ev["shard"]] and ev["published"]["index"] == ev["shard"]
    assert ev["board"]["inputs"] == [["w" * 16, "d" * 64, 1.0]]
    assert ev["board"]["start_hash"] == "a" * 64 and ev["start_cid"] == "c" * 64
    assert ev["published"]["board"] == computed_from(run.board.view(3), ev["shard"])
    assert outcomes.count("fraud") == 1 and "agree" in outcomes
    with pytest.raises(ShardError, match="excluded"):  # the liar cannot publish again
        run.board.publish(3, run.signed(liar, "publish", index=2, hash="e" * 64, url="x"))
    check_certificate(cert, run.coordinator.public_key)
    with pytest.raises(ValueError, match="not signed"):
        check_certificate({**cert, "round": 4}, run.coordinator.public_key)


def test_a_convicted_liar_loses_the_turns_it_has_not_used_at_once() -> None:
    """A liar caught on its first publish holds other shards it has not published yet:
    they pass to the next aggregator now, not after shard_publish_timeout_s."""
    run = Run()
    firsts = Counter(run.shard(s)["aggregator"] for s in range(4))
    liar = firsts.most_common(1)[0][0]
    mine = [s for s in range(4) if run.shard(s)["aggregator"] == liar]
    assert len(mine) >= 2
    run.board.publish(3, run.signed(liar, "publish", index=mine[0], hash="f" * 64, url="u"))
    checker = run.shard(mine[0])["checker"]
    body = run.signed(checker, "check", index=mine[0], hash=run.truth[mine[0]])
    assert run.board.check(3, body, 1.0)["outcome"] == "fraud"
    assert all(run.shard(s)["aggregator"] not in (liar, None) for s in range(4))
    assert run.board.expire(3, 2.0) == []  # nothing waits on a timeout


def test_a_publish_must_name_the_bytes_it_read() -> None:
    """A hole once open: a liar could name bytes it never read and so void its own
    slash under `covey ledger verify --recompute`. With the coordinator's digest of the
    contributions' ranges (ShardedAggregation.reads), a publish naming other bytes is refused."""
    run = Run()
    run.board._reads = lambda r, s: f"{s}" * 64  # the coordinator's digests, per shard
    who = run.shard(0)["aggregator"]
    with pytest.raises(ShardError, match="not the digest of the contributions' bytes"):
        run.board.publish(3, run.signed(who, "publish", index=0, hash="1" * 64, reads="f" * 64))
    with pytest.raises(ShardError, match="not the digest"):  # or none at all
        run.board.publish(3, run.signed(who, "publish", index=0, hash="1" * 64))
    assert run.shard(0)["published"] is None
    run.board.publish(3, run.signed(who, "publish", index=0, hash="1" * 64, reads="0" * 64))
    assert run.shard(0)["published"]["hash"] == "1" * 64


def test_refusals_change_nothing() -> None:
    run = Run()
    who = run.shard(0)["aggregator"]
    other = next(p for p in run.keys if p != who)
    with pytest.raises(ShardError, match=r"not .*'s"):
        run.board.publish(3, run.signed(other, "publish", index=0, hash="1" * 64, url="x"))
    body = run.signed(who, "publish", index=0, hash="1" * 64, url="x")
    with pytest.raises(ShardError, match="bad signature"):
        run.board.publish(3, {**body, "hash": "2" * 64})
    with pytest.raises(ShardError, match="bad signature"):  # signed for another endpoint
        run.board.publish(3, run.signed(who, "check", index=0, hash="1" * 64, url="x"))
    with pytest.raises(ShardError, match="not this round's board of shard 0"):
        run.board.publish(3, run.signed(who, "publish", index=0, hash="1" * 64, board="9" * 64))
    assert run.shard(0)["published"] is None
    # a checker that is wrong convicts nobody
    run.board.publish(3, run.signed(who, "publish", index=0, hash=run.truth[0], url="x"))
    checker = run.shard(0)["checker"]
    answer = run.board.check(3, run.signed(checker, "check", index=0, hash="9" * 64), 1.0)
    assert answer["outcome"] == "checker wrong" and not run.slashed


def test_a_silent_aggregator_loses_its_turn_not_the_round() -> None:
    run = Run(check_rate=0.0)
    first = run.shard(1)["aggregator"]
    assert run.board.expire(3, 10.0) == []
    assert run.board.expire(3, 31.0) == [0, 1, 2, 3]
    assert run.shard(1)["aggregator"] not in (first, None)


def test_a_peer_refuses_a_shard_whose_hash_is_not_certified() -> None:
    params, momentum = torch.randn(25), torch.randn(25)
    cert = {
        "round": 3,
        "bounds": [0, 25, 50],
        "shards": [{"index": 0, "hash": shard_hash(3, 0, 0, params, momentum)}],
    }
    got, _ = certified_shard(cert, 0, shard_to_bytes(params, momentum), True)
    assert torch.equal(got, params)
    params[7] += 1e-6  # one coordinate, a hair off
    with pytest.raises(ValueError, match=r"certified .*: refused"):
        certified_shard(cert, 0, shard_to_bytes(params, momentum), True)
    with pytest.raises(ValueError, match="bytes"):
        certified_shard(cert, 0, shard_to_bytes(params, None), True)


def test_when_no_aggregator_delivers_the_coordinator_takes_the_shard_over() -> None:
    run = Run(check_rate=0.0)
    assert run.board.orphans(3) == []
    for t in (31.0, 62.0, 93.0):  # each of the three aggregators misses its turn
        run.board.expire(3, t)
    assert run.board.orphans(3) == [0, 1, 2, 3] and run.board.certificate(3) is None
    for s in range(4):
        run.board.take_over(3, s, run.truth[s], f"cid{s}")
    cert = run.board.certificate(3)
    assert cert is not None and cert["new_hash"] is None
    assert {x["aggregator"] for x in cert["shards"]} == {run.coordinator.peer_id}
    final = run.board.finish(3, "d" * 64)  # the assembled state's digest, signed in
    assert final["new_hash"] == "d" * 64
    check_certificate(final, run.coordinator.public_key)
    with pytest.raises(ValueError, match="not signed"):
        check_certificate({**final, "new_hash": "e" * 64}, run.coordinator.public_key)


def test_validator_aggregate_needs_a_stake_and_documents_itself() -> None:
    from typer.testing import CliRunner

    from covey.cli import app

    result = CliRunner().invoke(app, ["validator", "--aggregate"])
    assert result.exit_code == 2 and "--aggregate needs --stake" in result.output
    helped = CliRunner().invoke(app, ["validator", "--help"], env={"COLUMNS": "200"})
    assert helped.exit_code == 0 and "--aggregate" in helped.output
    assert "aggregator of sharded rounds" in helped.output


def test_a_silent_checker_leaves_its_shards_to_the_coordinator() -> None:
    run = Run(check_rate=1.0)
    for s in range(4):
        who = run.shard(s)["aggregator"]
        run.board.publish(3, run.signed(who, "publish", index=s, hash=run.truth[s], url="u"))
    assert run.board.unfinished(3) == ([], [0, 1, 2, 3]) and run.board.certificate(3) is None
    for s in range(4):  # the driver's overdue path: it checked them itself, all right
        run.board.agree(3, s)
    assert run.board.unfinished(3) == ([], [])
    assert run.board.certificate(3) is not None
