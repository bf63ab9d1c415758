"""Host synchronizations in a worker's inner step: a detector and `covey bench hostsync`.

A device-to-host read (`.item()`, `float(t)`, `bool(t)`, `if t > x`, `.cpu()`, `.tolist()`,
an op whose output shape depends on the values, such as `nonzero`) makes the host wait
for every kernel queued before it: on a GPU each one stalls the stream once per step.
CUDA reports them itself (`torch.cuda.set_sync_debug_mode("error")`); without CUDA,
`HostSyncDetector` finds the same calls. It is a TorchDispatchMode that sees every aten op
and flags those that need a device tensor's values on the host, naming the op and the
Python line that called it.

Which tensors are "on the device" without a device: the strategy runs on the meta device.
A meta tensor has a shape and a dtype and no values, as a CUDA tensor has no values the
host could read without waiting; tensors that stay on the host by design (torch.optim's
step counts, Python scalars wrapped as tensors, a networked peer's canonical state) stay
CPU tensors, as they do next to a GPU. A sync is then any op that reads a meta tensor's
values on the host, and any copy between the host and it that is not `non_blocking`
(CUDA waits for the stream on those, and its debug mode reports them too).
"""

from __future__ import annotations

import copy
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: ops that return host values computed from their inputs' values (or an output shape that
#: depends on them): each is a device-to-host read when an input lives on the device
VALUE_OPS = frozenset(
    {
        aten._local_scalar_dense.default,  # .item(), float(t), int(t), bool(t), if t > x
        aten.is_nonzero.default,
        aten.equal.default,  # torch.equal -> a Python bool
        aten.nonzero.default,
        aten.nonzero_static.default,
        aten.masked_select.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
        aten.repeat_interleave.Tensor,
        aten.allclose.default,
    }
)
#: indexing ops that are VALUE_OPS when an index is a boolean mask (t[t > 0]: a nonzero)
MASK_INDEX_OPS = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default})


class HostSyncError(RuntimeError):
    """A device-to-host synchronization where none is allowed; says which op and where."""


@dataclass(frozen=True)
class HostSync:
    """One synchronization: the aten op and the innermost covey line that caused it."""

    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


def _is_device(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu",)


def _tensors(args: Any, kwargs: Any) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _is_sync(func: Any, args: Any, kwargs: Any) -> bool:
    if func in VALUE_OPS:
        return any(_is_device(t) for t in _tensors(args, kwargs))
    if func in MASK_INDEX_OPS:
        masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
        return any(_is_device(t) for t in masks)
    if func is aten._to_copy.default:
        src, dst = args[0], kwargs.get("device") or args[0].device
        to_host = _is_device(src) and torch.device(dst).type == "cpu"
        to_device = not _is_device(src) and torch.device(dst).type != "cpu"
        return to_host or (to_device and not kwargs.get("non_blocking", False))
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if _is_device(src) and not _is_device(dst):
            return True  # to the host: it waits for the values whatever non_blocking says
        return _is_device(dst) and not _is_device(src) and src.dim() > 0 and blocking
    return False


def _caller() -> str:
    """The innermost frame in covey's own code (else the innermost outside torch)."""
    frames = traceback.extract_stack()[:-3]
    mine = [f for f in frames if "/covey/" in f.filename and "/bench/hostsync" not in f.filename]
    outside = [f for f in frames if "/torch/" not in f.filename]
    f = (mine or outside or frames)[-1]
    return f"{f.filename}:{f.lineno} ({f.line})"


def _placeholder(func: Any, args: Any, kwargs: Any) -> Any:
    """What a counted sync returns so that the step can go on (its values are not real)."""
    if func in (aten._local_scalar_dense.default,):
        t = args[0]
        return False if t.dtype == torch.bool else 0 if not t.is_floating_point() else 0.0
    if func in (aten.is_nonzero.default, aten.equal.default, aten.allclose.default):
        return False
    if func is aten._to_copy.default:
        src = args[0]
        dst = kwargs.get("device") or src.device
        return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype, device=dst)
    if func is aten.copy_.default:
        return args[0]
    raise HostSyncError(f"{func} has data-dependent output: cannot count past it")


