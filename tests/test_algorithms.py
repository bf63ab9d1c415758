"""Algorithm equivalences and invariants, in one process (no network)."""

from __future__ import annotations

import copy

import pytest
import torch

from covey.algorithms import DeMo, DiLoCo, RoundError, StreamingDiLoCo, build_strategy
from covey.algorithms.base import Strategy
from covey.algorithms.optim import adamw, nesterov_sgd
from covey.algorithms.state import Contribution, TrainState
from covey.algorithms.streaming import layer_key, strided_fragments
from covey.algorithms.tensors import flatten
from covey.config import DDPConfig, DeMoConfig, DiLoCoConfig, InnerOptim, StreamingDiLoCoConfig
from covey.data.batches import sample_batch
from covey.models.gpt import lm_loss
from tests.conftest import tiny_gpt

SGD = InnerOptim(name="sgd", lr=0.05, grad_clip=0.0)
ADAMW = InnerOptim(name="adamw", lr=1e-3, grad_clip=0.0)


def batch(tokens: torch.Tensor, r: int, w: int, s: int, bs: int = 4) -> torch.Tensor:
    return sample_batch(tokens, batch_size=bs, seq_len=16, seed=7, round=r, worker=w, step=s)


def run_rounds(make: callable, tokens: torch.Tensor, n_workers: int, rounds: int) -> TrainState:
    """Drive strategies through the round interface, as the simulator and peers do."""
    base = tiny_gpt()
    workers: list[Strategy] = [make(copy.deepcopy(base)) for _ in range(n_workers)]
    state = workers[0].init_state()
    for w in workers:
        w.load_state(state)
    for r in range(rounds):
        contributions = []
        for i, w in enumerate(workers):
            for s in range(w.steps_per_round):
                w.inner_step(batch(tokens, r, i, s))
            contributions.append(w.make_contribution())
        state = workers[0].apply_round(state, contributions)
        for w in workers:
            w.adopt(state)
    return state


def max_diff(a: TrainState, b: TrainState) -> float:
    return max(float((a.params[n] - b.params[n]).abs().max()) for n in a.params)


def test_diloco_h1_outer_sgd_lr1_equals_ddp_sgd(tokens: torch.Tensor) -> None:
    """DiLoCo with H=1, outer SGD(lr 1, no momentum) over inner SGD is exactly DDP with SGD:
    the pseudo-gradient is lr * g, so the outer step is start - mean(lr * g)."""
    diloco = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, optim=SGD)
    ddp = DDPConfig(optim=SGD)
    a = run_rounds(lambda m: build_strategy(diloco, m, lm_loss), tokens, 3, 5)
    b = run_rounds(lambda m: build_strategy(ddp, m, lm_loss), tokens, 3, 5)
    init = tiny_gpt().state_dict()
    moved = max(float((b.params[n] - init[n]).abs().max()) for n in b.params)
    assert moved > 1e-2  # both really trained
    assert max_diff(a, b) < 1e-6


def naive_diloco(tokens: torch.Tensor, n_workers: int, rounds: int, h: int) -> dict:
    """A deliberately plain DiLoCo: torch.optim replicas, raw pseudo-gradients, no codec,
    torch.optim.SGD(nesterov) as the outer optimizer."""
    global_model = tiny_gpt()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    replicas = [copy.deepcopy(global_model) for _ in range(n_workers)]
    inner = [
        torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
        for m in replicas
    ]
    for r in range(rounds):
        deltas = []
        for i, (m, opt) in enumerate(zip(replicas, inner, strict=True)):
            m.load_state_dict(global_model.state_dict())
            for s in range(h):
                opt.zero_grad()
                lm_loss(m, batch(tokens, r, i, s)).backward()
                opt.step()
            deltas.append(
                [
                    g.detach() - p.detach()
                    for g, p in zip(global_model.parameters(), m.parameters(), strict=True)
                ]
            )
        for k, p in enumerate(global_model.parameters()):
            p.grad = sum(d[k] for d in deltas) / n_workers
        outer.step()
    return {n: p.detach() for n, p in global_model.named_parameters()}


