"""Devices (covey/devices.py): choosing one, mixed precision, and training paths that stay on it.

This machine has no GPU: device-agnostic paths are checked on the CPU and on the `meta`
device (no data, shapes only), where any tensor the hot path creates on the host shows up;
CUDA tests are skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from covey.algorithms import build_strategy
from covey.algorithms.base import Strategy
from covey.algorithms.codec_base import HEADER_BYTES
from covey.algorithms.codecs import get_codec
from covey.algorithms.dct import dct_basis
from covey.algorithms.state import TrainState
from covey.config import (
    DDPConfig,
    DeMoConfig,
    DiLoCoConfig,
    PeerConfig,
    RunConfig,
    SimConfig,
    StreamingDiLoCoConfig,
)
from covey.devices import (
    DeviceError,
    autocast,
    deterministic,
    device_class_of_name,
    device_name,
    maybe_compile,
    resolve_device,
    resolve_precision,
    verification_mismatch,
)
from covey.models.gpt import lm_loss
from tests.conftest import tiny_gpt

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- choosing a device ---------------------------------------------------------------------


def test_resolve_device_cpu_and_auto() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available() and torch.backends.mps.is_available():
        want = "mps"
    assert resolve_device("auto").type == want


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda0", "tpu", "cpu:0"])
def test_resolve_device_rejects_malformed_names_with_the_value(spec: str) -> None:
    with pytest.raises(DeviceError, match=repr(spec).replace("\\", "\\\\")[1:-1]):
        resolve_device(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_resolve_device_absent_cuda_is_a_clear_error() -> None:
    with pytest.raises(DeviceError, match="'cuda:1': CUDA is not available"):
        resolve_device("cuda:1")


@CUDA
def test_resolve_device_index_past_the_count() -> None:
    n = torch.cuda.device_count()
    with pytest.raises(DeviceError, match=f"has {n} CUDA device"):
        resolve_device(f"cuda:{n}")


def test_device_names_and_classes() -> None:
    assert device_name("cpu") == "cpu"
    assert device_class_of_name("cuda:NVIDIA H100 80GB HBM3") == "cuda"
    assert device_class_of_name("cpu") == "cpu"


def test_precision_defaults_and_errors() -> None:
    assert resolve_precision("auto", "cpu") == "fp32"  # autocast is off on the CPU by default
    assert resolve_precision("bf16", "cpu") == "bf16"  # allowed: a CPU can check bf16 runs
    with pytest.raises(DeviceError, match="'fp8'"):
        resolve_precision("fp8", "cpu")
    with pytest.raises(DeviceError, match="'fp8'"):
        autocast("cpu", "fp8")


def test_bf16_autocast_casts_matmuls_and_keeps_fp32_weights() -> None:
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with autocast("cpu", "bf16"):
        assert layer(x).dtype == torch.bfloat16
    with autocast("cpu", "fp32"):
        assert layer(x).dtype == torch.float32
    assert layer.weight.dtype == torch.float32


def test_bf16_inner_steps_train_fp32_state_close_to_fp32(tokens: torch.Tensor) -> None:
    """Mixed precision: same batches, bf16 forward; weights and moments stay fp32 and the
    result is near, not equal to, the fp32 run."""
    cfg = DiLoCoConfig(inner_steps=2)
    runs = {}
    for precision in ("fp32", "bf16"):
        s = build_strategy(cfg, tiny_gpt(), lm_loss)
        s.set_compute(precision)
        s.load_state(s.init_state())
        s.inner_step(_batch(tokens, 0))
        runs[precision] = s.local_state()
    assert all(t.dtype == torch.float32 for t in runs["bf16"].values() if t.is_floating_point())
    diff = max(float((runs["fp32"][k] - runs["bf16"][k]).abs().max()) for k in runs["fp32"])
    assert 0 < diff < 0.05


def test_set_compute_rejects_unknown_precision() -> None:
    s = build_strategy(DiLoCoConfig(), tiny_gpt(), lm_loss)
    with pytest.raises(ValueError, match="'fp16'"):
        s.set_compute("fp16")


def test_maybe_compile_off_is_identity() -> None:
    assert maybe_compile(lm_loss, False) is lm_loss


def test_deterministic_algorithms_are_switched_for_a_block_and_restored() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic(not before):
        assert torch.are_deterministic_algorithms_enabled() is (not before)
    assert torch.are_deterministic_algorithms_enabled() is before


def test_verification_refuses_another_class_or_precision() -> None:
    assert verification_mismatch("cpu", "fp32", "cpu", "fp32") is None
    reason = verification_mismatch("cuda", "bf16", "cpu", "fp32")
    assert reason is not None and "verifies on cuda" in reason and "cpu" in reason
    reason = verification_mismatch("cpu", "bf16", "cpu", "fp32")
    assert reason is not None and "bf16" in reason


# -- the run spec ---------------------------------------------------------------------------


def test_peer_table_is_parsed_and_a_default_one_leaves_hashes_alone() -> None:
    run = RunConfig.model_validate({"peer": {"verify_device": "cuda", "precision": "bf16"}})
    assert run.peer.verify_device == "cuda" and run.peer.precision == "bf16"
    assert "peer" in run.model_dump() and run.run_id != RunConfig().run_id
    assert "peer" not in RunConfig().model_dump()  # specs from before [peer] hash the same
    assert "peer" not in SimConfig().model_dump()
    assert SimConfig(peer=PeerConfig(device="cpu")).peer.device == "cpu"
    with pytest.raises(ValueError, match="device"):
        PeerConfig(device="gpu")


# -- the hot path stays on the device ---------------------------------------------------------


class HostWatch(TorchDispatchMode):
    """Records every non-scalar tensor an op produces on the host. On `meta` tensors a
    `.item()` has no value: it answers 1 (True for a bool), enough to drive the control flow
    (clip thresholds, finiteness checks) through. 0-dim host tensors are allowed: torch.optim
    keeps its step count there on purpose (non-capturable AdamW), and empty ones hold
    nothing (shape probes). `lift_fresh` is allowed:
    it is how a payload's bytes become a tensor (on the host, where the wire is) before
    they cross; top-k and DCT hand over only their k entries."""

    def __init__(self) -> None:
        super().__init__()
        self.host: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            if t.device.type == "meta":
                return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default or func.is_view:
            return out  # a view allocates nothing: its base was checked when it was made
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 1:
                self.host.append(f"{func} -> {tuple(t.shape)}")
        return out


def _batch(tokens: torch.Tensor, step: int) -> torch.Tensor:
    from covey.data.batches import sample_batch

    return sample_batch(tokens, batch_size=4, seq_len=16, seed=3, round=0, worker=0, step=step)


HOT_PATHS: dict[str, Any] = {
    "diloco+ef+topk": DiLoCoConfig(inner_steps=2, error_feedback=True, codec="topk:0.1"),
    "diloco+int8": DiLoCoConfig(inner_steps=2, codec="int8"),
    "streaming": StreamingDiLoCoConfig(inner_steps=4, fragments=2, codec="fp32"),
    "demo+dct": DeMoConfig(chunk=64, topk=8, values="fp32"),
    "ddp": DDPConfig(),
}


@pytest.mark.parametrize("name", list(HOT_PATHS))
def test_training_path_creates_no_host_tensor_on_a_device(name: str, tokens: torch.Tensor) -> None:
    """A strategy whose model is on a device (here `meta`) trains, forms its work (the
    pseudo-gradient, error feedback, DeMo's momentum) and applies a round to a canonical
    state on that device without one non-scalar tensor on the host. The contributions'
    bytes come from a CPU twin: `meta` has no data to encode."""
    cfg = HOT_PATHS[name]
    twin = build_strategy(cfg, tiny_gpt(), lm_loss)
    twin.load_state(twin.init_state())
    for step in range(twin.steps_per_round):
        twin.inner_step(_batch(tokens, step))
    contributions = [twin.make_contribution()]
    dct_basis(64)  # the DCT's constant table is computed once on the host, then cached

    s = build_strategy(cfg, _meta_gpt(), lm_loss)
    state = s.init_state()
    assert next(iter(state.params.values())).device.type == "meta"
    s.load_state(state)
    batch = _batch(tokens, 0).to("meta")
    with HostWatch() as watch:
        for _ in range(s.steps_per_round):
            s.inner_step(batch)
        _work_on_device(s)
        new = s.apply_round(state, contributions)
        s.adopt(new)
    assert watch.host == [], watch.host[:5]
    assert all(t.device.type == "meta" for t in new.params.values())


def _meta_gpt() -> torch.nn.Module:
    """The tiny GPT built on `meta` (Module.to("meta") would untie its tied weights)."""
    with torch.device("meta"):
        return tiny_gpt()


def _work_on_device(s: Strategy) -> None:
    """What make_contribution computes before the codec makes bytes, per strategy."""
    if hasattr(s, "pseudo_gradient") and not hasattr(s, "fragments"):
        delta = s.pseudo_gradient()
        assert delta.device.type == "meta"
        s._pending = delta - delta  # error feedback's residual update, on the device
    elif hasattr(s, "momentum"):
        assert s.momentum.device.type == "meta"


def test_a_host_tensor_in_the_hot_path_is_caught(tokens: torch.Tensor) -> None:
    """The watch can fail: a residual left on the host is seen."""
    s = build_strategy(DiLoCoConfig(error_feedback=True), _meta_gpt(), lm_loss)
    with HostWatch() as watch:
        s._residual = torch.zeros(s._residual.numel())
    assert watch.host


# -- codecs on a device ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["topk:0.05", "topk:0.05:fp16", "dct:64:8", "dct2:16:32:int8"])
def test_device_encode_and_decode_paths_match_the_host_paths(spec: str) -> None:
    """The device-side selection (torch.topk) and decode (scatter / sparse inverse on the
    device) agree with the host's numpy paths; checked here with the CPU as the device."""
    codec = get_codec(spec)
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(5))
    host = codec.encode(x)
    head = HEADER_BYTES + codec.params_struct.size
    via_device = host[:head] + b"".join(bytes(b) for b in codec._on_device(x))
    assert len(via_device) == len(host)
    a, b = codec.decode(host), codec.decode(via_device)
    assert torch.allclose(a, b, atol=codec.max_abs_error(x) * 1e-3 + 1e-6)
    buf, n = codec._check_payload(host, None)
    assert torch.equal(codec._decode_to(buf, head, n, torch.device("cpu")), a)


