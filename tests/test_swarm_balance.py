"""Routing and rebalancing with servers of different speeds (churn): the
router measures service time, not queueing, and the rebalancer converts per-request rates
to stage throughput with stage 0's two requests per microbatch."""

from __future__ import annotations

import pytest

from covey.swarm.rebalance import plan_move, speeds_from_measurements, stage_throughputs
from covey.swarm.routing import Router

COSTS = [2.0, 1.0]  # stage 0: forward and backward per microbatch; the last: one backward


def test_service_time_does_not_count_the_queue_as_slowness() -> None:
    """Two requests sent at once to a server of 0.2 s per request: the second is answered
    after 0.4 s. By latency the server looks half as fast; by service time it does not."""
    for service, want in ((True, 20.0), (False, 15.0)):
        r = Router(ema=0.5, probe_rate=0.0, service_time=service)
        r.add_server("a", 0)
        r.started("a")
        r.started("a")
        r.finished("a", 4, 0.2)
        r.finished("a", 4, 0.4)
        assert r.servers["a"].throughput == pytest.approx(want)
        assert r.servers["a"].queue == 0 and not r.servers["a"].ahead


def test_service_time_prefers_a_busy_fast_server_over_an_idle_slow_one_only_while_faster() -> None:
    r = Router(ema=1.0, probe_rate=0.0, service_time=True)
    for name, seconds in (("fast", 0.2), ("slow", 0.6)):
        r.add_server(name, 0)
        r.started(name)
        r.finished(name, 4, seconds)
    r.started("fast")
    assert r.choose(0, 0.0) == "fast"  # 2 x 0.2 s < 0.6 s
    r.started("fast")
    r.started("fast")
    assert r.choose(0, 0.0) == "slow"  # 4 x 0.2 s > 0.6 s
    r.timed_out("fast", now=0.0)  # a timeout leaves the queue too
    assert r.servers["fast"].queue == 2 and len(r.servers["fast"].ahead) == 2


def test_the_bench_speeds_are_balanced_and_no_server_moves() -> None:
    """Servers at 1x, 3x on stage 0 and 2x, 4x on stage 1 (0.2 s a request at 1x, 4
    samples): stage 0 gives (20 + 6.7) / 2 = 13.3 samples/s, stage 1 10 + 5 = 15. Moving
    any server lowers the minimum; the old conversion (rate x cost) saw stage 0 at 26.7
    and moved the 3x server off it, leaving stage 0 at 10."""
    measured = {"x1": (0, 20.0), "x3": (0, 20 / 3), "x2": (1, 10.0), "x4": (1, 5.0)}
    speeds = speeds_from_measurements(COSTS, measured)
    tp = stage_throughputs(COSTS, speeds)
    assert tp == pytest.approx([40 / 3, 15.0])
    assert plan_move(COSTS, speeds, hysteresis=1.2) is None


def test_after_a_kill_the_bottleneck_gets_a_server_when_that_helps() -> None:
    """Stage 1 lost its servers but one slow one (2 samples/s); stage 0 has three at 10 per
    request (15 samples/s): moving one to stage 1 gives min(10, 12) = 10 > 1.2 x 2."""
    measured = {"a": (0, 10.0), "b": (0, 10.0), "c": (0, 10.0), "d": (1, 2.0)}
    move = plan_move(COSTS, speeds_from_measurements(COSTS, measured), hysteresis=1.2)
    assert move is not None and move.to_stage == 1
    assert move.min_before == pytest.approx(2.0) and move.min_after == pytest.approx(10.0)
    with pytest.raises(ValueError, match="stage 2"):
        speeds_from_measurements(COSTS, {"e": (2, 1.0)})