def test_diloco_lossless_codec_equals_uncompressed(tokens: torch.Tensor) -> None:
    cfg = DiLoCoConfig(inner_steps=4, optim=ADAMW, codec="fp32")
    state = run_rounds(lambda m: build_strategy(cfg, m, lm_loss), tokens, 3, 3)
    reference = naive_diloco(tokens, 3, 3, 4)
    diff = max(float((state.params[n] - reference[n]).abs().max()) for n in reference)
    assert diff < 1e-5  # float32 rounding: the two sum the pseudo-gradients in other orders
    # and a lossy codec really is different, so the comparison can fail
    lossy = DiLoCoConfig(inner_steps=4, optim=ADAMW, codec="int4")
    other = run_rounds(lambda m: build_strategy(lossy, m, lm_loss), tokens, 3, 3)
    assert max(float((other.params[n] - reference[n]).abs().max()) for n in reference) > 1e-4


def test_error_feedback_keeps_what_the_codec_dropped(tokens: torch.Tensor) -> None:
    cfg = DiLoCoConfig(inner_steps=3, optim=ADAMW, codec="dct:64:4:fp16", error_feedback=True)
    w = build_strategy(cfg, tiny_gpt(), lm_loss)
    assert isinstance(w, DiLoCo)
    w.load_state(w.init_state())
    for s in range(3):
        w.inner_step(batch(tokens, 0, 0, s))
    delta = w.pseudo_gradient()
    c = w.make_contribution()
    sent = w.codec.decode(c.payload)
    assert torch.allclose(sent + w._pending, delta, atol=1e-7)
    assert float(w._pending.abs().max()) > 0  # the codec is lossy: something was kept back
    assert float(w._residual.abs().max()) == 0  # not before the certificate accepted it
    pending = w._pending.clone()
    w.adopt(w.apply_round(w.init_state(), [c]))
    assert torch.equal(w._residual, pending)


@pytest.mark.parametrize("accepted", [True, False])
def test_error_feedback_advances_only_when_accepted(accepted: bool, tokens: torch.Tensor) -> None:
    """A rejected contribution's residual is restored: its bytes never reached the model."""
    cfg = DiLoCoConfig(inner_steps=2, optim=ADAMW, codec="int4", error_feedback=True)
    w = build_strategy(cfg, tiny_gpt(), lm_loss)
    assert isinstance(w, DiLoCo)
    state = w.init_state()
    w.load_state(state)
    for r in range(2):
        before = w._residual.clone()
        for s in range(2):
            w.inner_step(batch(tokens, r, 0, s))
        c = w.make_contribution()
        pending = w._pending.clone()
        state = w.apply_round(state, [c])
        w.adopt(state, accepted=accepted)
        assert torch.equal(w._residual, pending if accepted else before)
        assert float(w._pending.abs().max()) == 0
    assert (float(w._residual.abs().max()) > 0) == accepted


@pytest.mark.parametrize("accepted", [True, False])
def test_demo_momentum_keeps_what_a_rejected_round_sent(accepted, tokens) -> None:
    w = build_strategy(DeMoConfig(topk=8), tiny_gpt(), lm_loss)
    assert isinstance(w, DeMo)
    state = w.init_state()
    w.load_state(state)
    w.inner_step(batch(tokens, 0, 0, 0))
    before = w.momentum.clone()
    c = w.make_contribution()
    w.adopt(w.apply_round(state, [c]), accepted=accepted)
    want = before - w.codec.decode(c.payload) if accepted else before
    assert torch.equal(w.momentum, want)


