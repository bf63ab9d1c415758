"""The round result on the training device (covey.algorithms.device_round): the same bits as
the host path for every codec, aggregation rule and contributor count, and no full tensor
copied to the host but the new state's hash inputs.

Without a GPU the "device" is the CPU running the device path's torch kernels (decoders,
the rules on N vectors held in memory, the outer step with its start moved and its result
brought back), compared bit for bit against the host path (numpy decoders, spilled
per-coordinate rules). The host-copy count runs the device path on the meta device, which
has no values: any read of them on the host is seen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from covey.algorithms import aggregation, lazy_aggregation
from covey.algorithms.aggregation import AGGREGATIONS, build_aggregator
from covey.algorithms.codecs import CODEC_SPECS, get_codec
from covey.algorithms.ddp import DDP
from covey.algorithms.device_round import ROUND_ON_DEVICE_ENV, choose_round_device
from covey.algorithms.diloco import DiLoCo
from covey.algorithms.lazy_aggregation import aggregate_lazily
from covey.algorithms.state import Contribution, TrainState
from covey.config import DDPConfig, DiLoCoConfig

CPU = torch.device("cpu")


def peak(spec: str) -> float:
    """A large magnitude the codec's encoder takes (a DCT's coefficients add up values)."""
    if spec == "fp16":
        return 6.0e4
    return 500.0 if spec.endswith("fp16") else 1.0e30


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int64)


def same_state(a: TrainState, b: TrainState) -> bool:
    if a.round != b.round or list(a.params) != list(b.params) or list(a.outer) != list(b.outer):
        return False
    pairs = [(a.params[k], b.params[k]) for k in a.params]
    pairs += [(a.outer[k], b.outer[k]) for k in a.outer]
    return all(torch.equal(bits(x), bits(y)) for x, y in pairs) and a.digest() == b.digest()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 9))  # 1509 coordinates


def vector(numel: int, g: torch.Generator, kind: str, spec: str) -> torch.Tensor:
    """A pseudo-gradient: plain noise, or adversarial but valid (what a codec encodes)."""
    v = torch.randn(numel, generator=g) * 1e-2
    if kind == "extreme":
        v[::7] = peak(spec) * torch.sign(torch.randn(v[::7].shape, generator=g))
        v[1::11] = 1e-40  # float32 subnormals
        v[2::13] = -0.0
        v[3::17] = 0.0
    return v


def contributions(spec: str, n: int, numel: int, kind: str, seed: int) -> list[Contribution]:
    codec = get_codec(spec)
    g = torch.Generator().manual_seed(seed)
    payloads = [codec.encode(vector(numel, g, kind, spec)) for _ in range(n)]
    if kind == "ties":  # whole contributions repeated, and one coordinate range shared
        payloads = [payloads[i % 2] for i in range(n)]
    return [Contribution(p, 100 * (1 + i % 3), 5) for i, p in enumerate(payloads)]


def both_paths(
    strategy: DiLoCo, state: TrainState, cs: list[Contribution], consume: bool = False
) -> tuple[TrainState, TrainState]:
    """(host result, device-path result) of one round from `state`."""

    def run(on: torch.device | bool) -> TrainState:
        strategy.round_on = on
        start = TrainState(dict(state.params), dict(state.outer), state.round)
        if consume:
            return strategy.apply_round_consuming(start, cs)
        return strategy.apply_round(start, cs)

    host = run(False)
    assert strategy.round_computed_on is None
    dev = run(CPU)
    assert strategy.round_computed_on == CPU
    return host, dev


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many blocks and chunks with ragged ends on both paths."""
    monkeypatch.setattr(lazy_aggregation, "_BLOCK_VALUES", 1000)
    monkeypatch.setattr(aggregation, "_CHUNK_VALUES", 700)
    monkeypatch.setattr(aggregation, "_NORM_BLOCK", 500)


