"""Devices for the RL and SWARM roles: their hot paths stay on the device.

As in tests/test_devices.py, the device is `meta` (shapes, no data): any tensor the hot
path makes on the host is recorded. Here the watch also records every copy from the device
to the host (returning zeros of its shape, since `meta` has no data): what crosses must be
what goes on the wire (token ids, a proof's top-k values), never per-vocabulary logits or
whole hidden states.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from covey.cli import app
from covey.models.gpt import GPT
from covey.rl import proofs, sampling
from covey.rl.learn import LearnConfig, Learner
from covey.swarm.config import SwarmConfig
from covey.swarm.wire import build_stage
from tests.conftest import TINY, tiny_gpt
from tests.test_devices import HostWatch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class WireWatch(HostWatch):
    """HostWatch that also lets device->host copies through (as zeros: `meta` has no data)
    and records their sizes in `to_host` (integers come back as distinct ids, e.g. top-k
    indices). While `exempt` is set nothing is recorded: the
    Gumbel noise is drawn on the host on purpose (see `test_noise_is_drawn_on_the_host_...`)."""

    def __init__(self) -> None:
        super().__init__()
        self.to_host: list[int] = []
        self.exempt = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if self.exempt:
            return func(*args, **kwargs)
        if (
            func is torch.ops.aten._to_copy.default
            and src is not None
            and src.device.type == "meta"
            and torch.device(kwargs.get("device", "meta")).type == "cpu"
        ):
            self.to_host.append(src.numel())
            dtype = kwargs.get("dtype") or src.dtype
            if dtype.is_floating_point or dtype == torch.bool:
                return torch.zeros(src.shape, dtype=dtype)
            return torch.arange(src.numel(), dtype=dtype).reshape(src.shape)  # distinct ids
        return super().__torch_dispatch__(func, types, args, kwargs)


def _meta_policy() -> GPT:
    with torch.device("meta"):
        return tiny_gpt().eval()


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> WireWatch:
    w = WireWatch()
    monkeypatch.setattr(sampling, "gumbel_noise", _exempt(w, sampling.gumbel_noise))
    # a decoding step's noise for every row: drawn on the host by design (the same tokens on
    # any device), stacked there and moved to the device in one copy
    monkeypatch.setattr(sampling, "_step_noise", _exempt(w, sampling._step_noise))
    return w


def _exempt(w: WireWatch, fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        was, w.exempt = w.exempt, True  # nested exempt calls leave it as they found it
        try:
            return fn(*args, **kwargs)
        finally:
            w.exempt = was

    return run


# -- RL: generate, prove, learn --------------------------------------------------------------


def test_rl_generate_and_prove_stay_on_the_device(watch: WireWatch) -> None:
    """A worker's step on a device: sampling (logits, noise added, argmax, logprobs) and
    the proof's top-k run there; only token ids and each chunk's k committed values (with
    their indices) come to the host."""
    model = _meta_policy()
    new = 5
    with watch:
        gens = sampling.generate_batch(model, [[1, 2, 3], [4, 5]], new, 1.0, [7, 8])
        proof = proofs.build_proof(gens[0].hidden)
    assert watch.host == [], watch.host[:5]
    assert all(g.hidden.device.type == "meta" and g.logprobs.device.type == "meta" for g in gens)
    assert [len(g.tokens) for g in gens] == [new, new]
    assert len(proof) == proofs.proof_size(new, TINY.n_embd)
    # nothing the size of a vocabulary row or a hidden state crossed
    assert watch.to_host and max(watch.to_host) <= proofs.TOPK, watch.to_host


def test_a_logits_row_copied_to_the_host_is_caught(watch: WireWatch) -> None:
    """The check can fail: sampling from a host copy of the logits is seen."""
    with watch:
        logits = torch.zeros(4, TINY.vocab_size, device="meta")
        _ = logits[0].cpu()
    assert watch.to_host == [TINY.vocab_size]


def test_rl_learn_step_stays_on_the_device(watch: WireWatch) -> None:
    """The trainer's learning step on a device: ids, targets, masks, old logprobs,
    the loss, gradients and AdamW's moments live there; the host holds only per-sample
    bookkeeping taken from the batch (rewards, advantages: one number a sample)."""
    from covey.rl.batch import RolloutBatch, Sample
    from covey.rl.tasks import ArithmeticTask

    task = ArithmeticTask(max_operand=9)
    policy = _meta_policy()
    learner = Learner(policy, LearnConfig(), task)
    samples = [
        Sample(tokens=[65 + j] * 6, logprobs=[-1.0] * 6, reward=float(j % 2), proof="")
        for j in range(4)
    ]
    batch = RolloutBatch(
        run_id="r",
        step=0,
        policy_version=0,
        policy_cid="c",
        worker_id="w",
        prompt_indices=[0, 1],
        group_size=2,
        samples=samples,
    )
    with watch:
        stats = learner.step([(batch, 0)], 0)
    assert stats["updated"] == 1.0
    per_token = [s for s in watch.host if _numel(s) > len(samples)]  # more than 1 a sample
    assert per_token == [], per_token[:5]
    assert all(p.device.type == "meta" for p in policy.parameters())
    moments = [v for st in learner.optimizer.state.values() for v in st.values() if v.dim()]
    assert moments and all(v.device.type == "meta" for v in moments)


def _numel(record: str) -> int:
    """The element count of a HostWatch record "op -> (2, 3)"."""
    shape = record.rsplit("-> ", 1)[1].strip("()").split(",")
    return int(torch.Size([int(d) for d in shape if d.strip()]).numel())


def test_noise_is_drawn_on_the_host_and_moved() -> None:
    """Seeded Gumbel noise is the same numbers on every device: drawn from a CPU
    torch.Generator (CUDA's generator is another stream) and then moved."""
    here = sampling.gumbel_noise(11, 3, 50)
    assert torch.equal(sampling.gumbel_noise(11, 3, 50, "cpu"), here)
    assert sampling.gumbel_noise(11, 3, 50, "meta").device.type == "meta"


@CUDA
def test_cuda_generation_picks_the_cpu_tokens_for_the_same_logits() -> None:
    logits = torch.randn(6, 256, generator=torch.Generator().manual_seed(2))
    for i, row in enumerate(logits):
        noise = sampling.gumbel_noise(5, i, 256)
        on_gpu = sampling.gumbel_noise(5, i, 256, "cuda")
        assert int(torch.argmax(row + noise)) == int(torch.argmax(row.cuda() + on_gpu))


@CUDA
def test_cuda_generation_matches_cpu_tokens() -> None:
    model = tiny_gpt().eval()
    cpu = sampling.generate_batch(model, [[1, 2, 3]], 8, 1.0, [3])[0]
    gpu = sampling.generate_batch(model.cuda(), [[1, 2, 3]], 8, 1.0, [3])[0]
    assert gpu.tokens == cpu.tokens
    assert torch.allclose(gpu.logprobs.cpu(), cpu.logprobs, atol=1e-4)


# -- SWARM: a stage's forward, backward and step ----------------------------------------------

SWARM = SwarmConfig(n_layer=2, n_embd=16, n_head=2, seq_len=8, stages=2, codec="plain")


@pytest.mark.parametrize("k", [0, 1])
def test_swarm_stage_forward_backward_step_stay_on_the_device(k: int) -> None:
    """A stage server on a device: forward, the recomputing backward (or the last stage's
    loss), the gradient accumulator and AdamW's step make nothing on the host."""
    stage = build_stage(SWARM, k, "meta")
    assert all(p.device.type == "meta" for p in stage.params)
    ids = torch.zeros(2, SWARM.seq_len, dtype=torch.long, device="meta")
    h = torch.zeros(2, SWARM.seq_len, SWARM.n_embd, device="meta")
    with HostWatch() as watch:
        if k == 0:
            out = stage.forward(ids)
            assert stage.backward(ids, torch.zeros_like(out)) is None
        else:
            stage.forward(h)
            _, grad = stage.backward_loss(h, ids)
            assert grad is not None and grad.device.type == "meta"
        stage.step()
    assert watch.host == [], watch.host[:5]
    moments = [v for st in stage.optimizer.state.values() for v in st.values() if v.dim()]
    assert moments and all(v.device.type == "meta" for v in moments)


def test_swarm_requests_cross_to_the_stage_device_and_back_as_bytes() -> None:
    """compute.forward/backward move the checked input to the stage's device and answer
    bytes; a stage built for "cpu" answers what the plain path answers."""
    from covey.swarm import compute
    from covey.swarm.wire import encode_tensor, pack, state_bytes

    stage = build_stage(SWARM, 0, "cpu")
    ids = torch.randint(0, 256, (2, SWARM.seq_len), generator=torch.Generator().manual_seed(1))
    reply = compute.forward(SWARM, 0, stage, pack(encode_tensor(ids, SWARM.codec)))
    out, _ = compute.parse_reply(reply)
    assert out is not None and out.shape == (2, SWARM.seq_len, SWARM.n_embd)
    assert torch.allclose(out, stage.forward(ids))
    assert state_bytes(stage)  # weights and moments serialize from wherever they live


# -- the command line ---------------------------------------------------------------------------

BAD = [
    ["rl", "trainer", "--data-dir", "x", "--device", "gpu"],
    ["rl", "worker", "--trainer", "http://127.0.0.1:9", "--device", "gpu"],
    ["rl", "validator", "--trainer", "http://127.0.0.1:9", "--device", "gpu"],
    ["rl", "demo", "--device", "gpu"],
    ["swarm", "server", "--coordinator", "http://127.0.0.1:9", "--device", "gpu"],
    ["swarm", "demo", "--device", "gpu"],
]


@pytest.mark.parametrize("args", BAD, ids=[" ".join(a[:2]) for a in BAD])
def test_a_bad_device_is_a_clear_error(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "error: --device" in result.output and "'gpu'" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_an_absent_device_and_a_bad_precision_are_clear_errors() -> None:
    result = CliRunner().invoke(app, ["rl", "trainer", "--data-dir", "x", "--device", "cuda:1"])
    assert result.exit_code == 2 and "'cuda:1': CUDA is not available" in result.output
    args = ["rl", "trainer", "--data-dir", "x", "--precision", "fp8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "--precision" in result.output and "'fp8'" in result.output