def test_demo_transmitted_plus_residual_equals_momentum(tokens: torch.Tensor) -> None:
    w = build_strategy(DeMoConfig(topk=8), tiny_gpt(), lm_loss)
    assert isinstance(w, DeMo)
    w.load_state(w.init_state())
    for step in range(3):
        w.inner_step(batch(tokens, step, 0, 0))
        before = w.momentum.clone()
        payload = w.make_contribution().payload
        transmitted = w.codec.decode(payload)
        w.adopt(w.init_state())  # the certificate took it: it leaves the momentum
        assert torch.allclose(transmitted + w.momentum, before, atol=1e-6)
        assert float(w.momentum.abs().max()) > 0 and float(transmitted.abs().max()) > 0


def test_demo_update_is_signed_sgd(tokens: torch.Tensor) -> None:
    cfg = DeMoConfig(lr=0.01, topk=8)
    workers = [build_strategy(cfg, tiny_gpt(), lm_loss) for _ in range(2)]
    state = workers[0].init_state()
    contribs = []
    for i, w in enumerate(workers):
        w.load_state(state)
        w.inner_step(batch(tokens, 0, i, 0))
        contribs.append(w.make_contribution())
    new = workers[0].apply_round(state, contribs)
    steps = torch.cat([(new.params[n] - state.params[n]).reshape(-1) for n in state.params])
    assert set(torch.unique((steps / 0.01).round()).tolist()) <= {-1.0, 0.0, 1.0}


