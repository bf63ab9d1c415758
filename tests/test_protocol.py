"""The round state machine's pure decisions and the state wire format, without sockets."""

from __future__ import annotations

import pytest
import torch

from covey.algorithms import TrainState
from covey.config import RoundsConfig
from covey.protocol.checkpoint import CheckpointError, state_from_bytes, state_to_bytes
from covey.protocol.content import check_content_id, content_id, is_content_id
from covey.protocol.rounds import (
    PeerView,
    close_reason,
    data_key,
    inner_step_budget,
    is_alive,
    plan_round,
)

CFG = RoundsConfig(
    heartbeat_s=2, dead_after_s=6, target_compute_s=10, deadline_slack=2,
    deadline_min_s=5, deadline_max_s=100, bandwidth_mbps=100,
)  # fmt: skip


def peer(pid: str, step: float = 0.1, seen: float = 100.0, state: str = "live") -> PeerView:
    return PeerView(pid, step, None, seen, state)


@pytest.mark.parametrize(
    ("now", "state", "alive"),
    [(100, "live", True), (106, "live", True), (106.01, "live", False), (100, "left", False),
     (100, "dead", False)],
)  # fmt: skip
def test_a_peer_silent_for_6_s_is_dead(now: float, state: str, alive: bool) -> None:
    assert is_alive(now, peer("a", seen=100, state=state), CFG) is alive


@pytest.mark.parametrize(
    ("step_time", "flexible", "budget"),
    [(0.1, True, 50), (0.5, True, 20), (3.0, True, 3), (100.0, True, 1), (3.0, False, 50)],
)
def test_budget_fits_the_target_for_flexible_methods(
    step_time: float, flexible: bool, budget: int
) -> None:
    assert inner_step_budget(step_time, 50, flexible, CFG) == budget


def test_plan_fixes_live_membership_and_bounds_the_deadline() -> None:
    peers = [peer("b", 0.1), peer("a", 0.5), peer("gone", seen=0), peer("left", state="left")]
    plan, deadline = plan_round(
        100.0, "run", 3, peers, steps_per_round=50, flexible=True, payload_bytes=0, cfg=CFG
    )
    assert [a.peer_id for a in plan] == ["a", "b"]  # sorted, only the live ones
    assert [a.inner_steps for a in plan] == [20, 50]
    assert deadline == pytest.approx(100 + 2 * 10.0)  # slack x slowest (20 x 0.5 s)
    _, d_fast = plan_round(
        0.0, "run", 3, [peer("a", 0.001, seen=0)], steps_per_round=5, flexible=True,
        payload_bytes=0, cfg=CFG,
    )  # fmt: skip
    assert d_fast == CFG.deadline_min_s
    _, d_slow = plan_round(
        0.0, "run", 3, [peer("a", 50.0, seen=0)], steps_per_round=5, flexible=False,
        payload_bytes=0, cfg=CFG,
    )  # fmt: skip
    assert d_slow == CFG.deadline_max_s


def test_deadline_counts_transfer_time() -> None:
    peers = [peer("a", 0.01), peer("b", 0.01)]
    _, without = plan_round(100, "r", 0, peers, steps_per_round=1, flexible=False,
                            payload_bytes=0, cfg=CFG)  # fmt: skip
    _, with_bytes = plan_round(100, "r", 0, peers, steps_per_round=1, flexible=False,
                               payload_bytes=125_000_000, cfg=CFG)  # fmt: skip
    # 2 payloads of 1 Gbit over the assumed 100 Mbit/s = 20 s, times slack 2
    assert with_bytes - without == pytest.approx(2 * 20 - CFG.deadline_min_s + 2 * 0.01, abs=0.1)


def test_data_key_is_deterministic_and_distinct() -> None:
    assert data_key("run", 1, "a") == data_key("run", 1, "a")
    keys = {data_key(r, n, p) for r in ("x", "y") for n in (0, 1) for p in ("a", "b")}
    assert len(keys) == 8


def test_close_reasons() -> None:
    assert close_reason(0, 10, ["a", "b"], ["a"]) is None
    assert close_reason(0, 10, ["a", "b"], ["a", "b"]) == "every live member submitted"
    assert close_reason(0, 10, [], []) == "every live member submitted"  # nobody to wait for
    assert "deadline passed; 1 live" in (close_reason(10, 10, ["a", "b"], ["b"]) or "")


def state() -> TrainState:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    return TrainState(params, {"w": torch.zeros(4, 3), "step": torch.tensor(2)}, 7)


def test_state_bytes_round_trip_and_are_canonical() -> None:
    s = state()
    data = state_to_bytes(s)
    back = state_from_bytes(data, s)
    assert back.digest() == s.digest() and back.round == 7
    shuffled = TrainState(dict(reversed(list(s.params.items()))), s.outer, 7)
    assert state_to_bytes(shuffled) == data  # dict order never changes the content id


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda s: TrainState({**s.params, "w": s.params["w"][:2]}, s.outer, 1), "expected"),
        (lambda s: TrainState({"w": s.params["w"]}, s.outer, 1), "missing ['b']"),
        (lambda s: TrainState({**s.params, "b": s.params["b"].double()}, s.outer, 1), "float64"),
        (lambda s: TrainState({**s.params, "b": torch.full((3,), float("nan"))}, {}, 1), "NaN"),
    ],
)
def test_state_from_bytes_rejects_states_of_another_shape(mutate, words: str) -> None:
    s = state()
    with pytest.raises(CheckpointError, match=words.replace("[", r"\[").replace("]", r"\]")):
        state_from_bytes(state_to_bytes(mutate(s)), s)


def test_state_from_bytes_rejects_garbage_and_truncation() -> None:
    s = state()
    data = state_to_bytes(s)
    for bad in (b"", b"\x00" * 8, data[:-1], b"\xff" * 8 + data[8:]):
        with pytest.raises(CheckpointError):
            state_from_bytes(bad, s)


def test_content_ids() -> None:
    cid = content_id(b"x")
    assert is_content_id(cid) and check_content_id(cid) == cid
    for bad in (cid.upper(), cid + "\n", cid[:-1], "../" + cid[3:], ""):
        assert not is_content_id(bad)
        with pytest.raises(ValueError):
            check_content_id(bad)
