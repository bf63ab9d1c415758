"""Stale weights in SWARM (issue 15): a server that skips averaging rounds or serves old
weights. Replies are signed on a state id; a trainer stops using a server whose replies name
a state the stage has not agreed on (covey.swarm.routing.StateWatch), and a server that
names the agreed state while computing on old weights is caught by the duplicated-hop
comparison: after one applied round its replies are far beyond `tolerance`, where honest
replies on one state differ only by thread-count noise. The process run (a stale server
convicted and banned) is tests/test_swarm_network.py::...caught_and_slashed[stale]."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from covey.swarm import compute
from covey.swarm.config import SwarmConfig
from covey.swarm.routing import StateWatch
from covey.swarm.wire import build_stage, encode_tensor, pack, unpack


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_replies_on_states_the_stage_has_not_agreed_on_stop_being_used() -> None:
    w = StateWatch(grace_s=10.0, agreed={0: ["old", "new"]})
    assert w.usable("a", 0, "new", now=0.0) and w.usable("a", 0, "old", now=0.0)
    # a round's switch-over: a state not agreed yet is used for grace_s
    assert w.usable("b", 0, "next", now=0.0) and w.usable("b", 0, "next", now=9.0)
    w.agreed[0] = ["new", "next"]
    assert w.usable("b", 0, "next", now=20.0)  # agreed now: the clock is cleared
    # a server that stays on a superseded state, or makes up a new id each reply
    assert w.usable("c", 0, "old", now=20.0) and not w.usable("c", 0, "old", now=31.0)
    assert not w.usable("c", 0, "made-up-1", now=32.0)  # a new id does not restart it
    assert w.usable("c", 0, "next", now=33.0)  # back on the agreed state: used again
    assert StateWatch().usable("d", 0, "anything", now=0.0)  # nothing known: no judgment


def test_old_weights_are_far_beyond_tolerance_after_one_round_and_honest_noise_is_not() -> None:
    cfg = SwarmConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16, stages=2, microbatch=4)
    s0, s1 = build_stage(cfg, 0), build_stage(cfg, 1)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):  # a round's worth of microbatches, then the averaged step
        idx = torch.randint(0, 256, (4, 17), generator=g)
        (act, _) = unpack(compute.forward(cfg, 0, s0, pack(encode_tensor(idx[:, :-1], "int8"))), 2)
        (grad, _) = unpack(
            compute.backward(cfg, 1, s1, pack(act, encode_tensor(idx[:, 1:], ""))), 2
        )
        compute.backward(cfg, 0, s0, pack(encode_tensor(idx[:, :-1], ""), grad))
    stale0, stale1 = copy.deepcopy(s0), copy.deepcopy(s1)
    for s in (stale0, stale1):  # the stale copy keeps its weights and drops its sum
        for p in s.params:
            p.grad = None
        s.samples = 0
    s0.step(), s1.step()
    idx = torch.randint(0, 256, (4, 17), generator=g)
    fwd = pack(encode_tensor(idx[:, :-1], "int8"))
    torch.set_num_threads(1)
    one = compute.forward(cfg, 0, s0, fwd)
    torch.set_num_threads(2)
    two = compute.forward(cfg, 0, s0, fwd)
    (act, _) = unpack(one, 2)
    bwd = pack(act, encode_tensor(idx[:, 1:], ""))
    b_one = compute.backward(cfg, 1, s1, bwd)
    torch.set_num_threads(1)
    b_two = compute.backward(cfg, 1, s1, bwd)
    honest = max(compute.reply_distance(one, two), compute.reply_distance(b_one, b_two))
    stale = min(
        compute.reply_distance(one, compute.forward(cfg, 0, stale0, fwd)),
        compute.reply_distance(b_one, compute.backward(cfg, 1, stale1, bwd)),
    )
    assert honest <= 1e-6 and stale > 2 * cfg.tolerance, (honest, stale)
