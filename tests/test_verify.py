"""Verification by re-execution (covey/trust/verify.py): commitments, comparison,
bisection, referee; and the strategies' local state it rests on. One process, nano GPT."""

from __future__ import annotations

import dataclasses
import math
import pickle
import struct

import pytest
import torch

from covey.algorithms import DiLoCo, Strategy, build_strategy
from covey.algorithms.codec_base import CodecError
from covey.algorithms.codecs import get_codec
from covey.algorithms.state import TrainState
from covey.bench.trust_calibration import CHEATS, cheat_claim
from covey.config import DDPConfig, DeMoConfig, DiLoCoConfig, InnerOptim, StreamingDiLoCoConfig
from covey.data.batches import sample_batch
from covey.models.gpt import GPT, gpt_config, lm_loss
from covey.peer.adversary import forge_payload
from covey.trust.committer import Committer
from covey.trust.referee import judge, referee
from covey.trust.sketch import (
    BUCKETS,
    NO_HASH,
    Commitment,
    _hashing,
    commitment_distance,
    commitment_of,
    distance,
    sketch,
    state_hash,
)
from covey.trust.verify import (
    BatchFn,
    Reexecution,
    SpilledStates,
    bisect,
    commitment_steps,
    compare,
    local_state_from_bytes,
    local_state_from_file,
    local_state_to_bytes,
    reexecute,
    segment_bounds,
    segment_end,
)

TOL = 0.02
STEPS, K = 10, 3  # commitments at 0, 3, 6, 9: four segments, the last one is step 9 alone
RESET = DiLoCoConfig(inner_steps=STEPS, inner_state="reset", codec="fp32")
SETUPS = {
    "diloco-fp32": (RESET, STEPS),
    "diloco-int4": (RESET.model_copy(update={"codec": "int4"}), STEPS),
    "ddp": (DDPConfig(), 1),
}


def make(cfg: object, seed: int = 0) -> Strategy:
    torch.manual_seed(seed)
    return build_strategy(cfg, GPT(gpt_config("nano")), lm_loss)  # type: ignore[arg-type]


def batches(tokens: torch.Tensor, key: str = "peer-0", r: int = 0) -> BatchFn:
    return lambda s: sample_batch(
        tokens, batch_size=4, seq_len=16, seed=3, round=r, worker=key, step=s
    )


def numel(s: Strategy) -> int:
    return sum(p.numel() for p in s.model.parameters())


def work(s: Strategy, start: TrainState, batch_fn: BatchFn, steps: int, k: int):
    """A worker's round as covey/peer/worker.py runs it, committing inside its own loop."""
    s.load_state(start)
    committer = Committer(s, start, k)
    for step in range(steps):
        s.inner_step(batch_fn(step))
        committer.after_step(step + 1)
    return committer.commitments, s.make_contribution().payload


# -- strategies: flags, local state, inner_state -------------------------------------------


def test_reexecutable_only_when_a_round_is_a_function_of_its_start() -> None:
    # every built-in config is re-executable; those that carry local state from round to
    # round commit it (the local-state chain; tests/test_reexecutable.py)
    streaming = StreamingDiLoCoConfig(inner_steps=4, fragments=2, inner_state="reset")
    carries = {
        DDPConfig(): False,
        RESET: False,
        DiLoCoConfig(): True,  # "keep" is the default
        RESET.model_copy(update={"error_feedback": True}): True,
        streaming: True,
        DeMoConfig(): True,
    }
    for cfg, carried in carries.items():
        assert make(cfg).reexecutable and make(cfg).carries_local_state == carried, cfg
    opaque = make(DDPConfig())

    class Opaque(type(opaque)):  # type: ignore[misc]
        reexecutable = False  # type: ignore[assignment]

    opaque.__class__ = Opaque
    with pytest.raises(ValueError, match="not re-executable"):
        reexecute(opaque, make(RESET).init_state(), lambda s: None, 2, 1)


