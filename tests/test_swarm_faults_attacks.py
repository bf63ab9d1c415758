"""Attacks on the swarm coordinator's averaging and dispute request bodies: per field,
what a dishonest server or trainer would put there, and a test per hole found (each was
open before; see docs/swarm.md, "Attacks, field by field"). In-process coordinator, real
signatures."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from covey.swarm import compute
from covey.swarm.averaging import Averaging
from tests.test_swarm_pay import Desk


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def desk(tmp_path: Path) -> Iterator[Desk]:
    d = Desk(tmp_path, spot_check_rate=0.0, target_samples=8)
    yield d
    d.close()


def _sum(shapes: list, samples: int, scale: float = 1.0, seed: int = 0, **over: Any) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = {f"g.{i}": scale * torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    t["samples"] = torch.tensor([samples], dtype=torch.int64)
    t.update(over)
    return save({k: v for k, v in t.items() if v is not None})


def _round(desk: Desk) -> Any:
    """Open a round of stage 0 with servers a and b."""
    desk.vouch("a", "b")
    for n in "ab":
        body = {"run_id": desk.coord.run_id, "peer_id": desk.pid(n), "stage": 0, "step": 0,
                "state": desk.state, "pending": 4, "throughput": 1.0, "queue": 0}  # fmt: skip
        assert desk.post(n, "/v1/swarm/heartbeat", body).status_code == 200
    desk.coord.tick(desk.coord._last_payout + 0.1)
    rnd = desk.coord.averaging.stages[0].round
    assert rnd is not None and set(rnd.members) == {desk.pid("a"), desk.pid("b")}
    return rnd


def _report(desk: Desk, who: str, rnd: Any, data: bytes, samples: int = 4, **over: Any) -> Any:
    body = {"run_id": desk.coord.run_id, "peer_id": desk.pid(who), "stage": 0,
            "round": rnd.id, "cid": hashlib.sha256(data).hexdigest(), "samples": samples,
            "data": base64.b64encode(data).decode(), **over}  # fmt: skip
    return desk.post(who, "/v1/swarm/round", body)


def test_a_gradient_sum_no_member_could_apply_is_refused(desk: Desk) -> None:
    """Every member applies every reported sum: a malformed one used to stop the stage (its
    servers failed on it at each directive), NaN poisoned it, samples 0 pushed an
    unweighted gradient, a huge sample count diluted everyone's."""
    rnd = _round(desk)
    shapes = desk.coord._shapes(0)
    nan = torch.full(shapes[0], float("nan"))
    lies = {
        "not safetensors": (b"\x00" * 64, 4),
        "a tensor missing": (_sum(shapes, 4, **{"g.1": None}), 4),
        "an extra tensor": (_sum(shapes, 4, extra=torch.zeros(1)), 4),
        "wrong shape": (_sum(shapes, 4, **{"g.0": torch.zeros(3, 3)}), 4),
        "float64": (_sum(shapes, 4, **{"g.0": torch.zeros(shapes[0], dtype=torch.float64)}), 4),
        "nan": (_sum(shapes, 4, **{"g.0": nan}), 4),
        "samples differ from the blob's": (_sum(shapes, 4), 5),
        "0 samples, a push": (_sum(shapes, 0), 0),
        "samples past any sense": (_sum(shapes, 2**40), 2**40),
        "negative samples": (_sum(shapes, -4), -4),
    }
    for why, (data, n) in lies.items():
        r = _report(desk, "a", rnd, data, samples=n)
        assert r.status_code == 422, (why, r.status_code, r.text)
    for why, over in {"stage as text": {"stage": "0"}, "stage 9": {"stage": 9},
                      "samples as float": {"samples": 4.0}}.items():  # fmt: skip
        assert _report(desk, "a", rnd, _sum(shapes, 4), **over).status_code == 422, why
    assert rnd.reports == {}  # nothing entered the round, and a left it: nobody waits for it
    assert rnd.members == [desk.pid("b")]
    assert _report(desk, "a", rnd, _sum(shapes, 4)).status_code == 409
    zero = _sum(shapes, 0, scale=0.0)  # an honest server with nothing pending
    assert _report(desk, "b", rnd, zero, samples=0).status_code == 200


