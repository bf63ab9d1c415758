"""Scheduled cheaters (covey.peer.adversary): late and intermittent."""

from __future__ import annotations

from pathlib import Path

import pytest

from covey.peer import adversary
from covey.peer.adversary import Schedule, behavior_at, check_behavior, parse_behavior


def test_plain_behaviors_are_themselves_every_round() -> None:
    for b in adversary.BEHAVIORS:
        assert parse_behavior(b) is None
        assert [behavior_at(b, r, "p") for r in range(3)] == [b] * 3


def test_late_cheater_is_honest_until_its_round() -> None:
    assert parse_behavior("late:sign-flip:4") == Schedule("sign-flip", start=4)
    got = [behavior_at("late:sign-flip:4", r, "peer") for r in range(7)]
    assert got == ["honest"] * 4 + ["sign-flip"] * 3


def test_intermittent_cheater_cheats_a_reproducible_fraction() -> None:
    spec = "intermittent:noise:0.3"
    assert parse_behavior(spec) == Schedule("noise", rate=0.3)
    a = [behavior_at(spec, r, "peer-a") for r in range(2000)]
    assert a == [behavior_at(spec, r, "peer-a") for r in range(2000)]  # a pure function
    share = a.count("noise") / len(a)
    assert 0.26 < share < 0.34 and set(a) == {"noise", "honest"}
    b = [behavior_at(spec, r, "peer-b") for r in range(2000)]
    assert a != b  # another peer cheats in other rounds
    assert set(behavior_at("intermittent:lazy:1", r, "x") for r in range(50)) == {"lazy"}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("sneaky", "unknown behavior 'sneaky'"),
        ("late:stale:3", "<kind> must be one of"),
        ("late:noise:x", "'x' is not a round number"),
        ("late:noise:-1", "must be >= 0"),
        ("intermittent:noise:0", r"in \(0, 1\]"),
        ("intermittent:noise:1.5", r"in \(0, 1\]"),
        ("intermittent:noise", "unknown behavior"),
        ("early:noise:3", "unknown behavior"),
    ],
)
def test_bad_schedules_are_refused_by_name(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_behavior(spec)


def test_rounds_to_detection_uses_schedules_and_the_real_draw() -> None:
    from covey.bench.trust_sparse import rounds_to_detection

    full = rounds_to_detection(("late:noise:5", "intermittent:lazy:0.5"), 1.0, cheaters=10)
    assert all(d["caught"] == 1.0 and d["median_rounds"] == 1 for d in full.values())
    assert full["late:noise:5"]["mean_cheats_aggregated"] == 1.0
    # a late cheater skips the new-peer phase: at rate 0.2 it waits about 1 / 0.2 rounds
    sparse = rounds_to_detection(("late:noise:5",), 0.2, cheaters=60, horizon=40)["late:noise:5"]
    assert 2 <= sparse["median_rounds"] <= 8 and sparse["caught"] > 0.9


def test_the_cheats_are_played_by_a_subclass_of_the_honest_worker(tmp_path: Path) -> None:
    from covey.peer.cheater import CheatingWorker, build_worker
    from covey.peer.worker import Worker, WorkerOptions

    def opts(behavior: str) -> WorkerOptions:
        return WorkerOptions("http://127.0.0.1:9", identity=tmp_path / "key", behavior=behavior)

    assert type(build_worker(opts("honest"))) is Worker
    for spec in ("noise", "late:lazy:3", "intermittent:nan:0.5", "withhold"):
        assert type(build_worker(opts(spec))) is CheatingWorker
    with pytest.raises(ValueError, match="cannot play 'noise'"):
        Worker(opts("noise"))  # the honest worker plays nothing else
    with pytest.raises(ValueError, match="unknown behavior 'sneaky'"):
        build_worker(opts("sneaky"))


def test_the_rl_cheats_are_played_by_subclasses_of_the_honest_peers() -> None:
    from covey.rl.cheater import (
        VALIDATOR_BEHAVIORS,
        CheatingRolloutValidator,
        CheatingRolloutWorker,
        worker_behaviors,
    )
    from covey.rl.cheats import CHEATS
    from covey.rl.validator import RolloutValidator
    from covey.rl.worker import RolloutWorker

    assert issubclass(CheatingRolloutWorker, RolloutWorker)
    assert issubclass(CheatingRolloutValidator, RolloutValidator)
    assert set(worker_behaviors()) == {"honest", "replay", *CHEATS}
    assert VALIDATOR_BEHAVIORS == ("honest", "lazy", "accuse")
    with pytest.raises(ValueError, match="unknown behavior 'sneaky'"):
        CheatingRolloutWorker("http://127.0.0.1:9", None, behavior="sneaky")
    with pytest.raises(ValueError, match="unknown validator behavior 'sneaky'"):
        CheatingRolloutValidator("http://127.0.0.1:9", None, behavior="sneaky")