def test_pure_optimizers_match_torch() -> None:
    torch.manual_seed(0)
    p0 = torch.randn(50)
    grads = [torch.randn(50) for _ in range(4)]
    ref = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    p, m, v = p0.clone(), torch.zeros(50), torch.zeros(50)
    for t, g in enumerate(grads, 1):
        ref.grad = g.clone()
        opt.step()
        p, m, v = adamw(p, g, m, v, t, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    assert torch.allclose(p, ref.detach(), atol=1e-6)

    ref = p0.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    p, buf = p0.clone(), None
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        p, buf = nesterov_sgd(p, g, buf, lr=0.7, momentum=0.9, nesterov=True)
    assert torch.allclose(p, ref.detach(), atol=1e-6)


@pytest.mark.parametrize(
    "cfg",
    [
        DDPConfig(),
        DiLoCoConfig(inner_steps=2),
        DeMoConfig(),
        StreamingDiLoCoConfig(inner_steps=4, fragments=2),
    ],
    ids=lambda c: c.method,
)
def test_apply_round_is_pure_and_rejects_bad_contributions(cfg, tokens: torch.Tensor) -> None:
    w = build_strategy(cfg, tiny_gpt(), lm_loss)
    state = w.init_state()
    w.load_state(state)
    digest = state.digest()
    for s in range(w.steps_per_round):
        w.inner_step(batch(tokens, 0, 0, s))
    good = w.make_contribution()
    bad = [
        [],
        [Contribution(good.payload[:-3], good.tokens, 1, good.fragment)],
        [Contribution(good.payload, 0, 1, good.fragment)],
        [Contribution(b"garbage", good.tokens, 1, good.fragment)],
    ]
    if isinstance(w, StreamingDiLoCo):
        bad.append([Contribution(good.payload, good.tokens, 1, fragment=1)])
    for contributions in bad:
        with pytest.raises(RoundError):
            w.apply_round(state, contributions)
    new = w.apply_round(state, [good])
    assert state.digest() == digest  # the start state was not mutated
    assert new.digest() != digest and new.round == state.round + 1


def test_streaming_fragments_are_strided_and_disjoint() -> None:
    names = [n for n, _ in tiny_gpt().named_parameters()]
    assert layer_key("blocks.3.attn.qkv.weight") == "blocks.3"
    assert layer_key("wte.weight") == "wte.weight"
    frags = strided_fragments(names, 2)
    assert sorted(n for f in frags for n in f) == sorted(names)
    assert any(n.startswith("blocks.0.") for n in frags[0])
    assert any(n.startswith("blocks.1.") for n in frags[1])
    with pytest.raises(ValueError, match="fewer than"):
        strided_fragments(names, 50)


def test_streaming_round_updates_only_its_fragment(tokens: torch.Tensor) -> None:
    cfg = StreamingDiLoCoConfig(inner_steps=4, fragments=2, overlap_steps=0, codec="fp32")
    w = build_strategy(cfg, tiny_gpt(), lm_loss)
    assert isinstance(w, StreamingDiLoCo)
    state = w.init_state()
    w.load_state(state)
    for s in range(w.steps_per_round):
        w.inner_step(batch(tokens, 0, 0, s))
    local_before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    new = w.apply_round(state, [w.make_contribution()])
    changed = {n for n in state.params if not torch.equal(state.params[n], new.params[n])}
    assert changed and changed <= set(w.fragments[0])
    w.adopt(new)
    for n, p in w.model.named_parameters():
        expected = (
            0.5 * local_before[n] + 0.5 * new.params[n] if n in w.fragments[0] else local_before[n]
        )
        assert torch.allclose(p.detach(), expected, atol=1e-7), n


def test_contribution_bytes_are_the_payload(tokens: torch.Tensor) -> None:
    """What the simulator reports as sent is len(payload): fp32 DiLoCo sends 4 bytes/param
    plus the codec header, int4 about 8x less."""
    model = tiny_gpt()
    n = sum(p.numel() for p in model.parameters())
    sizes = {}
    for codec in ("fp32", "int4"):
        w = build_strategy(DiLoCoConfig(inner_steps=1, codec=codec), copy.deepcopy(model), lm_loss)
        w.load_state(w.init_state())
        w.inner_step(batch(tokens, 0, 0, 0))
        sizes[codec] = w.make_contribution().nbytes
    assert 4 * n < sizes["fp32"] < 4 * n + 64
    assert 6 < sizes["fp32"] / sizes["int4"] < 8


def test_strategy_wraps_any_module_and_loss() -> None:
    """The library trains any nn.Module with a user loss, not only the reference GPT."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    target = torch.randn(4)

    def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return ((m(b).squeeze(-1) - b @ target) ** 2).mean()

    # outer lr 1 without momentum is plain model averaging (FedAvg): stable on a toy problem
    cfg = DiLoCoConfig(inner_steps=10, outer_lr=1.0, outer_momentum=0.0, optim=InnerOptim(lr=1e-2))
    workers = [build_strategy(cfg, copy.deepcopy(model), loss_fn) for _ in range(2)]
    state = workers[0].init_state()
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(256, 4, generator=g)
    first = float(loss_fn(model, probe).detach())
    for _ in range(10):
        contribs = []
        for w in workers:
            w.load_state(state)
            for _ in range(10):
                w.inner_step(torch.randn(32, 4, generator=g))
            contribs.append(w.make_contribution())
        state = workers[0].apply_round(state, contribs)
    workers[0].load_state(state)
    assert float(loss_fn(workers[0].model, probe).detach()) < 0.2 * first
    assert flatten(list(state.params.values())).isfinite().all()


@pytest.mark.parametrize(
    "cfg",
    [
        DDPConfig(),
        DiLoCoConfig(inner_steps=2, codec="int4", error_feedback=True),
        DeMoConfig(),
        StreamingDiLoCoConfig(inner_steps=4, fragments=2),
    ],
    ids=lambda c: c.method,
)
def test_contribution_without_work_is_refused_and_changes_nothing(cfg, tokens) -> None:
    w = build_strategy(cfg, tiny_gpt(), lm_loss)
    w.load_state(w.init_state())
    w.inner_step(batch(tokens, 0, 0, 0))
    for _ in range(w.steps_per_round - 1):
        w.inner_step(batch(tokens, 0, 0, 1))
    first = w.make_contribution()
    snapshot = {k: v.clone() for k, v in vars(w).items() if isinstance(v, torch.Tensor)}
    with pytest.raises(RuntimeError, match="before any inner_step"):
        w.make_contribution()
    for k, v in snapshot.items():
        assert torch.equal(getattr(w, k), v), k  # residual, momentum, ... untouched
    assert first.tokens > 0 and first.inner_steps == w.steps_per_round
