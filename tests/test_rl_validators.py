"""RL validators are checked by canaries they cannot tell from real checks: batches of the
run owner's house worker (covey.rl.house), bad at the steps the trainer's secret draw picks,
submitted, assigned and claimed like any batch, revealed ("house canary") only with the
verdict, after the validator reported. An honest validator catches one (a dispute the
trainer's recomputation confirms); an always-agree validator, and one that hunts the tells
of planted copies (a content id not among the public batches, a validator the public
ranking did not draw), agrees on it and pays a missed fraud; `covey ledger verify` replays
all of it. One trainer process for the module (a `covey rl trainer` on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from covey.io.audit import verify as verify_ledger
from covey.rl.batch import RolloutBatch
from covey.rl.cheater import CheatingRolloutValidator
from covey.rl.house import HouseRolloutWorker
from covey.rl.intake import assign_rank
from covey.trust.house import house_canary_draw, house_identity
from covey.trust.identity import Identity
from tests.rl_helpers import (
    batch_status,
    fund,
    joined_worker,
    ledger,
    policy,
    trainer_process,
    validator,
    wait_for,
)

pytestmark = pytest.mark.network
RATE = 0.5
SPEC = f"""
group_size = 4
samples_per_step = 1000
audit_rate = 0.0
verify_timeout_s = 4
eval_prompts = 4
eval_every = 1000
heartbeat_s = 1
dead_after_s = 3
max_batch_bytes = 200000
canary_rate = {RATE}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    data_dir = tmp_path_factory.mktemp("rlv") / "run"
    with trainer_process(data_dir, SPEC) as url:
        yield url, data_dir / "trainer.key"


def _house_worker(url: str, key: Path, canary: bool, after: int = 0) -> HouseRolloutWorker:
    """A joined house worker on the first house key past `after` whose batch at the current
    step is (or, canary=False, is not) a canary."""
    owner, step = Identity.load_or_create(key), policy(url)["version"]
    run_id = httpx.get(f"{url}/v1/run").json()["run_id"]
    index = next(
        i
        for i in range(after, 64)
        if canary
        == (
            house_canary_draw(owner, run_id, step, house_identity(owner, run_id, i).peer_id, RATE)
            is not None
        )
    )
    w = HouseRolloutWorker(url, key, index, name="house")  # the owner's: it funds its keys
    w.membership.join("worker", w.name, w.stake)
    return w


def _house_canaries(url: str, worker_id: str) -> list[dict[str, Any]]:
    return [e["payload"] for e in ledger(url, "house canary", worker_id)]


class TellHunter(CheatingRolloutValidator):
    """Never re-executes: rejects a task that public data shows to be a planted copy (its
    content id is not its worker's public batch of that step, or the public ranking did not
    draw this validator first), agrees with everything else."""

    def __init__(self, url: str) -> None:
        super().__init__(url, Identity.generate(), name="v-hunter", behavior="lazy")
        self.url = url
        self.tells: list[str] = []

    def verdict(
        self, task: dict[str, Any], batch: RolloutBatch, model: torch.nn.Module
    ) -> dict[str, Any]:
        rows = [r for r in batch_status(self.url, task["worker_id"]) if r["step"] == task["step"]]
        decided = [r["cid"] for r in rows if r["cid"] is not None]  # undecided: cid hidden
        live = [self.identity.peer_id]  # the only live validator of these tests
        first = min(live, key=lambda v: assign_rank(task["assign_draw"], v))
        if not rows or any(cid != task["batch_cid"] for cid in decided):
            self.tells.append("content id")
        if first != self.identity.peer_id:
            self.tells.append("ranking")
        if self.tells:
            return {"ok": False, "problem": "proof", "detail": "a planted copy"}
        return {"ok": True}


def _stake(url: str, peer_id: str) -> float:
    return httpx.get(f"{url}/v1/rl/status").json()["accounts"][peer_id]["stake"]


def test_an_honest_validator_catches_a_house_canary(run: tuple[str, Path]) -> None:
    url, key = run
    house = _house_worker(url, key, canary=True)
    assert house.step(policy(url)) is not None and house.canaries
    with validator(url) as honest:
        wait_for(lambda: _house_canaries(url, house.identity.peer_id), 90, "the reveal")
        [reveal] = _house_canaries(url, house.identity.peer_id)
        assert reveal["outcome"] == "caught"
        [report] = honest.reports
        assert report["outcome"] == "caught" and report["problem"] in ("proof", "logprobs")
        [dispute] = ledger(url, "dispute", house.identity.peer_id)
        assert dispute["payload"]["outcome"] == "fraud"
        assert dispute["payload"]["validator_id"] == honest.identity.peer_id
        assert not ledger(url, "penalty", honest.identity.peer_id)
    # the burned key is refused: the house worker goes on under its next key
    burned, index = house.identity.peer_id, house.index
    assert house.step(policy(url)) is None
    assert house.index == index + 1 and house.identity.peer_id != burned
    assert not house.stop.is_set()
    house.membership.leave()


