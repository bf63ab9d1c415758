"""Faults of the swarm coordinator and of trainers: killing any server, a trainer,
or the coordinator mid-step loses no accepted update and hangs nothing.

The first test is fast and in-process: a coordinator is dropped without a goodbye (as a
SIGKILL leaves it) and a second one opened on its directory resumes the open averaging
round with its accepted report, the committed steps, its trainers and the queued pay. The
`long` tests kill real processes with SIGKILL: the coordinator mid-step (restarted on the
same directory and port), a trainer mid-step (restarted under its name, it resumes).
"""

from __future__ import annotations

import base64
import hashlib
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from covey.io import audit
from covey.swarm.launch import Swarm, status, wait_for
from tests.swarm_helpers import SETTINGS as BASE
from tests.swarm_helpers import four_servers


def _coordinator(path: Path, **settings: Any) -> Any:
    from covey.swarm.config import SwarmConfig
    from covey.swarm.service import SwarmCoordinator

    cfg = SwarmConfig(n_layer=2, n_embd=16, n_head=2, seq_len=8, stages=2, **settings)
    return SwarmCoordinator(cfg, path)


def _client(coord: Any) -> Any:
    from fastapi.testclient import TestClient

    from covey.swarm.app import create_app

    return TestClient(create_app(coord))


def _post(client: Any, identity: Any, path: str, body: dict) -> Any:
    return client.post(path, json=identity.sign_request(body, -1, purpose=f"POST {path}"))


S0 = "0" * 64  # a stage state id the servers claim


