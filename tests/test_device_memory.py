"""What a strategy holds on the training device between inner steps, counted on the meta
device (it has shapes and sizes but no values, as the host sees a GPU's memory): DiLoCo
with AdamW and error feedback holds the model, its gradients and the two moments (4 model
sizes); the round's start weights and the residuals stay on the host. Streaming DiLoCo
keeps W_r on the host and moves one fragment at a time."""

from __future__ import annotations

import gc
import types
from typing import Any

import pytest
import torch

from covey.algorithms import TrainState, build_strategy
from covey.bench.hostsync import method_config
from covey.models.gpt import GPT, gpt_config, lm_loss

META = torch.device("meta")


# not what a strategy holds: code, and what code reaches (modules' globals)
_NOT_STATE = (type, str, bytes, int, float, types.ModuleType, types.FunctionType,
              types.BuiltinFunctionType, types.MethodType, types.CodeType)  # fmt: skip


def device_bytes(root: Any, device_type: str = "meta") -> int:
    """Bytes of the distinct storages of every tensor reachable from `root` (attributes,
    containers, modules, optimizers; a parameter's gradient too; not code or modules) on
    `device_type`. A view counts as its base (an expanded zero: one element)."""
    seen: set[int] = set()
    bases: dict[int, torch.Tensor] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_STATE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            base = obj if obj._base is None else obj._base
            bases[id(base)] = base
            if obj.grad is not None:
                stack.append(obj.grad)
            continue
        stack.extend(gc.get_referents(obj))
    return sum(t.untyped_storage().nbytes() for t in bases.values() if t.device.type == device_type)


def _strategy_after_steps(method: str, steps: int) -> tuple[Any, int]:
    torch.manual_seed(0)
    model = GPT(gpt_config("nano"))
    host = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    model_bytes = sum(t.numel() * 4 for t in host.values())
    s = build_strategy(method_config(method), model.to(META), lm_loss)
    state = TrainState({n: host[n] for n in s.names})  # the canonical state, on the host
    s.begin_round(state)
    if s.overlap_steps:
        s.merge_late(state)
    batch = torch.randint(0, model.cfg.vocab_size, (2, 17))
    for _ in range(steps):
        s.inner_step(batch)
    return s, model_bytes


@pytest.mark.parametrize("method", ["diloco", "streaming"])
def test_inner_steps_hold_at_most_four_model_sizes_on_the_device(method: str) -> None:
    s, model_bytes = _strategy_after_steps(method, 3)  # Streaming merges at step 1
    held = device_bytes(s)
    assert 3 * model_bytes < held <= 4 * model_bytes + 4096, held / model_bytes
    if method == "diloco":
        assert s.cfg.error_feedback and s.cfg.optim.name == "adamw"
        assert s._residual.device.type == "cpu" and s._pending.device.type == "cpu"
        assert all(t.device.type == "cpu" for t in s._start_params)
    else:
        assert all(t.device.type == "cpu" for t in s._global.values())


def test_the_counter_sees_a_model_size_left_on_the_device() -> None:
    """The bound can fail: a flat copy of the start weights on the device is counted."""
    s, model_bytes = _strategy_after_steps("diloco", 1)
    before = device_bytes(s)
    s._extra = torch.cat([p.detach().reshape(-1) for p in s.model.parameters()])
    assert device_bytes(s) == before + model_bytes