@dataclass
class HostSyncDetector(TorchDispatchMode):
    """Flags device-to-host synchronizations of the ops run under it (see the module
    docstring). raise_on_sync: raise HostSyncError at the first one, naming the op and the
    line; else count them in `syncs` (the step then goes on with placeholder values)."""

    raise_on_sync: bool = True
    syncs: list[HostSync] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            sync = HostSync(str(func), _caller())
            if self.raise_on_sync:
                raise HostSyncError(f"host synchronization in the inner step: {sync}")
            self.syncs.append(sync)
            return _placeholder(func, args, kwargs)
        return func(*args, **kwargs)


@dataclass
class HostBytes(TorchDispatchMode):
    """Counts the bytes that cross from a device to the host under it: each copy to the host
    (`copies`, the source's bytes) and each scalar read (`scalars`, counted 8 bytes each in
    `nbytes`). The meta device holds no values: a copy out of it yields zeros of its shape
    and a scalar read a placeholder, so code written for a GPU runs there and is measured
    (what it computes from those values is not real)."""

    copies: list[int] = field(default_factory=list)
    scalars: int = 0

    def __post_init__(self) -> None:
        super().__init__()

    @property
    def nbytes(self) -> int:
        return sum(self.copies) + 8 * self.scalars

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        src = None
        if func is aten._to_copy.default:
            dst = kwargs.get("device") or args[0].device
            src = args[0] if torch.device(dst).type == "cpu" else None
        elif func is aten.copy_.default and not _is_device(args[0]):
            src = args[1]
        if src is not None and _is_device(src):
            self.copies.append(src.numel() * src.element_size())
        elif func in VALUE_OPS and any(_is_device(t) for t in _tensors(args, kwargs)):
            self.scalars += 1
            src = next(t for t in _tensors(args, kwargs) if _is_device(t))
        else:
            return func(*args, **kwargs)
        if src.device.type == "meta":
            return _placeholder(func, args, kwargs)
        return func(*args, **kwargs)