@pytest.mark.parametrize("lie", ["norm", "samples"])
def test_a_sum_far_larger_or_heavier_is_left_out_of_the_round(desk: Desk, lie: str) -> None:
    """A huge sum poisons every member; a sum of ordinary per-sample norm claiming many
    samples sets the round's direction (samples weigh it in the mean)."""
    rnd = _round(desk)
    shapes = desk.coord._shapes(0)
    assert _report(desk, "a", rnd, _sum(shapes, 4, seed=1)).status_code == 200
    n = 4 if lie == "norm" else 4000
    scale = 1000.0  # per sample: 1000x a's, or with 1000x the samples a quarter of it
    assert _report(desk, "b", rnd, _sum(shapes, n, scale=scale, seed=2), n).status_code == 200
    desk.coord.tick(desk.coord._last_payout + 0.2)
    book = desk.coord.averaging.stages[0]
    assert book.step == 1 and book.last is not None
    assert set(book.last.reports) == {desk.pid("a")} and book.last.dropped == [desk.pid("b")]
    assert book.samples == 4


def test_a_lone_liar_cannot_win_the_agreed_state_by_a_tie() -> None:
    """The agreed state was the most-voted with ties to the larger id: one liar of two
    won half the time and the honest server was told to resync to its weights."""
    avg = Averaging(1, target_samples=4, round_timeout_s=10.0)
    live = {"honest": (0, 0, 4), "liar": (0, 0, 4)}
    avg.tick(live, set(), 0.0)
    for p in live:
        assert avg.report(p, 0, 0, f"sum-{p}", 4, "") == "ok"
    avg.tick(live, set(), 1.0)
    assert avg.stages[0].step == 1
    after = {p: (0, 1, 0) for p in live}
    avg.state("honest", 0, 1, "a" * 64)
    avg.state("liar", 0, 1, "f" * 64)  # "f..." > "a...": it won the old tie-break
    avg.tick(after, set(), 2.0)
    assert avg.stages[0].agreed is None
    assert "resync" not in avg.directive("honest", 0, 1, "a" * 64)
    # a third voter that applied the round settles it; the liar is the one told to resync
    avg.stages[0].last.reports["third"] = {"cid": "x", "samples": 4, "url": ""}  # type: ignore[union-attr]
    avg.state("third", 0, 1, "a" * 64)
    avg.tick({**after, "third": (0, 1, 0)}, set(), 3.0)
    assert avg.stages[0].agreed == "a" * 64
    assert avg.directive("liar", 0, 1, "f" * 64)["resync"] == "a" * 64


def test_a_convicted_servers_sum_leaves_the_open_round(desk: Desk) -> None:
    rnd = _round(desk)
    shapes = desk.coord._shapes(0)
    assert _report(desk, "a", rnd, _sum(shapes, 4, seed=1)).status_code == 200
    assert _report(desk, "b", rnd, _sum(shapes, 4, seed=2)).status_code == 200
    desk.coord._convict(0, "forward", {"liars": [desk.pid("b")], "honest": [desk.pid("a")],
                                       "detail": "test"}, desk.pid("t"))  # fmt: skip
    assert set(rnd.reports) == {desk.pid("a")} and desk.pid("b") not in rnd.members


def test_dispute_bodies_a_server_or_a_replay_would_send(desk: Desk) -> None:
    req = desk.request()
    wrong = compute.forward(desk.cfg, 0, desk.stage, desk.request())
    a, b = desk.reply("a", req), desk.reply("b", req, out=wrong)
    body = {"run_id": desk.coord.run_id, "stage": 0, "kind": "forward",
            "request": base64.b64encode(req).decode(), "replies": [a, b]}  # fmt: skip

    def dispute(who: str, **over: Any) -> Any:
        return desk.post(who, "/v1/swarm/dispute", {**body, "peer_id": desk.pid(who), **over})

    assert dispute("a").status_code == 403  # a server framing its rival: not a trainer
    assert dispute("t", replies=[a, b, b]).status_code == 422  # referee work per dispute
    assert dispute("t", replies=[a, a]).status_code == 400  # one server, "two" replies
    calls = []
    settle = desk.coord.referee.settle
    desk.coord.referee.settle = lambda *x: calls.append(1) or settle(*x)  # type: ignore[method-assign]
    r = dispute("t")
    assert r.status_code == 200 and r.json()["liars"] == [desk.pid("b")]
    again = dispute("t")  # replayed: the same verdict, no second recomputation
    assert again.status_code == 200 and again.json() == r.json() and calls == [1]
    assert desk.coord.accounts.book.accounts[desk.pid("b")].banned