def test_decode_onto_a_device_and_errors_unchanged() -> None:
    codec = get_codec("int8")
    x = torch.randn(300)
    assert codec.decode(codec.encode(x), device="meta").device.type == "meta"
    with pytest.raises(ValueError, match="1-D float32"):
        codec.encode(torch.zeros(3, 3))


# -- CUDA (skipped without it) ------------------------------------------------------------------


def _round(device: str, tokens: torch.Tensor, cfg: Any) -> TrainState:
    workers = [build_strategy(cfg, tiny_gpt().to(device), lm_loss) for _ in range(2)]
    state = build_strategy(cfg, tiny_gpt(), lm_loss).init_state()  # canonical: on the host
    contributions = []
    for i, w in enumerate(workers):
        w.load_state(state)
        for step in range(w.steps_per_round):
            w.inner_step(_batch(tokens, step + 10 * i))
        contributions.append(w.make_contribution())
    return workers[0].apply_round(state, contributions)


@CUDA
@pytest.mark.parametrize("codec", ["fp32", "topk:0.1", "dct:64:8"])
def test_cuda_round_matches_cpu_within_rounding(codec: str, tokens: torch.Tensor) -> None:
    cfg = DiLoCoConfig(inner_steps=3, error_feedback=True, codec=codec)
    cpu, gpu = _round("cpu", tokens, cfg), _round("cuda", tokens, cfg)
    for n in cpu.params:
        assert gpu.params[n].device.type == "cpu"  # the canonical state stays on the host
        assert torch.allclose(cpu.params[n], gpu.params[n], atol=1e-3), n


