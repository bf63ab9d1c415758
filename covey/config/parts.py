"""The tables a run spec is built of: the algorithm, the model, the data, the simulated
world and the peers, with the helpers every spec shares (TOML loading, merging, hashing).
Specs themselves (`SimConfig`, `RunConfig`) are in covey.config.specs; the tables only a
networked run has (rounds, limits, trust) in covey.config.networked."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- algorithms -------------------------------------------------------------------------


def drop_defaults(
    model: BaseModel, dumped: dict[str, Any], names: tuple[str, ...]
) -> dict[str, Any]:
    """`dumped` without the fields `names` that hold their defaults: fields added after
    specs were hashed leave the hash (and so every run id and sim checkpoint) of a spec
    that does not use them unchanged."""
    fields = type(model).model_fields
    for name in names:
        if name in dumped and getattr(model, name) == fields[name].default:
            del dumped[name]
    return dumped


class InnerOptim(Frozen):
    """The optimizer each worker runs locally (DDP: the global optimizer), and its
    learning-rate schedule: a pure function of the inner step index over the run
    (round x steps per round + step; covey.algorithms.optim.scheduled_lr), so a validator
    re-executing any round takes the very same steps."""

    name: Literal["adamw", "sgd"] = Field("adamw", description="inner optimizer")
    lr: float = Field(3e-3, gt=0, description="inner learning rate (peak, with a schedule)")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (AdamW)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    grad_clip: float = Field(1.0, ge=0, description="clip the gradient's global norm; 0 = off")
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="lr after warmup: constant, or cosine decay to min_lr_ratio x lr at "
        "decay_steps",
    )
    warmup_steps: int = Field(
        0, ge=0, description="linear warmup from lr/warmup_steps to lr over this many steps"
    )
    decay_steps: int | None = Field(
        None,
        ge=1,
        description="cosine: the inner step (per worker, from the run's start) where the "
        "decay ends; usually the run's steps",
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine: final lr / lr")

    @model_validator(mode="after")
    def _schedule_fits(self) -> InnerOptim:
        if self.schedule == "cosine" and self.decay_steps is None:
            raise ValueError("schedule 'cosine' needs decay_steps (the run's inner steps)")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"decay_steps ({self.decay_steps}) must exceed warmup_steps ({self.warmup_steps})"
            )
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        names = ("schedule", "warmup_steps", "decay_steps", "min_lr_ratio")
        return drop_defaults(self, handler(self), names)


class DDPConfig(Frozen):
    """Data parallelism: every worker's gradient is gathered and averaged every step."""

    method: Literal["ddp"] = "ddp"
    optim: InnerOptim = InnerOptim()
    codec: str = Field("fp32", description="gradient codec (see `covey sim --help`)")


class DiLoCoConfig(Frozen):
    """DiLoCo (arXiv 2311.08105): H local AdamW steps, then an outer Nesterov step on the
    token-weighted mean pseudo-gradient. Inner optimizer states stay local."""

    method: Literal["diloco"] = "diloco"
    optim: InnerOptim = InnerOptim()
    inner_steps: int = Field(50, ge=1, description="H: inner steps per round")
    outer_lr: float = Field(0.7, gt=0, description="outer SGD learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer momentum")
    nesterov: bool = Field(True, description="Nesterov outer momentum")
    codec: str = Field("fp32", description="pseudo-gradient codec")
    error_feedback: bool = Field(
        False, description="carry what the codec dropped into the next round's pseudo-gradient"
    )
    inner_state: Literal["keep", "reset"] = Field(
        "keep",
        description="keep the inner optimizer's state across rounds (the paper), or reset it "
        "each round, which makes a round's work a function of the round's start state alone "
        "and so re-executable by validators",
    )


