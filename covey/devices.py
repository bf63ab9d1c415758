"""Where a peer computes: device choice, device names, mixed precision, torch.compile.

A peer names its device with `--device auto|cpu|cuda|cuda:N|mps` (or the run spec's
`[peer] device`); `resolve_device` turns that into a `torch.device` or says plainly why it
cannot. Everything that trains (model, batches, inner and outer optimizer state, error
feedback, codecs' arithmetic, aggregation) then runs where the model's parameters live:
covey's algorithms take their device from the tensors they are given and create nothing on
the host. Tensors cross to the host only to become bytes on the wire (a codec's `encode`)
or to be hashed.

Verification across devices: GPUs do not round like CPUs (other reduction orders, fused
kernels, TF32, bf16), so a contribution is re-executed on the device class and precision the
run spec names (`[peer] verify_device`, `precision`; an RL run's `verify_device`,
`verify_precision`, covey.rl.runspec). `verification_mismatch` says why a validator on
another class or precision must refuse a check rather than judge it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

Precision = Literal["fp32", "bf16"]
DEVICE_FORMS = "auto | cpu | cuda | cuda:<index> | mps"
DEVICE_CLASSES = ("cpu", "cuda", "mps")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


class DeviceError(ValueError):
    """A device that is malformed or not present on this machine."""


def check_device_spec(spec: str) -> str:
    """The spec, normalized (stripped, lower case). DeviceError for anything not of the
    form auto|cpu|cuda|cuda:N|mps; whether the device exists is `resolve_device`'s check."""
    norm = str(spec).strip().lower()
    if not _DEVICE.match(norm):
        raise DeviceError(f"device {spec!r} is not one of {DEVICE_FORMS}")
    return norm


def resolve_device(spec: str = "auto") -> torch.device:
    """The torch.device a spec names on this machine. auto: CUDA (device 0), then MPS,
    then CPU. DeviceError naming the value when the form is wrong or the device is absent
    (no CUDA build or driver, an index past the device count, no MPS)."""
    norm = check_device_spec(spec)
    if norm == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if norm == "cpu":
        return torch.device("cpu")
    if norm == "mps":
        if not _mps_available():
            raise DeviceError(f"device {spec!r}: MPS is not available on this machine")
        return torch.device("mps")
    index = int(norm.split(":")[1]) if ":" in norm else 0
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {spec!r}: CUDA is not available (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda}); use --device cpu or auto"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"device {spec!r}: this machine has {count} CUDA device(s), 0..{count - 1}"
        )
    return torch.device("cuda", index)


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def device_class(device: torch.device | str) -> str:
    """The device type: cpu, cuda, mps (or what torch reports, e.g. meta)."""
    return torch.device(device).type


def device_name(device: torch.device | str) -> str:
    """What a peer reports at join and the status page shows: "cpu", "cuda:NVIDIA H100 80GB
    HBM3", "mps". The class comes first, so `device_class_of_name` reads it back."""
    d = torch.device(device)
    if d.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(d.index or 0)}"
    return d.type


def device_class_of_name(name: str) -> str:
    """The class a reported device name starts with ("cuda:NVIDIA H100" -> "cuda")."""
    return name.split(":", 1)[0].strip().lower() or "cpu"


def supports_bf16(device: torch.device | str) -> bool:
    """Whether bf16 autocast is worth using here: CUDA with bf16 support (Ampere and later).
    CPU autocast to bf16 exists but is slower than fp32 on most CPUs; MPS is left at fp32."""
    d = torch.device(device)
    return d.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def default_precision(device: torch.device | str) -> Precision:
    """bf16 on CUDA that supports it, fp32 elsewhere (what precision "auto" means)."""
    return "bf16" if supports_bf16(device) else "fp32"


def resolve_precision(setting: str, device: torch.device | str) -> Precision:
    """A precision setting ("auto", "fp32", "bf16") on a device. auto: `default_precision`.
    DeviceError for an unknown setting, or bf16 on a device without bf16 autocast (CPU
    bf16 is allowed: slow, but it lets a CPU check a bf16 run's arithmetic class)."""
    if setting == "auto":
        return default_precision(device)
    if setting == "fp32":
        return "fp32"
    if setting == "bf16":
        d = torch.device(device)
        if d.type == "cuda" and not supports_bf16(d):
            raise DeviceError(f"precision bf16: {device_name(d)} has no bf16 support")
        if d.type not in ("cuda", "cpu"):
            raise DeviceError(f"precision bf16 is not supported on {d.type}")
        return "bf16"
    raise DeviceError(f"precision {setting!r} is not one of auto, fp32, bf16")


def run_precision(setting: str, verify_class: str) -> Precision:
    """A run's precision from its spec: "fp32" or "bf16" as written; "auto" is bf16 when
    the run verifies on CUDA, else fp32. Every peer of the run trains in it, since
    validators re-execute in it. `verify_class` "auto": `run_verify_class`'s."""
    if setting in ("fp32", "bf16"):
        return setting  # type: ignore[return-value]
    if setting != "auto":
        raise DeviceError(f"precision {setting!r} is not one of auto, fp32, bf16")
    return "bf16" if run_verify_class(verify_class) == "cuda" else "fp32"