@pytest.mark.parametrize("spec", CODEC_SPECS)
@pytest.mark.parametrize("kind", ["plain", "extreme"])
def test_device_decoders_give_the_host_floats(spec: str, kind: str) -> None:
    codec = get_codec(spec)
    g = torch.Generator().manual_seed(len(spec))
    for numel in (1, 63, 64, 65, 1001):
        payload = codec.encode(vector(numel, g, kind, spec))
        host = codec.decode(payload, numel)
        dev = codec.decode(payload, numel, device=CPU, device_kernels=True)
        assert dev.dtype == torch.float32 and dev.shape == host.shape
        assert torch.equal(bits(dev), bits(host)), (spec, numel)


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_device_dense_decoder_refuses_what_the_host_refuses(fmt: str) -> None:
    from covey.algorithms.codec_base import CodecError

    codec = get_codec(fmt)
    payload = bytearray(codec.encode(torch.ones(8)))
    payload[-2:] = b"\xff\xff"  # the last value's high bytes: NaN in every format
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.decode(bytes(payload), 8)
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.decode(bytes(payload), 8, device=CPU, device_kernels=True)


@pytest.mark.parametrize("aggregation_rule", AGGREGATIONS)
@pytest.mark.parametrize("clip", [0.0, 2.0])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9])
def test_round_result_on_the_device_is_the_host_result(
    aggregation_rule: str, clip: float, n: int, small_chunks: None
) -> None:
    """Every rule, 1..9 contributors, codecs and inputs cycled through; two rounds, so the
    second steps from the first's momentum; the consuming variant too."""
    m = model()
    numel = sum(p.numel() for p in m.parameters())
    specs = [*CODEC_SPECS, "int4:32", "topk:0.05", "dct:16:4:int8"]
    kinds = ["plain", "extreme", "ties"]
    for k, spec in enumerate(specs[n % 3 :: 3]):
        kind = kinds[(n + k) % 3]
        rule = build_aggregator(aggregation_rule, 0.25, clip)
        s = DiLoCo(m, lambda *a: None, DiLoCoConfig(codec=spec), get_codec(spec), rule)  # type: ignore[arg-type]
        state = s.init_state()
        cs = contributions(spec, n, numel, kind, seed=100 * n + k)
        host, dev = both_paths(s, state, cs)
        assert same_state(host, dev), (spec, kind)
        again = contributions(spec, n, numel, "plain", seed=100 * n + k + 1)
        host2, dev2 = both_paths(s, host, again, consume=True)
        assert "momentum/0.weight" in host2.outer
        assert same_state(host2, dev2), (spec, kind)


def test_uneven_weights_and_all_equal_payloads(small_chunks: None) -> None:
    """Ties everywhere: every contributor sends the same bytes, weights differ."""
    m = model()
    numel = sum(p.numel() for p in m.parameters())
    payload = get_codec("fp32").encode(torch.full((numel,), -0.0))
    cs = [Contribution(payload, t, 3) for t in (1, 7, 7, 2, 1_000_000)]
    for rule in AGGREGATIONS:
        s = DiLoCo(m, lambda *a: None, DiLoCoConfig(), get_codec("fp32"),  # type: ignore[arg-type]
                   build_aggregator(rule, 0.4, 2.0))  # fmt: skip
        host, dev = both_paths(s, s.init_state(), cs)
        assert same_state(host, dev)


def meta_to_host(src: torch.Tensor, dst: torch.device | str | None) -> bool:
    return src.device.type == "meta" and dst is not None and torch.device(dst).type == "cpu"


