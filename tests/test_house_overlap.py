"""A house worker overlaps rounds as an honest worker does (covey.peer.house,
covey.peer.worker_overlap): in a Streaming DiLoCo run with tau > 0 it trains round r+1's
first tau steps while round r is published, so the timing of its submissions does not tell
it from an honest worker; a canary round trains on other data from its first step, the
steps trained ahead included, and is still caught.

The unit test puts an honest, a cheating and a house worker in the same state and asks each
whether it overlaps (the house worker answers as the honest one, the cheat never) and which
data its steps trained ahead use. The network test runs a coordinator, an honest worker, a
house worker and an honest validator on 127.0.0.1: both workers log the same steps trained
ahead, and the validator catches the house worker's canary round, trained ahead too."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from covey.algorithms import build_strategy
from covey.config import RunConfig
from covey.config.parts import load_toml
from covey.io import audit
from covey.models.gpt import lm_loss
from covey.peer.cheater import CheatingWorker
from covey.peer.house import HouseWorker
from covey.peer.worker import Worker, WorkerOptions
from covey.peer.worker_types import LocalStates
from covey.protocol.rounds import data_key
from covey.trust.house import house_canary_draw, house_identity
from covey.trust.identity import Identity
from covey.trust.ledger import Entry
from tests.conftest import tiny_gpt
from tests.test_worker_overlap import SPEC as OVERLAP_SPEC

SPEC = OVERLAP_SPEC + "canary_rate = 0.5\n"  # its [trust] table is the last
TAU = 3  # its overlap_steps


def placed(worker: Worker, cfg: RunConfig, run_id: str) -> Worker:
    """`worker` as its set-up and first round leave it (covey.peer.worker.Worker._setup,
    _begin_round): the run's config and strategy, round 1's local states, no group."""
    worker.cfg, worker.run_id, worker.leader = cfg, run_id, None
    worker.strategy = build_strategy(cfg.algorithm, tiny_gpt(), lm_loss)
    worker._local = LocalStates(None, round=1)
    return worker


def test_a_house_worker_overlaps_as_an_honest_one_and_trains_ahead_on_its_canary_data(
    tmp_path: Path,
) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    cfg = RunConfig.model_validate(load_toml(spec))
    assert cfg.algorithm.overlap_steps == TAU and cfg.trust.canary_rate == 0.5
    owner_key = tmp_path / "coordinator.key"
    owner = Identity.load_or_create(owner_key)
    run_id = "r" * 16

    def opts(name: str, behavior: str = "honest") -> WorkerOptions:
        return WorkerOptions("http://127.0.0.1:9", identity=tmp_path / f"{name}.key",
                             behavior=behavior, run_id=run_id)  # fmt: skip

    honest = placed(Worker(opts("honest")), cfg, run_id)
    cheat = placed(CheatingWorker(opts("cheat", "wrong-data")), cfg, run_id)
    house = placed(HouseWorker(opts("house"), owner_key, 0), cfg, run_id)
    assert honest._overlaps() and house._overlaps()  # Streaming DiLoCo, tau > 0
    assert not cheat._overlaps()  # a cheat publishes one round at a time
    for w in (honest, house):  # the same rule's other answers: a torchrun group's leader,
        w.leader = object()  # a method that carries no local state
        assert not w._overlaps()
        w.leader, w._local = None, None
        assert not w._overlaps()
    # the steps trained ahead use the round's own data, and a canary round's other data
    me = house_identity(owner, run_id, 0).peer_id
    assert house.peer_id == me
    rate = cfg.trust.canary_rate
    canary = next(r for r in range(1, 200) if house_canary_draw(owner, run_id, r, me, rate))
    plain = next(r for r in range(1, 200) if not house_canary_draw(owner, run_id, r, me, rate))
    for r in (canary, plain):
        key = data_key(run_id, r, me)
        assert honest._data_key_ahead(r, key) == key
        expected = key[::-1] if r == canary else key  # covey.peer.adversary.data_key
        assert house._data_key_ahead(r, key) == expected


def rounds_log(cluster_dir: Path, name: str) -> dict[int, dict]:  # type: ignore[type-arg]
    path = cluster_dir / "peers" / name / "rounds.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {(r := json.loads(line))["round"]: r for line in lines}


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.long
def test_an_overlapping_house_worker_times_like_an_honest_one_and_its_canary_is_caught(
    tmp_path: Path,
) -> None:
    from covey.local.cluster import LocalCluster

    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        # a house key whose first canary round is 2 or 3: rounds before it train ahead
        rate = cluster.config.trust.canary_rate

        def first_canary(index: int) -> int:
            me = house_identity(cluster.owner, cluster.run_id, index).peer_id
            owner, run_id = cluster.owner, cluster.run_id
            return next(r for r in range(100) if house_canary_draw(owner, run_id, r, me, rate))

        index = next(i for i in range(64) if first_canary(i) in (2, 3))
        canary = first_canary(index)
        cluster.start_worker("ada", "--threads", "1")
        cluster.start_house_worker("house", index, "--threads", "1")
        cluster.start_validator("val", "--threads", "1")
        house = cluster.ids["house"]

        def caught() -> list[Entry]:
            found, _, _ = audit.load(cluster.url)
            return [
                e
                for e in found
                if e.type == "house canary"
                and e.payload["peer_id"] == house
                and e.payload["outcome"] == "caught"
            ]

        give_up = time.monotonic() + 240
        while not (reveals := caught()):
            assert time.monotonic() < give_up, cluster.tail() + cluster.tail("house")
            time.sleep(1.0)  # polling the ledger under a deadline
        assert reveals[0].payload["round"] == canary
        found, _, _ = audit.load(cluster.url)
        disputes = [
            e.payload
            for e in found
            if e.type == "dispute" and (e.payload["round"], e.payload["peer_id"]) == (canary, house)
        ]
        ada, mine = rounds_log(tmp_path, "ada"), rounds_log(tmp_path, "house")
        audit.verify(cluster.url)  # the draw and the proof recomputed
    # the house worker trained every round after its first ahead, as the honest one did,
    # its canary round included
    assert canary in mine, mine
    assert [mine[r]["ahead"] for r in range(1, canary + 1)] == [TAU] * canary, mine
    assert [ada[r]["ahead"] for r in range(1, canary + 1)] == [TAU] * canary, ada
    # the steps trained ahead were the canary's too: its first segment (steps 0-2 of the
    # tau = 3 trained ahead, commit_every 2) diverges, not the first one after step tau
    assert [(d["outcome"], d["segment"]) for d in disputes] == [("fraud", 0)], disputes
