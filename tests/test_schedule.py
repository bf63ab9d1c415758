"""Learning-rate schedules: warmup + cosine and constant, a pure function of
(round x steps per round + step), for DiLoCo's inner optimizer, Streaming DiLoCo and DDP.
A validator re-executing round r of a scheduled run gets the worker's bytes exactly."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from pydantic import ValidationError

from covey.algorithms import Strategy, build_strategy
from covey.algorithms.optim import scheduled_lr
from covey.config import (
    DDPConfig,
    DiLoCoConfig,
    InnerOptim,
    RunConfig,
    SimConfig,
    StreamingDiLoCoConfig,
)
from covey.data.batches import sample_batch
from covey.models.gpt import lm_loss
from covey.trust.verify import reexecute
from tests.conftest import tiny_gpt

COSINE = InnerOptim(lr=1e-2, schedule="cosine", warmup_steps=4, decay_steps=12, min_lr_ratio=0.1)


def test_warmup_then_cosine_values() -> None:
    lrs = [scheduled_lr(COSINE, s) for s in range(16)]
    assert lrs[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])  # linear warmup to the peak
    assert lrs[4] == pytest.approx(1e-2)  # the cosine starts at the peak
    assert lrs[8] == pytest.approx(1e-3 + 9e-3 * 0.5)  # halfway: the mean of peak and floor
    assert lrs[12] == pytest.approx(1e-3) and lrs[15] == pytest.approx(1e-3)  # held at floor
    assert all(a >= b for a, b in itertools.pairwise(lrs[4:]))  # never rises again
    assert scheduled_lr(COSINE, 6) == pytest.approx(1e-3 + 4.5e-3 * (1 + math.cos(math.pi / 4)))


def test_constant_schedule_with_and_without_warmup() -> None:
    flat = InnerOptim(lr=3e-3)
    assert {scheduled_lr(flat, s) for s in (0, 1, 10**6)} == {3e-3}
    warm = InnerOptim(lr=3e-3, warmup_steps=3)
    assert [scheduled_lr(warm, s) for s in range(5)] == pytest.approx(
        [1e-3, 2e-3, 3e-3, 3e-3, 3e-3]
    )
    with pytest.raises(ValueError, match="step must be >= 0"):
        scheduled_lr(flat, -1)


def test_schedule_config_is_checked_and_old_specs_hash_as_before() -> None:
    with pytest.raises(ValidationError, match="needs decay_steps"):
        InnerOptim(schedule="cosine")
    with pytest.raises(ValidationError, match=r"decay_steps \(4\) must exceed warmup_steps"):
        InnerOptim(schedule="cosine", warmup_steps=4, decay_steps=4)
    # fields at their defaults stay out of the dump: specs without them keep their hashes
    assert "schedule" not in InnerOptim().model_dump(mode="json")
    assert "round_offset" not in SimConfig().model_dump(mode="json")["data"]
    dumped = SimConfig.model_validate({"algorithm": {"optim": COSINE.model_dump()}})
    assert dumped.model_dump(mode="json")["algorithm"]["optim"]["schedule"] == "cosine"
    assert dumped.config_hash() != SimConfig().config_hash()
    spec = RunConfig.model_validate({"algorithm": {"optim": COSINE.model_dump()}})
    assert RunConfig.model_validate(spec.model_dump(mode="json")) == spec


def make(cfg: object) -> Strategy:
    return build_strategy(cfg, tiny_gpt(), lm_loss)  # type: ignore[arg-type]


def batch_fn(tokens: torch.Tensor, r: int, worker: str):
    return lambda s: sample_batch(
        tokens, batch_size=4, seq_len=16, seed=5, round=r, worker=worker, step=s
    )


def lrs_seen(s: Strategy) -> float:
    return s.inner_opt.param_groups[0]["lr"]  # type: ignore[attr-defined]


SCHEDULED = {
    "diloco": DiLoCoConfig(inner_steps=4, optim=COSINE, codec="int4", error_feedback=True),
    "streaming": StreamingDiLoCoConfig(inner_steps=4, fragments=2, optim=COSINE),
}


@pytest.mark.parametrize("name", SCHEDULED)
def test_reexecuting_a_scheduled_round_gives_the_same_bytes(name: str, tokens) -> None:
    """A worker trains rounds 0 and 1 live; a fresh validator re-executes round 1 from its
    start state and the worker's committed end state of round 0: same payload, bit for bit.
    The lr it used is the schedule's at round 1, not the warmup's start."""
    cfg = SCHEDULED[name]
    w, other = make(cfg), make(cfg)
    state = w.init_state()
    for s in (w, other):
        s.begin_round(state)
    per_round = w.steps_per_round
    ends, payloads = [], []
    for r in range(2):
        for s, key in ((w, "a"), (other, "b")):
            fn = batch_fn(tokens, r, key)
            for step in range(per_round):
                s.inner_step(fn(step))
        assert lrs_seen(w) == scheduled_lr(COSINE, r * per_round + per_round - 1)
        mine, theirs = w.make_contribution(), other.make_contribution()
        ends.append(w.local_state())
        payloads.append(mine.payload)
        start = state
        state = w.apply_round(state, [mine, theirs])
        for s in (w, other):  # Streaming merges before step tau, as a worker does
            getattr(s, "merge_late", s.adopt)(state)
    validator = make(cfg)
    again = reexecute(
        validator, start, batch_fn(tokens, 1, "a"), per_round, 2, previous_end=ends[0]
    )
    assert again.payload == payloads[1]
    # the schedule matters: the same round at a constant lr is other bytes
    flat = make(cfg.model_copy(update={"optim": InnerOptim(lr=COSINE.lr)}))
    other_bytes = reexecute(
        flat, start, batch_fn(tokens, 1, "a"), per_round, 2, previous_end=ends[0]
    )
    assert other_bytes.payload != payloads[1]


def test_ddp_follows_the_schedule_by_round(tokens) -> None:
    """DDP takes one step per round: round r's update uses the schedule's lr at r, so two
    peers applying the same gradients agree, and the step differs from a constant lr."""
    sched = DDPConfig(optim=InnerOptim(name="sgd", lr=0.1, warmup_steps=4, grad_clip=0.0))
    flat = DDPConfig(optim=InnerOptim(name="sgd", lr=0.1, grad_clip=0.0))
    a, b, c = make(sched), make(sched), make(flat)
    state = a.init_state()
    for s in (a, b, c):
        s.load_state(state)
    a.inner_step(batch_fn(tokens, 0, "a")(0))
    contribution = a.make_contribution()
    grad = a.codec.decode(contribution.payload)
    name = a.names[0]
    n = state.params[name].numel()
    for r, lr in ((0, 0.025), (2, 0.075), (7, 0.1)):
        at_r = type(state)(state.params, state.outer, r)
        new = a.apply_round(at_r, [contribution])
        assert new.digest() == b.apply_round(at_r, [contribution]).digest()
        expected = state.params[name] - lr * grad[:n].view_as(state.params[name])
        torch.testing.assert_close(new.params[name], expected)
    constant = c.apply_round(state, [contribution])
    assert constant.digest() != a.apply_round(state, [contribution]).digest()