@pytest.mark.parametrize(
    "cfg",
    [
        RESET,
        DiLoCoConfig(inner_steps=8, optim=InnerOptim(name="sgd", lr=0.05)),
        DDPConfig(),
        DeMoConfig(topk=8),
        StreamingDiLoCoConfig(inner_steps=8, fragments=2),
    ],
    ids=["diloco", "diloco-sgd", "ddp", "demo", "streaming"],
)
def test_local_state_round_trip_continues_bit_identically(cfg, tokens) -> None:
    """Stop after 4 steps, ship the local state as bytes, continue in another process's
    strategy: the payload is byte-identical to training straight through."""
    one_step = isinstance(cfg, (DDPConfig, DeMoConfig))  # one step a round: cross rounds
    batch_fn = batches(tokens)
    a = make(cfg)
    start = a.init_state()
    a.load_state(start)
    first = 1 if one_step else 4
    for s in range(first):
        a.inner_step(batch_fn(s))
    if one_step:
        a.make_contribution()
    blob = local_state_to_bytes(a.local_state())
    b = make(cfg, seed=1)
    b.load_state(start)
    b.load_local_state(local_state_from_bytes(blob, b.local_state(copy=False)))
    assert state_hash(b.local_state()) == state_hash(a.local_state())
    for s in range(first, 2 * first):
        a.inner_step(batch_fn(s))
        b.inner_step(batch_fn(s))
    assert a.make_contribution().payload == b.make_contribution().payload


def test_a_validators_kept_states_spill_to_disk_and_read_back_bit_identically(
    tokens, tmp_path
) -> None:
    """A validator keeps every commitment's local state for a dispute's
    evidence (weights + AdamW moments: 1.5 GB each at 124M). On disk they read back with
    the same bytes; the re-execution is the same; the previous end state handed over is
    emptied once loaded; a layout of the local state makes no zeros."""
    cfg = DiLoCoConfig(inner_steps=STEPS, inner_state="keep", codec="fp32")
    a = make(cfg)
    start = a.init_state()
    a.begin_round(start)
    for step in range(STEPS):
        a.inner_step(batches(tokens)(step))
    a.make_contribution()
    prev = a.local_state()
    points = range(len(commitment_steps(STEPS, K)))
    kept = reexecute(make(cfg), start, batches(tokens, r=1), STEPS, K, points, dict(prev))
    given = dict(prev)
    spilled = reexecute(
        make(cfg), start, batches(tokens, r=1), STEPS, K, points, given,
        spill_dir=tmp_path, consume_previous_end=True,
    )  # fmt: skip
    assert given == {}  # handed over and let go
    assert isinstance(spilled.states, SpilledStates) and sorted(spilled.states) == list(points)
    assert spilled.payload == kept.payload and spilled.commitments == kept.commitments
    assert spilled.end == kept.end
    for i in points:
        assert local_state_to_bytes(spilled.states[i]) == local_state_to_bytes(kept.states[i])
    assert len(list(tmp_path.iterdir())) == len(points)
    # any dtype and shape reads back (numpy has no bfloat16), and a short file is an error
    odd = {
        "bf16": torch.randn(3, 4).bfloat16(),
        "scalar": torch.tensor(2.5),
        "ids": torch.arange(5),
    }
    other = SpilledStates(tmp_path / "odd", odd)
    (tmp_path / "odd").mkdir()
    other.put(0, odd)
    assert all(torch.equal(other[0][k], v) and other[0][k].dtype == v.dtype for k, v in odd.items())
    (tmp_path / "odd" / "state-0.bin").write_bytes(b"short")
    with pytest.raises(ValueError, match="truncated"):
        other[0]
    # a fetched local state is parsed from its file, never bytes and tensors at once
    (tmp_path / "prev.safetensors").write_bytes(local_state_to_bytes(prev))
    parsed = local_state_from_file(tmp_path / "prev.safetensors", make(cfg).local_state_layout())
    assert local_state_to_bytes(parsed) == local_state_to_bytes(prev)
    (tmp_path / "bad").write_bytes(b"\x08" + b"\0" * 7 + b"not json")
    with pytest.raises(ValueError, match="not a safetensors local state"):
        local_state_from_file(tmp_path / "bad", make(cfg).local_state_layout())
    fresh = make(cfg)  # no optimizer state yet: the layout is shapes, not zeros
    layout = fresh.local_state_layout()
    assert {k: (v.shape, v.dtype) for k, v in layout.items()} == {
        k: (v.shape, v.dtype) for k, v in prev.items()
    }
    assert all(v.device.type == "meta" for v in layout.values())
    assert not fresh.inner_opt.state  # nothing was created to stand in