def run_verify_class(setting: str, cuda: bool | None = None) -> str:
    """The device class a run verifies on: its spec's `verify_device`, where "auto" is
    "cuda" on a machine with a CUDA GPU and "cpu" elsewhere (MPS only when asked for: its
    kernels are not deterministic enough to re-execute on). `cuda`: whether a GPU is
    there (None: ask torch). A spec loaded from a file has it fixed (`plan_run_compute` at
    load, covey.spec), so every peer reads the same class; "auto" left in a spec built in
    code resolves on each machine alone."""
    if setting != "auto":
        return setting
    has_cuda = torch.cuda.is_available() if cuda is None else cuda
    return "cuda" if has_cuda else "cpu"


@dataclasses.dataclass(frozen=True)
class RunCompute:
    """What a run fixes for every peer: the device class contributions are re-executed
    on (and that honest workers train on), the inner steps' precision, torch.compile."""

    verify_class: str
    precision: Precision
    compile: bool

    def describe(self) -> str:
        compiled = "compiled" if self.compile else "not compiled"
        return f"verifies on {self.verify_class} in {self.precision}, {compiled}"


def plan_run_compute(
    verify_device: str, precision: str, compile: bool, cuda: bool | None = None
) -> RunCompute:
    """A run's compute from its spec's `[peer]` settings, "auto"s resolved on a machine
    with (`cuda` True) or without a CUDA GPU (None: this one): a default spec on a GPU
    machine verifies and trains on CUDA in bf16. Pure given `cuda`."""
    verify = run_verify_class(verify_device, cuda)
    return RunCompute(verify, run_precision(precision, verify), bool(compile))


def peer_compute_line(
    role: str, device: torch.device | str, precision: str, run: RunCompute
) -> str:
    """What a peer says at start about where it computes and what the run fixes."""
    return (
        f"{role} computes on {device_name(device)} in {precision}"
        f"{', compiled' if run.compile else ''}; the run {run.describe()}"
    )


def autocast(device: torch.device | str, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The context an inner step's forward pass runs in: bf16 autocast for "bf16", nothing
    for "fp32". Parameters and optimizer state stay fp32 either way (autocast casts inside
    matmuls only); the backward pass runs outside it, as torch recommends."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise DeviceError(f"precision {precision!r} is not one of fp32, bf16")
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def synchronize(device: torch.device | str) -> None:
    """Wait until the device has run everything queued on it (CUDA: the current stream;
    MPS likewise); nothing on the CPU, whose ops run as they are called. For a clock
    reading that should count the device's work, not only its launches."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def maybe_compile(fn: Callable[..., Any], enabled: bool) -> Callable[..., Any]:
    """torch.compile(fn) when enabled, else fn itself. Compilation happens on the first
    call; a compiled step is numerically close to, not bit-identical with, the eager one, so
    a run that verifies by re-execution must compile on every peer or on none."""
    return torch.compile(fn) if enabled else fn


def verification_mismatch(
    spec_class: str, spec_precision: str, device: torch.device | str, precision: str
) -> str | None:
    """Why a peer on `device` computing in `precision` must not judge a run's contributions,
    or None when it may. A run checks contributions under one device class and precision
    (its spec's); re-executing elsewhere differs by more than rounding, and a validator that
    convicted an honest peer for that would be wrong, so it refuses the check instead."""
    mine = device_class(device)
    spec_class = run_verify_class(spec_class)
    if mine != spec_class:
        return (
            f"this run verifies on {spec_class}, this validator computes on {mine} "
            f"({device_name(device)}): re-execution must run on the run's device class"
        )
    if precision != spec_precision:
        return (
            f"this run verifies in {spec_precision}, this validator computes in {precision}: "
            f"re-execution must use the run's precision"
        )
    return None


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """torch.use_deterministic_algorithms for the duration (restored after). On CUDA this
    also needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set before CUDA starts, and costs speed:
    atomics-based kernels (index_add_, scatter_add_, embedding backward) take slower
    deterministic paths. Not measured here: this machine has no GPU."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@dataclasses.dataclass(frozen=True)
class RefereeCompute:
    """Where a coordinator's referee recomputes disputed work: `device` and `precision`,
    or `refusal` (why it must not judge; then `device` is None)."""

    device: torch.device | None
    precision: Precision
    refusal: str | None = None


def referee_compute(
    verify_class: str, precision_setting: str, spec: str | None = None
) -> RefereeCompute:
    """The referee's device for a run verified on `verify_class` in `precision_setting`
    (a run spec's `[peer]`). `spec` None: the run's class itself (cuda means cuda:0), or
    a refusal when this machine has none. A given `spec` is resolved as `resolve_device`
    does (DeviceError for a malformed or absent one: the command line's error) and refused
    when its class or precision is not the run's. A refusing referee leaves disputes open:
    recomputing on another class differs by more than rounding and could convict an
    honest peer."""
    verify_class = run_verify_class(verify_class)
    precision = run_precision(precision_setting, verify_class)
    lacks = f"referee lacks device class {verify_class}"
    if spec is None:
        try:
            where = resolve_device(verify_class)
        except DeviceError as e:
            return RefereeCompute(None, precision, f"{lacks}: {e}")
    else:
        where = resolve_device(spec)
    try:
        resolve_precision(precision, where)
    except DeviceError as e:
        return RefereeCompute(None, precision, f"{lacks} in {precision}: {e}")
    reason = verification_mismatch(verify_class, precision, where, precision)
    if reason is not None:
        return RefereeCompute(None, precision, f"{lacks}: {reason}")
    return RefereeCompute(where, precision)