def test_validators_that_agree_or_hunt_tells_pay_for_a_house_canary(
    run: tuple[str, Path],
) -> None:
    url, key = run
    after = 40  # past the keys the other test may have burned
    for make in (lambda: TellHunter(url), None):
        house = _house_worker(url, key, canary=True, after=after)
        after, house_id = house.index + 1, house.identity.peer_id
        honest = joined_worker(url)  # a real batch of the same step beside the canary
        info = policy(url)
        assert house.step(info) is not None and honest.step(info) is not None
        hunter = None if make is None else make()
        if hunter is not None:  # the owner funds its stake: it joins in run_loop
            fund(url, hunter.identity.public_key, hunter.stake)
        ctx = validator(url, "lazy") if hunter is None else _running(hunter)
        with ctx as lazy:
            wait_for(lambda: _house_canaries(url, house_id), 90, "the reveal")  # noqa: B023
            [reveal] = _house_canaries(url, house_id)
            assert reveal["outcome"] == "convicted"
            [penalty] = ledger(url, "penalty", lazy.identity.peer_id)
            assert penalty["payload"]["kind"] == "missed fraud"
            assert _stake(url, lazy.identity.peer_id) < lazy.stake  # what it joined with
            if isinstance(lazy, TellHunter):
                assert lazy.tells == []  # nothing public told the canary apart
            status = httpx.get(f"{url}/v1/rl/status").json()
            assert status["canaries"].get("convicted", 0) >= 1
            counts = status["accounts"][lazy.identity.peer_id]["counts"]
            assert counts["canaries_passed"] == 1
        house.membership.leave()
        honest.membership.leave()
    report = verify_ledger(url)  # what `covey ledger verify URL` runs: raises if bad
    accounts = report.summary["accounts"]
    assert sum(a["counts"]["canaries_passed"] for a in accounts.values()) == 2


class _running:
    """A validator object polling in a thread for the block (tests.rl_helpers.validator's
    loop, for a validator built here)."""

    def __init__(self, v: Any) -> None:
        self.v = v

    def __enter__(self) -> Any:
        import threading

        self.thread = threading.Thread(target=self.v.run_loop, kwargs={"poll_s": 0.1})
        self.thread.daemon = True
        self.thread.start()
        return self.v

    def __exit__(self, *exc: object) -> None:
        self.v.stop.set()
        self.thread.join(10)


@pytest.mark.long
def test_a_lazy_validator_pays_within_the_expected_reports(tmp_path: Path) -> None:
    """Processes: a trainer, an honest worker and a house worker (`covey rl worker
    --house-of`), so h = 1/2 and a check is a canary with probability q = 1/4 (docs/rl.md: 4
    reports on average); an always-agree validator pays its first missed fraud within 20
    reports (a geometric draw exceeds 20 with probability 0.75^20 < 0.4%)."""
    import subprocess
    import sys

    from tests.rl_helpers import ROOT
    from tests.rl_helpers import SPEC as BASE
    from tests.rl_helpers import stop as stop_process

    spec = BASE.replace("canary_rate = 0.0", f"canary_rate = {RATE}")
    spec = spec.replace("audit_rate = 1.0", "audit_rate = 0.0")
    data_dir = tmp_path / "run"
    with trainer_process(data_dir, spec) as url:
        cmd = [sys.executable, "-m", "covey", "rl", "worker", "--trainer", url]
        house = ["--house-of", str(data_dir / "trainer.key")]
        honest = Identity.load_or_create(tmp_path / "honest.key")
        fund(url, honest.public_key, 1.0)  # what it stakes (the house worker funds its own)
        procs = []
        for name, extra in (("honest", ["--identity", str(tmp_path / "honest.key")]),
                            ("house", house)):  # fmt: skip
            with open(tmp_path / f"{name}.log", "wb") as log:
                argv = [*cmd, "--name", name, *extra]
                procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))

        def paid() -> list[dict[str, Any]]:
            for p, name in zip(procs, ("honest", "house"), strict=True):
                assert p.poll() is None, f"worker {name} exited: see {tmp_path / name}.log"
            return ledger(url, "penalty", me)

        try:
            with validator(url, "lazy") as lazy:
                me = lazy.identity.peer_id
                wait_for(paid, 400, "the lazy validator's penalty")
                [penalty] = ledger(url, "penalty", me)
                assert penalty["payload"]["kind"] == "missed fraud"
                reports = len(lazy.reports)
            print(f"lazy validator: first missed fraud after {reports} reports")
            assert reports <= 20
            reveals = [
                e["payload"]
                for e in httpx.get(f"{url}/v1/ledger", params={"limit": 5000}).json()
                if e["type"] == "house canary"
            ]
            assert reveals and all(r["outcome"] == "convicted" for r in reveals)
        finally:
            for p in procs:
                stop_process(p)
        verify_ledger(url)