@CUDA
def test_cuda_bf16_autocast_step() -> None:
    s = build_strategy(DiLoCoConfig(inner_steps=1), tiny_gpt().to("cuda"), lm_loss)
    s.set_compute(resolve_precision("auto", "cuda"))
    s.load_state(s.init_state())
    assert s.inner_step(torch.randint(0, 256, (4, 17))) > 0
    assert all(p.dtype == torch.float32 for p in s.model.parameters())


# -- over the network: the device at join, and a validator that refuses ----------------------

NETWORK_SPEC = """
name = "devices"
seed = 3
[model]
size = "nano"
[data]
batch_size = 2
seq_len = 16
paths = ["{corpus}"]
[algorithm]
method = "diloco"
inner_steps = 2
codec = "fp32"
inner_state = "reset"
[rounds]
deadline_min_s = 3
eval_batches = 1
[peer]
precision = "fp32"
verify_device = "{verify}"
"""


@pytest.mark.network
@pytest.mark.long  # ~12 s; the class rules run by default in test_devices_referee/test_rl_device
def test_join_reports_the_device_and_a_validator_of_another_class_refuses(
    tmp_path: Path,
) -> None:
    """A run verified on another device class than this validator's: the validator
    refuses (exit 1, the reason in its log) instead of judging; the worker's device name
    reaches the status page."""
    from covey.local.cluster import LocalCluster

    mine = "cpu"
    other = "mps" if torch.cuda.is_available() else "cuda"
    corpus = tmp_path / "corpus.txt"  # small: loading the stdlib corpus takes longer
    corpus.write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(3000)))
    spec = tmp_path / "run.toml"
    spec.write_text(NETWORK_SPEC.format(verify=other, corpus=corpus))
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        cluster.start_validator("v", "--device", mine)
        cluster.start_worker("w", "--device", mine, "--threads", "1")
        status = cluster.wait_for(
            lambda s: any(p.get("device") == "cpu" for p in s.get("peers", [])),
            120,
            "the worker to join with its device",
        )
        assert [p["device"] for p in status["peers"]] == ["cpu"]
        assert cluster.wait_exit("v", 120) == 1
        log = (cluster.logs / "v.log").read_text()
        assert f"refusing to validate: this run verifies on {other}" in log, log[-2000:]