@contextmanager
def no_host_sync(device: torch.device) -> Iterator[None]:
    """No device-to-host synchronization inside: on CUDA the driver's own check
    (`set_sync_debug_mode("error")` raises at the call), elsewhere `HostSyncDetector`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with HostSyncDetector(raise_on_sync=True):
            yield


# -- the bench ------------------------------------------------------------------------------

METHODS = ("ddp", "diloco", "streaming", "demo")


def method_config(method: str, inner_steps: int = 4) -> Any:
    """A small run config of each method: AdamW with clipping (the DiLoCo family), so that
    every part of the inner step runs; Streaming merges inside the steps (overlap 1)."""
    from covey.config import (
        DDPConfig,
        DeMoConfig,
        DiLoCoConfig,
        InnerOptim,
        StreamingDiLoCoConfig,
    )

    optim = InnerOptim(name="adamw", lr=1e-3, grad_clip=1.0, warmup_steps=2)
    if method == "ddp":
        return DDPConfig()
    if method == "diloco":
        return DiLoCoConfig(inner_steps=inner_steps, optim=optim, error_feedback=True)
    if method == "streaming":
        return StreamingDiLoCoConfig(
            inner_steps=inner_steps * 2, fragments=2, overlap_steps=1, optim=optim
        )
    if method == "demo":
        return DeMoConfig()
    raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")


def run_inner_steps(
    method: str,
    model: torch.nn.Module,
    batch: Callable[[int], torch.Tensor],
    rounds: int,
    step_context: Callable[[], Any],
    device: torch.device,
) -> int:
    """Drive a strategy of `method` over `rounds` rounds as a worker does (the canonical
    state on the host, the model on `device`), each inner step inside `step_context()`.
    Returns the number of inner steps taken."""
    from covey.algorithms import TrainState, build_strategy
    from covey.models.gpt import lm_loss

    host = dict(model.named_parameters(remove_duplicate=False))
    s = build_strategy(method_config(method), model.to(device), lm_loss)
    # on the host, where a networked peer keeps it (by the strategy's names: moving a
    # model to meta unties tied weights)
    state = TrainState({n: host[n].detach().clone() for n in s.names})
    s.begin_round(state)
    taken = 0
    for _ in range(rounds):
        if device.type == "meta":  # nothing reads a meta tensor's values: the next state's
            state = _next(state)  # values are never used, and the worker starts it afresh
            s.begin_round(state)
        if s.overlap_steps:  # Streaming: the merge of W_r happens inside the inner steps
            s.merge_late(state)
        for _ in range(s.steps_per_round):
            with step_context():
                s.inner_step(batch(taken))
            taken += 1
        if device.type != "meta":  # a contribution's bytes are values: not on meta
            state = s.apply_round(state, [s.make_contribution()])
            if not s.overlap_steps:
                s.adopt(state)
    return taken


def _next(state: Any) -> Any:
    from covey.algorithms import TrainState

    return TrainState(dict(state.params), dict(state.outer), state.round + 1)


def count_syncs(method: str, model: torch.nn.Module, batch: Callable[[int], torch.Tensor]) -> float:
    """Host synchronizations per inner step of `method`, counted on the meta device."""
    detector = HostSyncDetector(raise_on_sync=False)

    @contextmanager
    def counted() -> Iterator[None]:
        with detector:
            yield

    steps = run_inner_steps(method, copy.deepcopy(model), batch, 2, counted, torch.device("meta"))
    return len(detector.syncs) / steps


def _timed_steps(
    method: str, model: torch.nn.Module, batch: Callable[[int], torch.Tensor], steps: int
) -> list[float]:
    """Seconds of each inner step of `steps` (at least; whole rounds) on the CPU."""
    cfg = method_config(method)
    per_round = getattr(cfg, "inner_steps", 1) // getattr(cfg, "fragments", 1)
    times: list[float] = []

    @contextmanager
    def timed() -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        times.append(time.perf_counter() - t0)

    rounds = -(-steps // per_round)
    run_inner_steps(method, copy.deepcopy(model), batch, rounds, timed, torch.device("cpu"))
    return times


def run_hostsync_bench(
    size: str = "micro", steps: int = 12, batch_size: int = 4, seq_len: int = 64
) -> list[dict[str, Any]]:
    """Per method: host milliseconds per inner step per 1M parameters (the median and the
    fastest step, after one untimed: on a shared machine the fastest is the least
    disturbed; the CPU computes, so this is the whole step) and host
    synchronizations per inner step (counted on the meta device)."""
    from covey.models.gpt import GPT, gpt_config

    torch.manual_seed(0)
    model = GPT(gpt_config(size))
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, model.cfg.vocab_size, (16, batch_size, seq_len + 1), generator=g)
    batch = lambda i: pool[i % len(pool)]  # noqa: E731
    rows = []
    for method in METHODS:
        syncs = count_syncs(method, model, batch)
        times = sorted(_timed_steps(method, model, batch, steps + 1)[1:])  # 1st: warm-up
        ms = times[len(times) // 2] * 1e3
        rows.append(
            {
                "method": method,
                "parameters_m": round(millions, 3),
                "steps_timed": len(times),
                "host_ms_per_step_per_m": round(ms / millions, 3),
                "fastest_ms_per_step_per_m": round(times[0] * 1e3 / millions, 3),
                "syncs_per_step": syncs,
            }
        )
    return rows


def time_commitment(numel: int = 4 << 20, repeats: int = 5) -> dict[str, Any]:
    """An intermediate commitment (`commitment_of` of a local state of `numel` parameters and
    AdamW's two moments, relative to the round's start) before and after intermediate
    commitments stopped carrying a hash: host milliseconds per 1M parameters on the CPU
    (the first of a process, its hash tables made; the fastest of the next `repeats`
    without the hash, and with it: the SHA-256 `state_hash` every commitment carried) and
    host bytes per commitment with the state on the meta device (`HostBytes`: what crosses
    from a GPU), against the commitment's own bytes (its sketches' float64 sums)."""
    from covey.trust.sketch import commitment_of, state_hash

    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(numel, generator=g)}
    local = {"param/w": start["w"] + 1e-3}
    local |= {"optim/w/exp_avg": start["w"] * 0.1, "optim/w/exp_avg_sq": start["w"].square()}

    def seconds(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def hashed() -> Any:  # a commitment as every one was made before: with the state's hash
        return commitment_of(local, start, 10, digest=state_hash(local))

    first = seconds(lambda: commitment_of(local, start, 10))
    after = min(seconds(lambda: commitment_of(local, start, 10)) for _ in range(repeats))
    before = min(seconds(hashed) for _ in range(repeats))
    hashing = min(seconds(lambda: state_hash(local)) for _ in range(repeats))
    on_meta = {k: v.to("meta") for k, v in local.items()}
    crossed = []
    for digest in (True, False):
        counter = HostBytes()
        with counter:
            c = commitment_of(on_meta, start, 10, digest=state_hash(on_meta) if digest else None)
        crossed.append(counter.nbytes)
    per_m = 1e3 / (numel / 1e6)
    return {
        "parameters_m": round(numel / 1e6, 3),
        "first_ms_per_m": round(first * per_m, 3),
        "ms_per_m": round(after * per_m, 3),
        "before_ms_per_m": round(before * per_m, 3),
        "hash_ms_per_m": round(hashing * per_m, 3),
        "host_bytes": crossed[1],
        "before_host_bytes": crossed[0],
        "commitment_bytes": 8 * (len(c.sketch["params"]) + len(c.sketch["optim"])),
    }


def time_round_result(
    numel: int = 4 << 20, workers: int = 8, repeats: int = 3, device_path: bool = False
) -> dict[str, Any]:
    """Host milliseconds per 1M parameters of a DiLoCo round result on the CPU, with the
    defaults of a networked run (DiLoCo's codec, the trust section's aggregation rule):
    decoding and aggregating `workers` payloads, the Nesterov outer step, and the new
    state's SHA-256 digest. The fastest of `repeats`. `device_path`: what a worker runs on
    its training device (covey.algorithms.device_round), here in torch on the CPU: the
    device decoders, the rule over the payloads held in memory rather than spilled to
    scratch files; else the host path (numpy decoders, one payload in memory at a time).
    The row's `digest` is the new state's: both paths give the same."""
    from covey.algorithms.aggregation import build_aggregator
    from covey.algorithms.codecs import get_codec
    from covey.algorithms.diloco import outer_step
    from covey.algorithms.lazy_aggregation import aggregate_lazily
    from covey.algorithms.state import TrainState
    from covey.config.networked import TrustConfig
    from covey.config.parts import DiLoCoConfig

    trust, cfg = TrustConfig(), DiLoCoConfig()
    codec = get_codec(cfg.codec)
    rule = build_aggregator(trust.aggregation, trust.trim_fraction, trust.clip_factor)
    g = torch.Generator().manual_seed(0)
    start = TrainState({"w": torch.randn(numel, generator=g)}, {}, 0)
    payloads = [codec.encode(torch.randn(numel, generator=g) * 1e-3) for _ in range(workers)]

    def load(i: int) -> torch.Tensor:
        return codec.decode(payloads[i], numel, device_kernels=device_path)

    best = {"aggregate": float("inf"), "outer": float("inf"), "hash": float("inf")}
    digest = ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        flat = aggregate_lazily(rule, workers, load, [1.0] * workers, spill=not device_path)
        t1 = time.perf_counter()
        new = outer_step(start, {"w": flat}, cfg)
        t2 = time.perf_counter()
        digest = new.digest()
        t3 = time.perf_counter()
        for part, s in (("aggregate", t1 - t0), ("outer", t2 - t1), ("hash", t3 - t2)):
            best[part] = min(best[part], s)
    per_m = 1e3 / (numel / 1e6)
    return {
        "path": "torch (device path) on the CPU" if device_path else "host (numpy)",
        "parameters_m": round(numel / 1e6, 3),
        "workers": workers,
        "codec": cfg.codec,
        "aggregation": trust.aggregation,
        "ms_per_m": round(sum(best.values()) * per_m, 3),
        **{f"{part}_ms_per_m": round(s * per_m, 3) for part, s in best.items()},
        "digest": digest,
    }