def _gradient_sum(shapes: list[tuple[int, ...]], samples: int, seed: int) -> bytes:
    """A server's gradient sum as covey.swarm.sums checks it."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(seed)
    sums = {f"g.{i}": torch.randn(shape, generator=g) for i, shape in enumerate(shapes)}
    return save({**sums, "samples": torch.tensor([samples], dtype=torch.int64)})


def test_a_restarted_coordinator_resumes_rounds_trainers_and_unpaid_work(tmp_path: Path) -> None:
    from covey.trust.identity import Identity

    coord = _coordinator(tmp_path / "run", target_samples=8)
    client, run = _client(coord), coord.run_id
    ids = [Identity.generate() for _ in range(3)]  # servers 0, 1 on stage 0; 2: a trainer

    def join(c: Any, i: int, role: str = "server") -> dict:
        body = {"run_id": run, "peer_id": ids[i].peer_id, "public_key": ids[i].public_key,
                "name": f"p{i}", "role": role, "stake": 0.0, "url": "http://127.0.0.1:9",
                "blob_url": "http://127.0.0.1:9", "stage": 0}  # fmt: skip
        r = _post(c, ids[i], "/v1/swarm/join", body)
        assert r.status_code == 200, r.text
        return r.json()

    def beat(c: Any, i: int, step: int, state: str, pending: int) -> dict:
        body = {"run_id": run, "peer_id": ids[i].peer_id, "stage": 0, "step": step,
                "state": state, "pending": pending, "throughput": 1.0, "queue": 0}  # fmt: skip
        r = _post(c, ids[i], "/v1/swarm/heartbeat", body)
        assert r.status_code == 200, r.text
        return r.json()

    def report(c: Any, i: int, round_id: int, seed: int) -> Any:
        data = _gradient_sum(coord._shapes(0), 4, seed)
        body = {"run_id": run, "peer_id": ids[i].peer_id, "stage": 0, "round": round_id,
                "cid": hashlib.sha256(data).hexdigest(), "samples": 4,
                "data": base64.b64encode(data).decode()}  # fmt: skip
        return _post(c, ids[i], "/v1/swarm/round", body)

    join(client, 0), join(client, 1), join(client, 2, "trainer")
    # pending samples count as far as a trainer vouches it was served (one microbatch each)
    vouch = {"run_id": run, "peer_id": ids[2].peer_id, "samples": 8, "loss": 3.0,
             "reroutes": 0, "banned": {},
             "served": {ids[0].peer_id: 1, ids[1].peer_id: 1}}  # fmt: skip
    assert _post(client, ids[2], "/v1/swarm/report", vouch).status_code == 200
    beat(client, 0, 0, S0, 4), beat(client, 1, 0, S0, 4)
    coord.tick(coord._last_payout + 0.1)
    rnd = coord.averaging.stages[0].round
    assert rnd is not None and rnd.members == sorted([ids[0].peer_id, ids[1].peer_id])
    assert report(client, 0, rnd.id, seed=0).status_code == 200
    served = {"run_id": run, "peer_id": ids[2].peer_id, "samples": 8, "loss": 3.0,
              "reroutes": 0, "banned": {}, "served": {ids[0].peer_id: 3}, "next": 17}  # fmt: skip
    assert _post(client, ids[2], "/v1/swarm/report", served).status_code == 200
    with coord.lock:  # pay queued for a verified check (tests/test_swarm_pay.py: how)
        coord.unpaid[ids[0].peer_id] = 96
        coord._save()

    # SIGKILL: no stop(), nothing flushed; a new coordinator opens the same directory
    again = _coordinator(tmp_path / "run", target_samples=8)
    c2 = _client(again)
    book = again.averaging.stages[0]
    assert book.round is not None and book.round.id == rnd.id
    assert set(book.round.reports) == {ids[0].peer_id}  # the accepted report survived
    assert again.unpaid == {ids[0].peer_id: 96}
    assert join(c2, 2, "trainer")["resume"] == 17  # a restarted trainer goes on from here
    again.tick(again._last_payout + 0.1)  # in the grace period: nobody counts as gone
    assert again.averaging.stages[0].round is not None
    for i in (0, 1):  # servers are re-learned from their heartbeats: 404, join, beat
        assert _post(c2, ids[i], "/v1/swarm/heartbeat", {"run_id": run,
                     "peer_id": ids[i].peer_id, "stage": 0, "step": 0, "state": S0,
                     "pending": 0, "throughput": 1.0, "queue": 0}).status_code == 404  # fmt: skip
        join(c2, i)
        assert beat(c2, i, 0, S0, 0)["round"]["id"] == rnd.id
    assert report(c2, 1, rnd.id, seed=1).status_code == 200
    again.tick(again._grace_until + 0.1)
    assert book.step == 1 and again.averaging.stages[0].rounds == 1
    assert set(again.averaging.stages[0].last.reports) == {ids[0].peer_id, ids[1].peer_id}
    again.pay(now=0.0)
    paid = again.accounts.book.accounts[ids[0].peer_id].balance
    assert paid > 0

    # a second crash after the payout: the committed step stays, nothing is paid twice
    third = _coordinator(tmp_path / "run", target_samples=8)
    assert third.averaging.stages[0].step == 1 and third.unpaid == {}
    assert third.epoch == again.epoch
    third.pay(now=0.0)
    assert third.accounts.book.accounts[ids[0].peer_id].balance == paid
    assert audit.verify(tmp_path / "run" / "swarm.db").entries > 0
    for c in (coord, again, third):
        c._stop.set()  # the liveness flusher first, then its database
        c.db.close()


# ---- real processes: SIGKILL of the coordinator and of a trainer --------------------------

SETTINGS = {**BASE, "verify_rate": 0.25}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    yield from four_servers(tmp_path_factory.mktemp("swarm-faults"), SETTINGS)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _steps(url: str) -> list[int] | None:
    s = status(url)
    return None if s is None else [b["step"] for b in s["averaging"]]


def _reported(where: str | dict, name: str) -> dict | None:
    """The books' entry of trainer `name` once it reported work (`where`: a coordinator's
    URL or its status' trainers)."""
    trainers = where if isinstance(where, dict) else (status(where) or {}).get("trainers", {})
    found = [x for x in trainers.values() if x["name"] == name and x.get("next", 0) > 0]
    return found[0] if found else None


def _advanced(url: str, before: list[int]) -> bool:
    """Every stage committed a round since `before` (its steps)."""
    steps = _steps(url)
    return steps is not None and all(a > b for a, b in zip(steps, before, strict=True))


def _settled(url: str, n_servers: int) -> dict | None:
    """Status once no round is open and every live server holds its stage's agreed state."""
    s = status(url)
    if s is None or any(b["open_round"] is not None for b in s["averaging"]):
        return None
    agreed = {b["stage"]: (b["step"], b["agreed"]) for b in s["averaging"]}
    ok = all((x["step"], x["state"]) == agreed[x["stage"]] for x in s["servers"])
    return s if ok and len(s["servers"]) == n_servers else None