class HostReads(TorchDispatchMode):
    """Records every copy from the meta device to the host (bytes) and every value read
    on the host (answered with a harmless placeholder, as values are not there)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied: list[int] = []
        self.scalars = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        aten = torch.ops.aten
        metas = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "meta"]
        if func in (aten._local_scalar_dense.default, aten.is_nonzero.default) and metas:
            assert metas[0].numel() == 1  # a scalar, never a tensor's values
            self.scalars += 1
            return True if metas[0].dtype == torch.bool else 1.0
        if func is aten.copy_.default and meta_to_host(args[1], args[0].device):
            self.copied.append(args[1].numel() * args[1].element_size())
            return args[0]
        if func is aten._to_copy.default and meta_to_host(args[0], kwargs.get("device")):
            src = args[0]
            self.copied.append(src.numel() * src.element_size())
            return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        return func(*args, **kwargs)


@pytest.mark.parametrize("spec", ["fp32", "int4"])
def test_only_the_new_state_crosses_to_the_host(spec: str) -> None:
    """The device path (here the meta device: nothing there can be read without being
    seen) copies to the host the new parameters and momentum, the state's hash inputs,
    and nothing else: no decoded contribution, no spilled rows. A handful of scalars
    are read (the clip's norms, one finiteness check per parameter)."""
    m = model()
    numel = sum(p.numel() for p in m.parameters())
    rule = build_aggregator("trimmed_mean", 0.25, 2.0)  # the networked default
    s = DiLoCo(m, lambda *a: None, DiLoCoConfig(codec=spec), get_codec(spec), rule)  # type: ignore[arg-type]
    cs = contributions(spec, 8, numel, "plain", seed=3)
    s.round_on = torch.device("meta")
    reads = HostReads()
    with reads:
        new = s.apply_round(s.init_state(), cs)
    assert all(t.device.type == "cpu" for t in [*new.params.values(), *new.outer.values()])
    assert sorted(reads.copied) == sorted(t.numel() * 4 for t in [*m.parameters()] * 2)
    assert sum(reads.copied) == new.nbytes() == 2 * 4 * numel
    assert reads.scalars <= 8 + 8 * 2 + len(new.params)


def test_the_counter_sees_a_spilled_contribution() -> None:
    """The check above can fail: the host path's per-coordinate rule spills every loaded
    vector to the host, and the counter sees each whole one."""
    numel = 777
    reads = HostReads()
    with reads:
        vs = [torch.ones(numel, device="meta") for _ in range(3)]
        aggregate_lazily(build_aggregator("median", 0.0, 0.0), 3, vs.__getitem__, [1.0] * 3)
    assert reads.copied == [4 * numel] * 3


def test_where_the_round_result_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROUND_ON_DEVICE_ENV, raising=False)
    cuda, meta = torch.device("cuda", 0), torch.device("meta")
    assert choose_round_device(cuda) == cuda  # a GPU: there, automatically
    assert choose_round_device(CPU) is None and choose_round_device(meta) is None
    assert choose_round_device(cuda, False) is None and choose_round_device(CPU, True) == CPU
    monkeypatch.setenv(ROUND_ON_DEVICE_ENV, "1")
    assert choose_round_device(CPU) == CPU
    monkeypatch.setenv(ROUND_ON_DEVICE_ENV, "0")
    assert choose_round_device(cuda) is None
    monkeypatch.setenv(ROUND_ON_DEVICE_ENV, "yes")
    with pytest.raises(ValueError, match=ROUND_ON_DEVICE_ENV):
        choose_round_device(CPU)
    monkeypatch.setenv(ROUND_ON_DEVICE_ENV, "1")
    m = model()
    ddp = DDP(m, lambda *a: None, DDPConfig(), get_codec("fp32"))  # type: ignore[arg-type]
    assert ddp.round_device is None  # its own update step: on the host
    diloco = DiLoCo(m, lambda *a: None, DiLoCoConfig(), get_codec("fp32"))  # type: ignore[arg-type]
    assert diloco.round_device == CPU


def test_the_bench_times_both_paths_to_the_same_state() -> None:
    from covey.bench.hostsync import time_round_result

    host = time_round_result(5000, workers=3, repeats=1)
    dev = time_round_result(5000, workers=3, repeats=1, device_path=True)
    assert host["digest"] == dev["digest"] and host["path"] != dev["path"]
    assert dev["ms_per_m"] > 0


def test_a_round_that_does_not_fit_on_the_device_computes_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from covey.algorithms import base

    m = model()
    numel = sum(p.numel() for p in m.parameters())
    s = DiLoCo(m, lambda *a: None, DiLoCoConfig(), get_codec("fp32"))  # type: ignore[arg-type]
    cs = contributions("fp32", 3, numel, "plain", seed=5)
    s.round_on = CPU
    want = s.apply_round(s.init_state(), cs)
    monkeypatch.setattr(base, "fits", lambda device, numel, n: False)
    got = s.apply_round(s.init_state(), cs)
    assert s.round_computed_on is None and same_state(got, want)