# -- covey bench gpu, on the CPU --------------------------------------------------------------


@pytest.mark.parametrize(
    "llama",
    [False, pytest.param(True, marks=pytest.mark.long)],  # transformers' import: ~10 s more
    ids=["gpt", "gpt+llama"],
)
def test_bench_gpu_runs_on_the_cpu_and_writes_json(tmp_path: Path, llama: bool) -> None:
    """The bench's every row on a tiny preset: the models, finite throughputs, no MFU
    without a known peak, every codec; the CLI writes the same as JSON."""
    import json

    from typer.testing import CliRunner

    from covey.cli import app

    out = tmp_path / "gpu.json"
    args = ["bench", "gpu", "--model", "covey:nano", "--device", "cpu", "--batch-size", "2"]
    args += ["--seq-len", "16", "--steps", "1", "--blocks", "2", "-H", "2", "--json", str(out)]
    args += ["--llama" if llama else "--no-llama"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["precision"] == "fp32"
    assert [m["model"] for m in r["models"]] == ["covey:nano", "llama (2x64)"][: 1 + llama]
    for m in r["models"]:
        assert m["bare_tokens_per_s"] > 0 and m["covey_tokens_per_s"] > 0
        assert m["covey_mfu"] is None and m["round_overhead_s"] > 0
    assert [c["codec"] for c in r["codecs"]] == ["fp32", "int8", "topk:0.01", "dct:64:8"]
    assert "no known peak" in result.output


def test_bench_gpu_refuses_a_missing_device_and_a_non_preset() -> None:
    from typer.testing import CliRunner

    from covey.cli import app

    result = CliRunner().invoke(app, ["bench", "gpu", "--device", "tpu"])
    assert result.exit_code == 2 and "'tpu'" in result.output
    result = CliRunner().invoke(app, ["bench", "gpu", "--model", "hf:/x", "--device", "cpu"])
    assert result.exit_code == 2 and "covey preset" in result.output