@pytest.mark.long
@pytest.mark.network
def test_sigkill_of_the_coordinator_mid_step_loses_no_accepted_update(swarm: Swarm) -> None:
    """Rounds committed before the kill are there after the restart; servers rejoin on
    their own, the trainer (hops straight to servers, reports deferred) never stops, rounds
    commit again, work is paid after the restart and the ledger verifies."""
    from covey.swarm.trainer import SwarmTrainer

    t = SwarmTrainer(swarm.url, name="steady", inflight=2, progress=lambda _: None)
    run = threading.Thread(target=lambda: t.train(seconds=240), daemon=True)
    try:
        run.start()
        wait_for(lambda: (st := _steps(swarm.url)) and min(st) >= 1, 120, "a round per stage")
        wait_for(lambda: _reported(swarm.url, "steady"), 60, "the trainer's first report")
        before = _steps(swarm.url)
        books = status(swarm.url)
        assert before is not None and books is not None
        swarm.kill_coordinator()  # mid-step: the trainer has microbatches in flight
        samples = t.stats.samples
        swarm.start_coordinator()
        after = _steps(swarm.url)
        assert after is not None and after >= before  # committed rounds survived
        kept = status(swarm.url)
        assert kept is not None
        # the books the restarted coordinator read back: every trainer, each stage's
        # agreed states up to the kill, no progress lost
        old, new = _reported(books["trainers"], "steady"), _reported(kept["trainers"], "steady")
        assert new is not None and old is not None and new["next"] >= old["next"] > 0
        for a, b in zip(books["averaging"], kept["averaging"], strict=True):
            assert b["rounds"] >= a["rounds"] and b["samples"] >= a["samples"]
        wait_for(lambda: t.stats.samples > samples + 16, 120, "training to go on")
        swarm.ready(["a0", "a1", "b0", "b1"], timeout=120)  # rejoined from heartbeats
        wait_for(lambda: _advanced(swarm.url, before), 120, "rounds to commit after the restart")
    finally:
        t.stop.set()
        run.join(timeout=60)
        t.close()
    assert not run.is_alive(), "the trainer hung"
    wait_for(lambda: _settled(swarm.url, 4), 60, "every server to hold its agreed state")
    s = status(swarm.url)
    assert s is not None and any(v > 0 for v in s["balances"].values())
    assert audit.verify(swarm.workdir / "run" / "swarm.db").entries > 0


@pytest.mark.long
@pytest.mark.network
def test_sigkill_of_a_trainer_mid_step_hangs_nothing_and_its_restart_resumes(
    swarm: Swarm,
) -> None:
    """Servers keep no per-microbatch state (forward is stateless, backward recomputes and
    accumulates at once), so a trainer killed mid-step leaves nothing waiting: another
    trainer goes on, rounds commit, every server agrees; the killed one restarted under its
    name starts after the microbatches it reported."""
    from covey.swarm.trainer import SwarmTrainer

    victim = swarm.start_trainer("victim", "--seconds", "300", "--inflight", "2")
    other = SwarmTrainer(swarm.url, name="other", inflight=1, progress=lambda _: None)
    run = threading.Thread(target=lambda: other.train(seconds=300), daemon=True)

    def victim_next() -> int:
        s = status(swarm.url) or {"trainers": {}}
        return max((int(x.get("next", 0)) for x in s["trainers"].values()
                    if x["name"] == "victim"), default=0)  # fmt: skip

    restarted: subprocess.Popen | None = None
    try:
        wait_for(lambda: victim_next() >= 4, 240, "the victim trainer to report work")
        run.start()
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        reported = victim_next()
        before = _steps(swarm.url)
        assert before is not None
        wait_for(lambda: _advanced(swarm.url, before), 120, "rounds without the killed trainer")
        out = swarm.workdir / "victim.json"
        restarted = swarm.start_trainer("victim", "--samples", "8", "--json", str(out))
        assert restarted.wait(timeout=240) == 0
        import json

        summary = json.loads(out.read_text())
        assert summary["first_microbatch"] >= reported > 0
        assert summary["samples"] >= 8
    finally:
        for p in (victim, restarted):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)
        other.stop.set()
        run.join(timeout=60)
        other.close()
    assert not run.is_alive(), "the other trainer hung"
    wait_for(lambda: _settled(swarm.url, 4), 60, "every server to hold its agreed state")