def test_streaming_diloco_fragments_on_the_device_are_the_host_result(small_chunks: None) -> None:
    from covey.algorithms.streaming import StreamingDiLoCo
    from covey.config import StreamingDiLoCoConfig

    m = model()
    cfg = StreamingDiLoCoConfig(fragments=2, inner_steps=4)
    rule = build_aggregator("trimmed_mean", 0.25, 2.0)
    s = StreamingDiLoCo(m, lambda *a: None, cfg, get_codec(cfg.codec), rule)  # type: ignore[arg-type]
    state = s.init_state()
    for _ in range(3):  # both fragments, then the first again from its momentum
        p = s.fragment_of(state.round)
        numel = sum(state.params[n].numel() for n in s.fragments[p])
        cs = [Contribution(c.payload, c.tokens, c.inner_steps, p)
              for c in contributions(cfg.codec, 5, numel, "extreme", seed=state.round)]  # fmt: skip
        host, dev = both_paths(s, state, cs)
        assert same_state(host, dev)
        state = host


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("aggregation_rule", AGGREGATIONS)
def test_round_result_on_cuda_is_the_host_result(aggregation_rule: str) -> None:
    """On a GPU: the same comparison, the device path on CUDA against the host path."""
    m = model()
    numel = sum(p.numel() for p in m.parameters())
    rule = build_aggregator(aggregation_rule, 0.25, 2.0)
    for k, spec in enumerate([*CODEC_SPECS, "int4:32"]):
        s = DiLoCo(m, lambda *a: None, DiLoCoConfig(codec=spec), get_codec(spec), rule)  # type: ignore[arg-type]
        state = s.init_state()
        for r, kind in enumerate(["extreme", "ties", "plain"]):
            cs = contributions(spec, 2 + 3 * r, numel, kind, seed=k)
            s.round_on = False
            host = s.apply_round(state, cs)
            s.round_on = torch.device("cuda")
            dev = s.apply_round(state, cs)
            assert s.round_computed_on == torch.device("cuda")
            assert same_state(host, dev), (spec, kind)
            state = host


NETWORK_SPEC = """
name = "device-round"
seed = 5
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 4
codec = "int4"
[rounds]
target_compute_s = 30
deadline_min_s = 4
deadline_max_s = 60
eval_batches = 1
"""


@pytest.mark.network
@pytest.mark.long  # the bit-exactness tests above cover the same result by default
def test_workers_on_the_device_path_match_a_coordinator_on_the_host(tmp_path: Path) -> None:
    """Real processes: the coordinator computes each round on the host path, two workers
    on the device path (the CPU through it, by the env), int4 payloads and the default
    clipped trimmed mean; every round each worker computes is the certificate's."""
    import json

    from covey.local.cluster import LocalCluster

    spec = tmp_path / "run.toml"
    spec.write_text(NETWORK_SPEC)
    env = {ROUND_ON_DEVICE_ENV: "0"}
    with LocalCluster(spec, tmp_path, env=env) as cluster:
        cluster.start_coordinator()
        cluster.env = {**cluster.env, ROUND_ON_DEVICE_ENV: "1"}  # the workers' processes
        for w in ("w0", "w1"):
            cluster.start_worker(w)

        def applied(w: str) -> list[dict[str, Any]]:
            path = tmp_path / "peers" / w / "applied.jsonl"
            return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

        cluster.wait_for(
            lambda s: all(len(applied(w)) >= 3 for w in ("w0", "w1")), 180, "3 rounds applied"
        )
        logs = {w: cluster.tail(w, 400) for w in ("w0", "w1")}
    for w in ("w0", "w1"):
        assert all(r["matched"] and r["weights_hash"] == r["certificate"] for r in applied(w))
        assert "contributions on cpu; weights" in logs[w], logs[w]
        assert "re-syncing" not in logs[w]