class StreamingDiLoCoConfig(DiLoCoConfig):
    """Streaming DiLoCo (arXiv 2501.18512): P strided fragments, fragment p synced every H
    steps at offset p*H/P, communication overlapped with tau inner steps, merged with
    mixing alpha, outer gradients in 4 bits."""

    method: Literal["streaming"] = "streaming"  # type: ignore[assignment]
    fragments: int = Field(4, ge=1, description="P: number of parameter fragments")
    overlap_steps: int = Field(1, ge=0, description="tau: inner steps that hide a fragment's sync")
    mixing: float = Field(0.5, ge=0, le=1, description="alpha: weight of local params in the merge")
    codec: str = Field("int4", description="outer-gradient codec")

    @model_validator(mode="after")
    def _schedule_fits(self) -> StreamingDiLoCoConfig:
        if self.error_feedback:  # covey.algorithms.streaming carries no residual
            raise ValueError(
                "error_feedback is not supported by Streaming DiLoCo (its fragments carry "
                "no residual); set error_feedback = false or use method = 'diloco'"
            )
        if self.inner_steps % self.fragments:
            raise ValueError(
                f"inner_steps ({self.inner_steps}) must be a multiple of fragments "
                f"({self.fragments})"
            )
        if self.overlap_steps >= self.inner_steps // self.fragments:
            raise ValueError(
                f"overlap_steps ({self.overlap_steps}) must be below inner_steps/fragments "
                f"({self.inner_steps // self.fragments})"
            )
        return self


class DeMoConfig(Frozen):
    """DeMo (arXiv 2411.19870): local momentum, DCT top-k of it transmitted every step with
    error feedback, gathered, averaged, inverse DCT, sign, SGD step."""

    method: Literal["demo"] = "demo"
    lr: float = Field(1e-3, gt=0, description="SGD learning rate of the sign update")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    beta: float = Field(0.999, ge=0, lt=1, description="momentum decay")
    chunk: int = Field(64, ge=2, le=256, description="DCT chunk width (side, if dims = 2)")
    dims: Literal[1, 2] = Field(
        1, description="1: chunks of `chunk` values; 2: chunk x chunk blocks (DeMo's own)"
    )
    topk: int = Field(32, ge=1, description="coefficients sent per chunk")
    values: Literal["fp32", "fp16", "int8"] = Field("fp16", description="coefficient format")

    @model_validator(mode="after")
    def _topk_fits(self) -> DeMoConfig:
        if self.topk > self.chunk**self.dims:
            raise ValueError(
                f"topk ({self.topk}) cannot exceed the {self.chunk**self.dims} coefficients "
                f"of a chunk"
            )
        return self

    @property
    def codec(self) -> str:
        kind = "dct" if self.dims == 1 else "dct2"
        return f"{kind}:{self.chunk}:{self.topk}:{self.values}"


AlgorithmConfig = Annotated[
    DDPConfig | DiLoCoConfig | StreamingDiLoCoConfig | DeMoConfig, Field(discriminator="method")
]


# --- workload and simulated world -------------------------------------------------------


class ModelConfig(Frozen):
    """The model, by source (covey.models.source): covey's GPT, a local Hugging Face
    directory, or a Python factory."""

    source: str | None = Field(
        None,
        description="covey:<preset>, hf:<dir> (config.json, never remote code) or "
        "py:<module>:<function>; default covey:<size>",
    )
    size: str = Field("nano", description="GPT size when no source: nano, micro, mini, small, gpt2")
    init: str | None = Field(
        None,
        description="warm start: hf:<dir> (an hf: model's *.safetensors weights), or a covey "
        "checkpoint: a state .safetensors file, or a run directory (`covey sim --out`, a "
        "coordinator's --data-dir: its latest checkpoint); default random init",
    )

    @property
    def spec(self) -> str:
        """The model source this config names (`source`, else covey:<size>)."""
        return self.source or f"covey:{self.size}"