def test_a_signed_reply_that_is_no_reply_is_convicted_with_evidence_that_verifies(
    desk: Desk,
) -> None:
    """A server signs bytes that do not parse as a reply: infinitely far from the truth.
    The verdict is still JSON (a finite stand-in distance), the conviction keeps its
    evidence, and `covey ledger verify` checks and recomputes it."""
    from covey.io import audit
    from covey.swarm.ledger_evidence import recompute_disputes
    from covey.trust.ledger import read_entries

    req = desk.request()
    a, b = desk.reply("a", req), desk.reply("b", req, out=b"not a reply")
    body = {"run_id": desk.coord.run_id, "peer_id": desk.pid("t"), "stage": 0,
            "kind": "forward", "request": base64.b64encode(req).decode(),
            "replies": [a, b]}  # fmt: skip
    r = desk.post("t", "/v1/swarm/dispute", body)
    assert r.status_code == 200 and r.json()["liars"] == [desk.pid("b")], r.text
    entries = read_entries(desk.coord.db.path)
    (dispute,) = [e for e in entries if e.type == "dispute"]
    assert dispute.payload["evidence"]["distances"][desk.pid("b")] > 1e20
    assert dispute.payload["validator_id"] == desk.pid("a")  # the honest server caught it
    assert audit.verify(desk.coord.db.path).swarm_convictions == 1
    assert recompute_disputes(entries, lambda cid, cap: desk.coord.blobs.get(cid)) == 1


def test_a_member_that_claims_samples_and_never_reports_is_benched() -> None:
    """A heartbeat's `pending` opens rounds; a member that never reports made every round
    wait out its timeout. After two misses in a row it is kept out for a while, and the
    next round commits as soon as the others report."""
    avg = Averaging(1, target_samples=4, round_timeout_s=10.0)
    now, members = 0.0, []
    for step in range(3):
        live = {"honest": (0, step, 4), "idle": (0, step, 10**6)}
        for p in live:  # both claim the agreed state
            avg.state(p, 0, step, f"state-{step}")
        avg.tick(live, set(), now)
        r = avg.stages[0].round
        assert r is not None
        members.append(r.members)
        assert avg.report("honest", 0, r.id, f"sum-{step}", 4, "") == "ok"
        avg.tick(live, set(), now + 1.0)
        if avg.stages[0].round is not None:  # waiting for "idle"
            now += 11.0
            avg.tick(live, set(), now)
        assert avg.stages[0].round is None and avg.stages[0].step == step + 1
        now += 1.0
    assert members == [["honest", "idle"], ["honest", "idle"], ["honest"]]
    assert avg.stages[0].benched["idle"] > now  # for 2 timeouts after its second miss


def test_a_server_claiming_pending_samples_trainers_never_sent_opens_no_round(
    desk: Desk,
) -> None:
    """A server's pending count opens averaging rounds; it counts only as far as trainers
    vouch the server answered their backward hops (covey.swarm.observed)."""

    def beat(n: str, pending: int) -> None:
        body = {"run_id": desk.coord.run_id, "peer_id": desk.pid(n), "stage": 0, "step": 0,
                "state": desk.state, "pending": pending, "throughput": 1e5, "queue": 0}  # fmt: skip
        assert desk.post(n, "/v1/swarm/heartbeat", body).status_code == 200

    beat("a", 10**6), beat("b", 0)  # a lie: target_samples is 8
    desk.coord.tick(desk.coord._last_payout + 0.1)
    assert desk.coord.averaging.stages[0].round is None
    desk.vouch("a")  # one microbatch (4 samples) served: still short of the target
    desk.coord.tick(desk.coord._last_payout + 0.1)
    assert desk.coord.averaging.stages[0].round is None
    desk.vouch("a")
    desk.coord.tick(desk.coord._last_payout + 0.1)
    assert desk.coord.averaging.stages[0].round is not None
