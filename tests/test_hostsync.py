"""No device-to-host synchronization in any method's inner step (covey/bench/hostsync.py).

Without CUDA the strategies run on the meta device under HostSyncDetector, which raises at
the first op that needs a device tensor's values on the host; with CUDA the driver's own
check (`torch.cuda.set_sync_debug_mode("error")`) does the same on the real device.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import pytest
import torch

from covey.algorithms import build_strategy
from covey.algorithms.tensors import clip_grad_, host_sum
from covey.bench.hostsync import (
    METHODS,
    HostSyncDetector,
    HostSyncError,
    count_syncs,
    method_config,
    no_host_sync,
    run_hostsync_bench,
    run_inner_steps,
)
from covey.devices import synchronize
from covey.models.gpt import GPT, gpt_config, lm_loss

META = torch.device("meta")


def nano() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("nano"))


POOL = torch.randint(0, 256, (8, 2, 17), generator=torch.Generator().manual_seed(0))


def batch(i: int) -> torch.Tensor:
    return POOL[i % len(POOL)]


def checked(device: torch.device) -> contextlib.AbstractContextManager[None]:
    return no_host_sync(device)


@pytest.mark.parametrize("method", METHODS)
def test_inner_steps_make_no_host_sync(method: str) -> None:
    """Two rounds of every method, Streaming's merge inside a step included."""
    taken = run_inner_steps(method, nano(), batch, 2, lambda: checked(META), META)
    assert taken >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", METHODS)
def test_inner_steps_make_no_host_sync_on_cuda(method: str) -> None:
    cuda = torch.device("cuda")
    run_inner_steps(method, nano(), batch, 2, lambda: checked(cuda), cuda)
    loss = torch.ones((), device=cuda)
    with pytest.raises(RuntimeError, match="synchroniz"), checked(cuda):
        float(loss)  # the driver's check itself fails on a sync


def test_a_syncing_inner_step_is_caught_with_its_line() -> None:
    """The detector can fail: a strategy that reads its loss on the host is named."""
    s = build_strategy(method_config("diloco"), nano().to(META), lm_loss)
    with pytest.raises(HostSyncError) as e, checked(META):
        float(s.inner_step(batch(0)))
    assert "_local_scalar_dense" in str(e.value)
    assert "tests/test_hostsync.py" in str(e.value) and "float(s.inner_step" in str(e.value)


@pytest.mark.parametrize(
    "sync, op",
    [
        (lambda t: t.sum().item(), "_local_scalar_dense"),
        (lambda t: bool(t.sum() > 0), "_local_scalar_dense"),
        (lambda t: t.norm() > 1 and None, "_local_scalar_dense"),
        (lambda t: t.nonzero(), "nonzero"),
        (lambda t: t[t > 0], "index"),
        (lambda t: t.__setitem__(t > 0, 0.0), "index_put"),
        (lambda t: t.masked_select(t > 0), "masked_select"),
        (lambda t: t.cpu(), "_to_copy"),
        (lambda t: t.tolist(), "_to_copy"),
        (lambda t: torch.equal(t, t), "equal"),
        (lambda t: t.copy_(torch.ones(4)), "copy_"),  # a blocking host-to-device copy
        (lambda t: torch.ones(4).to(t.device), "_to_copy"),
    ],
)
def test_each_kind_of_sync_is_caught(sync: object, op: str) -> None:
    t = torch.ones(4, device=META)
    with pytest.raises((HostSyncError, NotImplementedError)) as e, checked(META):
        sync(t)  # type: ignore[operator]
    assert e.type is HostSyncError, f"not caught by the detector: {e.value}"
    assert op in str(e.value) and "test_hostsync.py" in str(e.value)


def test_what_does_not_sync_passes() -> None:
    """Device-only math, host-only math (an optimizer's step count) and a non-blocking
    host-to-device copy are not syncs."""
    t = torch.ones(4, device=META)
    step = torch.tensor(3.0)
    with checked(META):
        scale = torch.where(t.norm() > 1.0, 1.0 / (t.norm() + 1e-6), 1.0)
        torch._foreach_mul_([t], scale)
        assert step.item() == 3.0
        u = torch.ones(4).to(META, non_blocking=True)
        u.copy_(torch.ones(4), non_blocking=True)
        assert t.shape == (4,)