def test_local_state_names_and_fresh_optimizer(tokens) -> None:
    s = make(RESET)
    s.load_state(s.init_state())
    before = s.local_state()
    names = {n for n, _ in s.model.named_parameters()}
    assert {k for k in before if k.startswith("param/")} == {f"param/{n}" for n in names}
    assert {k.rsplit("/", 1)[-1] for k in before if k.startswith("optim/")} == {
        "step",
        "exp_avg",
        "exp_avg_sq",
    }
    assert all(float(t.abs().sum()) == 0 for k, t in before.items() if k.startswith("optim/"))
    s.inner_step(batches(tokens)(0))
    after = s.local_state()
    assert set(after) == set(before)  # the layout does not depend on what happened
    assert float(after[f"optim/{sorted(names)[0]}/step"]) == 1.0
    after[f"param/{sorted(names)[0]}"].add_(1.0)  # a copy: the model is untouched
    assert state_hash(s.local_state()) != state_hash(after)


def test_load_local_state_names_what_is_wrong(tokens) -> None:
    s = make(RESET)
    s.load_state(s.init_state())
    good = s.local_state()
    name = sorted(good)[0]
    snapshot = state_hash(s.local_state())
    with pytest.raises(ValueError, match="lacks"):
        s.load_local_state({k: v for k, v in good.items() if k != name})
    with pytest.raises(ValueError, match="unexpected entry 'param/extra'"):
        s.load_local_state({**good, "param/extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=f"{name}.*expected"):
        s.load_local_state({**good, name: torch.zeros(3, 3, 3)})
    with pytest.raises(ValueError, match="NaN or Inf"):
        s.load_local_state({**good, name: torch.full_like(good[name], math.nan)})
    assert state_hash(s.local_state()) == snapshot  # nothing changed
    template = s.local_state(copy=False)
    with pytest.raises(ValueError, match="not a safetensors"):
        local_state_from_bytes(pickle.dumps(good), template)
    with pytest.raises(ValueError, match="not a safetensors"):
        local_state_from_bytes(b"\x00" * 3, template)
    other = make(DDPConfig()).local_state()  # params only: the optimizer entries are missing
    with pytest.raises(ValueError, match="lacks 'optim/"):
        local_state_from_bytes(local_state_to_bytes(other), template)
    bad = {**good, name: good[name].double()}
    with pytest.raises(ValueError, match=f"{name}.*float64"):
        local_state_from_bytes(local_state_to_bytes(bad), template)


@pytest.mark.parametrize("mode", ["keep", "reset"])
def test_inner_state_keep_carries_moments_and_reset_starts_fresh(mode, tokens) -> None:
    cfg = RESET.model_copy(update={"inner_state": mode, "inner_steps": 3})
    a, b = make(cfg), make(cfg)
    state = a.init_state()
    a.load_state(state)
    for s in range(3):
        a.inner_step(batches(tokens)(s))
    state = a.apply_round(state, [a.make_contribution()])
    a.adopt(state)
    b.load_state(state)  # a newcomer at round 1: fresh inner optimizer
    assert isinstance(a, DiLoCo)
    steps = {float(st["step"]) for st in a.inner_opt.state.values()}
    assert steps == ({3.0} if mode == "keep" else set())
    payloads = []
    for w in (a, b):
        for s in range(3):
            w.inner_step(batches(tokens, r=1)(s))
        payloads.append(w.make_contribution().payload)
    assert (payloads[0] == payloads[1]) == (mode == "reset")


# -- sketches, commitments, structure ------------------------------------------------------


def test_distance_and_sketch() -> None:
    g = torch.Generator().manual_seed(0)
    a, noise = torch.randn(10_000, generator=g), torch.randn(10_000, generator=g)
    assert distance(a, a) == 0 and distance(torch.zeros(5), torch.zeros(5)) == 0
    assert distance(a, torch.zeros_like(a)) == 1
    assert distance(a, -a) == pytest.approx(2)
    assert distance(a, 100 * a) == pytest.approx(0.99)
    assert distance(a, torch.full_like(a, math.nan)) == math.inf
    with pytest.raises(ValueError, match="elements"):
        distance(a, a[:5])
    assert torch.equal(sketch(a), sketch(a.clone())) and sketch(a).shape == (64,)
    assert torch.allclose(sketch(a + noise), sketch(a) + sketch(noise), atol=1e-9)  # linear
    for scale in (0.01, 0.3, 1.0):  # relative distances survive the 64 numbers, roughly
        b = a + scale * noise
        assert distance(sketch(a), sketch(b)) == pytest.approx(distance(a, b), rel=0.5)


def test_commitment_round_trips_and_rejects_garbage(tokens) -> None:
    s = make(RESET)
    claimed, _ = work(s, s.init_state(), batches(tokens), 4, 2)
    c = claimed[1]
    assert Commitment.from_dict(c.to_dict()) == c
    assert len(c.sketch["params"]) == 64 and len(c.sketch["optim"]) == 2 * 64
    good = c.to_dict()
    for bad in (
        [],
        {**good, "extra": 1},
        {**good, "step": -1},
        {**good, "step": True},
        {**good, "hash": "xyz"},
        {**good, "sketch": {"params": [1.0]}},
        {**good, "sketch": {"params": ["a"], "optim": []}},
        {**good, "sketch": {"params": [math.nan], "optim": []}},
    ):
        with pytest.raises(ValueError):
            Commitment.from_dict(bad)


@pytest.mark.parametrize(
    ("steps", "k", "points"), [(10, 3, [0, 3, 6, 9]), (6, 3, [0, 3]), (2, 5, [0]), (1, 1, [0])]
)
def test_segments_are_defined_for_any_steps_and_k(steps, k, points, tokens) -> None:
    assert commitment_steps(steps, k) == points
    assert segment_bounds(len(points) - 1, steps, k)[1] == steps
    with pytest.raises(ValueError):
        segment_bounds(len(points), steps, k)
    s = make(RESET)
    claimed, _ = work(s, s.init_state(), batches(tokens), steps, k)
    assert [c.step for c in claimed] == points  # none at the final step: the payload is it


def test_committer_needs_every_step(tokens) -> None:
    s = make(RESET)
    s.load_state(s.init_state())
    c = Committer(s, s.init_state(), 2)
    assert c.commitments == [] and len(c.recorded) == 1
    s.inner_step(batches(tokens)(0))
    with pytest.raises(ValueError, match="after every inner step"):
        c.after_step(2)


def test_bisect_finds_a_diverging_segment() -> None:
    for n in range(2, 12):
        for first_bad in range(1, n):
            assert bisect(lambda i, f=first_bad: i < f, n) == first_bad - 1
    # a lying middle commitment whose later points agree again
    assert bisect(lambda i: i != 2, 5) == 1
    with pytest.raises(ValueError, match="every point agrees"):
        bisect(lambda i: True, 4)


def structural_claims(honest: Reexecution, s: Strategy) -> list[tuple[str, list, bytes]]:
    c = honest.commitments
    shifted = Commitment(c[1].step + 1, c[1].hash, c[1].sketch)
    short = Commitment(c[1].step, c[1].hash, {"params": (0.0,) * 3, "optim": c[1].sketch["optim"]})
    nan = Commitment(c[1].step, c[1].hash, {**c[1].sketch, "params": (math.nan,) * 64})
    not_start = Commitment(0, "0" * 64, c[0].sketch)
    p = honest.payload
    int4 = make(RESET.model_copy(update={"codec": "int4"})).codec.encode(torch.zeros(numel(s)))
    nan_payload = p[:-4] + struct.pack("<f", math.nan)
    return [
        ("commitments; a round", c[:-1], p),
        ("commitment 1 is at step", [c[0], shifted, *c[2:]], p),
        ("sketch lengths", [c[0], short, *c[2:]], p),
        ("NaN or Inf", [c[0], nan, *c[2:]], p),
        ("is a dict", [c[0], c[1].to_dict(), *c[2:]], p),
        (
            "lists of numbers",
            [c[0], Commitment(3, c[1].hash, {"params": 5, "optim": ()}), *c[2:]],
            p,
        ),
        ("must be a list", None, p),
        ("not the round's start", [not_start, *c[1:]], p),
        ("payload rejected", c, p[:-4]),
        ("payload rejected", c, b"garbage"),
        ("payload rejected", c, int4),
        ("payload", c, nan_payload),
    ]


def test_structurally_wrong_claims_are_rejected_at_segment_0(tokens) -> None:
    s = make(RESET)
    start = s.init_state()
    honest = reexecute(s, start, batches(tokens), STEPS, K)
    for expected, commitments, payload in structural_claims(honest, s):
        v = compare(commitments, payload, honest, s.codec, numel(s), TOL)
        assert not v.agree and v.segment == 0 and v.distance == math.inf, expected
        assert expected in v.detail, (expected, v.detail)


# -- honest work, cheats, disputes ---------------------------------------------------------


@pytest.mark.parametrize("setup", SETUPS)
def test_honest_reexecution_is_exact_on_the_same_threads(setup, tokens) -> None:
    cfg, steps = SETUPS[setup]
    worker, validator = make(cfg), make(cfg)
    start = worker.init_state()
    claimed, payload = work(worker, start, batches(tokens), steps, K)
    mine = reexecute(validator, start, batches(tokens), steps, K)
    v = compare(claimed, payload, mine, validator.codec, numel(validator), TOL)
    assert v.agree and v.exact and v.distance == 0 and v.segment is None
    assert len(v.distances) == len(commitment_steps(steps, K)) + 1


def expected_segment(kind: str, steps: int) -> int:
    if steps == 1 or kind == "wrong_data":
        return 0  # the first commitment after the start already differs
    if kind == "lazy":
        return (steps // 2) // K  # the segment holding the first skipped step
    return len(commitment_steps(steps, K)) - 1  # payload-only: the last segment


def dispute(setup: str, kind: str, tokens: torch.Tensor):
    cfg, steps = SETUPS[setup]
    worker, validator = make(cfg), make(cfg)
    start = worker.init_state()
    batch_fn = batches(tokens)
    claimed, payload = cheat_claim(
        kind, worker, start, batch_fn, steps, K, wrong_batch_fn=batches(tokens, key="peer-9")
    )
    n_points = len(commitment_steps(steps, K))
    mine = reexecute(validator, start, batch_fn, steps, K, keep_states=range(n_points))
    return cfg, steps, start, batch_fn, claimed, payload, mine, validator


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("kind", CHEATS)
def test_each_cheat_is_caught_located_and_judged_fraud(setup, kind, tokens) -> None:
    cfg, steps, start, batch_fn, claimed, payload, mine, validator = dispute(setup, kind, tokens)
    n = numel(validator)
    v = compare(claimed, payload, mine, validator.codec, n, TOL)
    assert not v.agree and v.distance > 10 * TOL
    assert v.segment == expected_segment(kind, steps), v.detail
    seg = v.segment
    result = referee(
        make(cfg, seed=5),
        start,
        seg,
        mine.states.get(seg) if seg else None,
        batch_fn,
        steps,
        K,
        validator.codec,
        claimed_start=claimed[seg],
        tolerance=TOL,
    )
    worker_end = segment_end(claimed, payload, seg, validator.codec, n)
    validator_end = segment_end(mine.commitments, mine.payload, seg, validator.codec, n)
    j = judge(result, worker_end, validator_end, TOL)
    assert j.outcome == "fraud", j.detail


def test_a_lying_validator_is_found_wrong(tokens) -> None:
    cfg, steps = SETUPS["diloco-fp32"]
    worker, validator = make(cfg), make(cfg)
    start = worker.init_state()
    batch_fn = batches(tokens)
    claimed, payload = work(worker, start, batch_fn, steps, K)
    honest = reexecute(validator, start, batch_fn, steps, K, keep_states=range(4))
    n = numel(validator)
    flipped = validator.codec.encode(-validator.codec.decode(honest.payload))
    lies = {
        "payload": Reexecution(flipped, honest.commitments, honest.states, steps, K),
        "commitment": Reexecution(
            honest.payload,
            [*honest.commitments[:2], *claimed_by_other_data(tokens, start)[2:]],
            honest.states,
            steps,
            K,
        ),
    }
    for what, fake in lies.items():
        v = compare(claimed, payload, fake, validator.codec, n, TOL)
        assert not v.agree, what
        seg = v.segment
        assert seg == (3 if what == "payload" else 1), (what, v.detail)
        result = referee(
            make(cfg, seed=5),
            start,
            seg,
            honest.states.get(seg) if seg else None,
            batch_fn,
            steps,
            K,
            claimed_start=claimed[seg],
            tolerance=TOL,
        )
        j = judge(
            result,
            segment_end(claimed, payload, seg, validator.codec, n),
            segment_end(fake.commitments, fake.payload, seg, validator.codec, n),
            TOL,
        )
        assert j.outcome == "validator wrong", (what, j.detail)


def claimed_by_other_data(tokens: torch.Tensor, start: TrainState) -> list[Commitment]:
    return reexecute(make(RESET), start, batches(tokens, key="peer-7"), STEPS, K).commitments


def test_a_made_up_segment_start_cannot_frame_a_worker(tokens) -> None:
    """An honest worker; a validator claims the last segment diverges and hands the referee
    a doctored state for its start: the referee ignores it, recomputes the prefix from W_r,
    and backs the worker."""
    cfg, steps = SETUPS["diloco-fp32"]
    worker, validator = make(cfg), make(cfg)
    start = worker.init_state()
    batch_fn = batches(tokens)
    claimed, payload = work(worker, start, batch_fn, steps, K)
    honest = reexecute(validator, start, batch_fn, steps, K, keep_states=[3])
    real = honest.states[3]
    shifted = {k: (v * 1.5 if k.startswith("param/") else v) for k, v in real.items()}
    moments = {k: (v * 3 if k.endswith("exp_avg_sq") else v) for k, v in real.items()}
    broken = {k: v for k, v in real.items() if not k.endswith("exp_avg")}
    flipped = -validator.codec.decode(honest.payload)
    for what, made_up in {"params": shifted, "moments": moments, "layout": broken}.items():
        result = referee(
            make(cfg, seed=5),
            start,
            3,
            made_up,
            batch_fn,
            steps,
            K,
            claimed_start=claimed[3],
            tolerance=TOL,
        )
        assert result.end is not None and "recomputed" in result.detail, what
        j = judge(result, validator.codec.decode(payload), flipped, TOL)
        assert j.outcome == "validator wrong", (what, j.detail)
    with pytest.raises(ValueError, match="needs the worker's commitment"):
        referee(make(cfg), start, 3, real, batch_fn, steps, K)
    # the genuine state is used as it is where the worker's commitment carries its hash (as
    # older workers' did); an intermediate commitment carries none: the prefix is recomputed
    hashed = dataclasses.replace(claimed[3], hash=state_hash(real))
    result = referee(make(cfg), start, 3, real, batch_fn, steps, K, claimed_start=hashed)
    assert result.end is not None and result.detail == ""
    assert judge(result, validator.codec.decode(payload), flipped, TOL).outcome == "validator wrong"
    assert claimed[3].hash == NO_HASH
    result = referee(make(cfg), start, 3, real, batch_fn, steps, K, claimed_start=claimed[3])
    assert result.end is not None and "carries no hash" in result.detail
    assert "recomputed steps 0..8" in result.detail
    assert judge(result, validator.codec.decode(payload), flipped, TOL).outcome == "validator wrong"


def sketch_null_space(state: dict[str, torch.Tensor], size: float) -> dict[str, torch.Tensor]:
    """`state` moved by a vector of l2 norm ~`size` x its parameters' norm that every count
    sketch of the parameters maps to 0: the sketch's hashing is public, so anyone can."""
    names = sorted(k for k in state if k.startswith("param/"))
    n = sum(state[k].numel() for k in names)
    index, sign = _hashing(n, BUCKETS)
    z = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # project out the sketch: rows of S are disjoint +-1 indicators, so S S^T is diagonal
    counts = torch.zeros(BUCKETS, dtype=torch.float64).index_add_(0, index, torch.ones(n).double())
    s = torch.zeros(BUCKETS, dtype=torch.float64).index_add_(0, index, z * sign)
    z = z - sign * (s / counts)[index]
    norm = math.sqrt(sum(float(state[k].double().pow(2).sum()) for k in names))
    z = z * (size * norm / float(z.norm()))
    out, at = dict(state), 0
    for k in names:
        t = state[k]
        out[k] = t + z[at : at + t.numel()].reshape(t.shape).to(t.dtype)
        at += t.numel()
    return out


def test_a_sketch_equal_crafted_state_no_longer_convicts(tokens) -> None:
    """A validator crafts a segment-start state in the count sketch's null space: its
    sketch equals the honest worker's commitment (distance ~0, within tolerance), its
    content does not. It computes its own segment end from there and disputes. The old
    referee accepted the state on its sketch and found the worker far from it: fraud. Now
    the state's hash differs from the commitment, so the referee recomputes from W_r."""
    cfg, steps = SETUPS["diloco-fp32"]
    worker, validator = make(cfg), make(cfg)
    start = worker.init_state()
    batch_fn = batches(tokens)
    claimed, payload = work(worker, start, batch_fn, steps, K)
    honest = reexecute(validator, start, batch_fn, steps, K, keep_states=[3])
    crafted = sketch_null_space(honest.states[3], 0.05)
    theirs = commitment_of(crafted, start.params, 9)
    assert state_hash(crafted) != state_hash(honest.states[3])
    assert commitment_distance(theirs, claimed[3]) < TOL / 10  # the sketch cannot tell
    # the validator's claimed end: the last segment run from its crafted state
    validator.load_state(start)
    validator.load_local_state(crafted)
    validator.inner_step(batch_fn(9))
    framed_end = validator.codec.decode(validator.make_contribution().payload)
    worker_end = validator.codec.decode(payload)
    assert distance(worker_end, framed_end) > 10 * TOL  # a real disagreement to judge
    # a worker's commitment with its state's hash (as older workers sent), and without
    hashed = dataclasses.replace(claimed[3], hash=state_hash(honest.states[3]))
    for claimed_start, why in ((hashed, "does not hash"), (claimed[3], "carries no hash")):
        result = referee(
            make(cfg, seed=5), start, 3, crafted, batch_fn, steps, K,
            claimed_start=claimed_start, tolerance=TOL,
        )  # fmt: skip
        j = judge(result, worker_end, framed_end, TOL)
        assert j.outcome == "validator wrong", j.detail  # the old referee said "fraud"
        assert why in result.detail


def test_segment_0_and_prefix_recompute_need_no_blob(tokens) -> None:
    cfg, steps = SETUPS["diloco-fp32"]
    worker = make(cfg)
    start = worker.init_state()
    claimed, _ = work(worker, start, batches(tokens), steps, K)
    for seg in (0, 2):  # 2: recomputes segments 0 and 1 first
        result = referee(make(cfg), start, seg, None, batches(tokens), steps, K)
        assert isinstance(result.end, Commitment) and result.end.hash == NO_HASH
        assert result.end.sketch == claimed[seg + 1].sketch  # the same bits, one process


def test_an_unstable_segment_does_not_convict_an_honest_worker(tokens) -> None:
    """At a high learning rate, rounding-level differences between the worker's machine and
    the validator's (emulated: a 1e-7 nudge after step 0) grow past the tolerance. The
    referee, bit-identical to the validator, would call that fraud; its stability probe
    sees the segment amplify noise and makes it inconclusive."""
    cfg = DiLoCoConfig(inner_steps=STEPS, inner_state="reset", optim=InnerOptim(lr=0.3))
    worker, validator = make(cfg), make(cfg)
    start = worker.init_state()
    batch_fn = batches(tokens)
    worker.load_state(start)
    committer = Committer(worker, start, K)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-7 * p.abs().mean())
    for step in range(STEPS):
        worker.inner_step(batch_fn(step))
        committer.after_step(step + 1)
    claimed, payload = committer.commitments, worker.make_contribution().payload
    mine = reexecute(validator, start, batch_fn, STEPS, K, keep_states=range(4))
    n = numel(validator)
    v = compare(claimed, payload, mine, validator.codec, n, TOL)
    assert not v.agree and v.segment is not None
    seg = v.segment
    ends = (
        segment_end(claimed, payload, seg, validator.codec, n),
        segment_end(mine.commitments, mine.payload, seg, validator.codec, n),
    )
    outcomes = {}
    for probe in (False, True):
        result = referee(
            make(cfg),
            start,
            seg,
            mine.states.get(seg) if seg else None,
            batch_fn,
            STEPS,
            K,
            claimed_start=claimed[seg],
            tolerance=TOL,
            probe=probe,
        )
        outcomes[probe] = judge(result, *ends, TOL)
    assert outcomes[False].outcome == "fraud"  # what a referee without the probe would say
    assert outcomes[True].outcome == "inconclusive", outcomes[True].detail
    assert "numerically unstable" in outcomes[True].detail


# -- the adversaries' forged payloads -------------------------------------------------------


@pytest.mark.parametrize("form", ["fp32", "fp16", "bf16", "int8", "int4", "topk:0.1", "sign"])
def test_forged_payloads_are_what_their_behavior_says(form: str) -> None:
    codec = get_codec(form)
    honest_update = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    payload = codec.encode(honest_update)
    honest = codec.decode(payload, 1000)

    def forged(behavior: str) -> torch.Tensor:
        return codec.decode(forge_payload(behavior, payload, codec, 1000, seed=7), 1000)

    assert torch.equal(forged("free-rider"), torch.zeros(1000))
    if form in ("fp32", "fp16", "bf16"):  # exact enough to check the arithmetic
        assert torch.allclose(forged("sign-flip"), -honest)
        assert torch.allclose(forged("scaled"), honest * 100, rtol=1e-2)
        noise = forged("noise")
        assert math.isclose(float(noise.norm()), float(honest.norm()), rel_tol=1e-2)
        assert abs(float(torch.dot(noise, honest))) < 0.2 * float(honest.norm()) ** 2
    # a NaN payload has the codec's exact size, and every decoder refuses it
    nan = forge_payload("nan", payload, codec, 1000, seed=7)
    assert len(nan) == codec.nbytes(1000)
    with pytest.raises(CodecError):
        codec.decode(nan, 1000)
