"""Stale weights in SWARM: a server that skips averaging rounds or serves old
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
    w = StateWatch(grace_s=10.0)
    w.agree({0: ["s1", "s2", "s3"]}, now=0.0)
    assert w.usable("a", 0, "s3", now=0.0) and w.usable("a", 0, "s2", now=0.0)
    assert not w.usable("a", 0, "s1", now=0.0)  # two rounds behind: never
    # an honest server ahead: its new state is used for grace_s, then agreed, and the same
    # again for the next one, however often rounds commit
    assert w.usable("b", 0, "s4", now=1.0) and w.usable("b", 0, "s4", now=10.0)
    w.agree({0: ["s1", "s2", "s3", "s4"]}, now=11.0)
    assert w.usable("b", 0, "s5", now=15.0) and w.usable("b", 0, "s5", now=24.0)
    # behind: the previous state is a switch-over for grace_s after the newest is seen
    assert w.usable("c", 0, "s3", now=21.0) and not w.usable("c", 0, "s3", now=22.0)
    assert w.usable("c", 0, "s4", now=22.0)  # caught up: used
    # made-up ids, a new one at every reply: the first one's clock keeps running
    assert all(w.usable("d", 0, f"fake{i}", now=float(20 + i)) for i in range(11))
    assert not w.usable("d", 0, "fake-new", now=31.0)
    assert not w.usable("d", 0, "s3", now=32.0)  # nor does a superseded state help it
    # on the agreed state its replies are used (the duplicated-hop comparison checks them),
    # and they do not reopen its made-up states
    assert w.usable("d", 0, "s4", now=33.0) and not w.usable("d", 0, "fake0", now=34.0)
    assert StateWatch().usable("e", 0, "anything", now=0.0)  # nothing known: no judgment


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