def test_counting_mode_counts_per_step() -> None:
    detector = HostSyncDetector(raise_on_sync=False)
    t = torch.ones(4, device=META)
    with detector:
        for _ in range(3):
            float(t.sum())
            if t.norm() > 1:
                pass
    assert len(detector.syncs) == 6
    assert all("test_hostsync.py" in s.where for s in detector.syncs)


def test_count_syncs_is_zero_for_every_method() -> None:
    assert {m: count_syncs(m, nano(), batch) for m in METHODS} == dict.fromkeys(METHODS, 0.0)


def _old_clip_grad_(grads: list[torch.Tensor], max_norm: float) -> None:
    """The clip as it was, with its branch on the host: the bits to match."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))


@pytest.mark.parametrize(
    "target", [0.3, 1.0, 10.0, "at-norm", "just-below", "next-below", "nan", "inf"]
)
def test_clip_is_the_same_bits_as_the_branch(target: object) -> None:
    """At max_norm = norm - 3e-7 torch's clip_grad_norm_(foreach=True) gives other bits."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(7, 5, generator=g), torch.randn(11, generator=g)]
    norm = float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads]))
    )
    edges = {"at-norm": norm, "just-below": norm - 3e-7, "next-below": math.nextafter(norm, 0)}
    max_norm = edges.get(str(target), 1.0)
    if isinstance(target, float):
        grads = [x * (target / norm) for x in grads]
    if target == "nan":
        grads[1][3] = float("nan")
    if target == "inf":
        grads[0][1, 1] = float("inf")
    new, old = [x.clone() for x in grads], [x.clone() for x in grads]
    clip_grad_(new, max_norm)
    _old_clip_grad_(old, max_norm)
    for a, b in zip(new, old, strict=True):
        assert a.view(torch.int32).equal(b.view(torch.int32))


def test_host_sum_is_pythons_sum_of_floats() -> None:
    values = [torch.tensor(x, dtype=torch.float32) for x in (2.7, 1e-8, 3.3, 1e7, 0.1)]
    want = 0.25
    for v in values:
        want += float(v)
    assert host_sum(values, 0.25) == want
    assert host_sum([values[0], 1.5, values[1]]) == float(values[0]) + 1.5 + float(values[1])
    assert host_sum([]) == 0.0


def test_synchronize_on_the_host_is_a_no_op() -> None:
    synchronize("cpu")
    synchronize(torch.device("meta"))


def test_bench_rows() -> None:
    rows = run_hostsync_bench("nano", steps=1, batch_size=2, seq_len=16)
    assert [r["method"] for r in rows] == list(METHODS)
    for r in rows:
        assert r["syncs_per_step"] == 0.0
        assert r["host_ms_per_step_per_m"] > 0 and r["steps_timed"] >= 1


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_the_cpu_run_trains() -> None:
    """The same driver on the CPU takes real steps: the weights move."""
    model = nano()
    before = copy.deepcopy(model)
    run_inner_steps("diloco", model, batch, 1, _nothing, torch.device("cpu"))
    pairs = zip(model.parameters(), before.parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)


def test_the_step_time_probe_warms_up_before_it_times() -> None:
    """The probe at join: 2 untimed passes, then the median of 3 timed ones."""
    from types import SimpleNamespace

    from covey.peer.worker_train import STEP_PROBE_WARMUP, Training

    s = build_strategy(method_config("diloco"), nano(), lm_loss)
    calls = []

    def counted(model: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        calls.append(b.shape)
        return lm_loss(model, b)

    s.loss_fn = counted
    probe = Training.__new__(Training)
    probe.strategy, probe.opts = s, SimpleNamespace(slowdown=2.0)
    probe._batch = lambda *_: batch(0)  # type: ignore[method-assign]
    seconds = probe._measure_step_time()
    assert len(calls) == STEP_PROBE_WARMUP + 3 == 5
    assert seconds > 0
    assert all(p.grad is None for p in s.model.parameters())  # a scratch copy trained