class DataConfig(Frozen):
    paths: tuple[str, ...] = Field(
        (),
        description="text/JSONL/JSON/CSV/Parquet/Arrow files, dirs or save_to_disk dirs; "
        "empty = stdlib",
    )
    tokenizer: str = Field("bytes", description="bytes, or hf:<dir> holding a tokenizer.json")
    text_column: str = Field("text", min_length=1, description="column holding each row's text")
    val_fraction: float = Field(0.02, gt=0, lt=1, description="held-out share of documents")
    batch_size: int = Field(8, ge=1, description="sequences per worker per inner step")
    seq_len: int | None = Field(
        None, ge=2, description="tokens per sequence; default the GPT's block size, else 256"
    )
    round_offset: int = Field(
        0,
        ge=0,
        description="batches are keyed by round + this: a warm start from a run of N rounds "
        "sets N, so the continuation never re-reads the warm-up's batches",
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return drop_defaults(self, handler(self), ("round_offset",))


class NetworkConfig(Frozen):
    """Each worker's link to the relay. Topology: gather through a relay (the coordinator's
    blob plane): a worker uploads its contribution once and downloads every other accepted
    contribution; the relay itself is not the bottleneck."""

    uplink_mbps: float = Field(100.0, gt=0, description="upload bandwidth, Mbit/s")
    downlink_mbps: float = Field(100.0, gt=0, description="download bandwidth, Mbit/s")
    latency_ms: float = Field(50.0, ge=0, description="one-way latency per transfer")
    slow_link_fraction: float = Field(0.0, ge=0, le=1, description="share of workers on slow links")
    slow_link_factor: float = Field(1.0, ge=1, description="bandwidth divisor for slow links")


class ComputeConfig(Frozen):
    slowdown: tuple[float, ...] = Field(
        (), description="per-worker compute slowdown (>= 1), cycled over workers; empty = all 1"
    )
    step_time_s: float | None = Field(
        None, gt=0, description="model each inner step as this many seconds instead of measuring"
    )

    @field_validator("slowdown")
    @classmethod
    def _at_least_one(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(s < 1 for s in v):
            raise ValueError(f"slowdown factors must be >= 1, got {v}")
        return v


class ChurnConfig(Frozen):
    leave_prob: float = Field(0.0, ge=0, lt=1, description="chance a live worker leaves per round")
    join_prob: float = Field(0.0, ge=0, le=1, description="chance a departed worker rejoins")
    min_workers: int = Field(1, ge=1, description="never fewer live workers than this")


class PeerConfig(Frozen):
    """Where and how peers compute (covey/devices.py). `device` is each peer's own choice
    (a worker's --device overrides it); `verify_device`, `precision` and `compile` are the
    run's, fixed together: every inner step runs in `precision` (compiled or not, as
    re-execution needs all or none), and contributions are re-executed on the
    `verify_device` class, so a validator on another class refuses its checks rather than
    convict an honest peer for rounding."""

    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$",
        description="a peer's device: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N, mps",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="inner steps' precision: bf16 autocast (fp32 weights and optimizer "
        "state; outer step and aggregation in fp32), fp32, or auto: bf16 when the run "
        "verifies on cuda (the simulator: when it runs on CUDA), else fp32",
    )
    compile: bool = Field(False, description="torch.compile the inner step's forward pass")
    verify_device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto",
        description="device class that re-executes contributions (validators, referee) and "
        "that honest workers train on; auto: cuda on a machine with a GPU, else cpu, fixed "
        "when the spec is loaded from its file (covey.devices.plan_run_compute)",
    )


def default_algorithm(data: Any) -> Any:
    """An [algorithm] table without `method` means the default, DiLoCo."""
    if isinstance(data, dict) and isinstance(data.get("algorithm"), dict):
        data = {**data, "algorithm": {"method": "diloco", **data["algorithm"]}}
    return data


def steps_per_round(algo: DDPConfig | DiLoCoConfig | StreamingDiLoCoConfig | DeMoConfig) -> int:
    if isinstance(algo, StreamingDiLoCoConfig):
        return algo.inner_steps // algo.fragments
    if isinstance(algo, DiLoCoConfig):
        return algo.inner_steps
    return 1


def config_hash(cfg: BaseModel) -> str:
    canonical = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into `base` (dotted flags become nested tables)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
