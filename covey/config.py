"""Run specifications: pydantic models, loaded from TOML, frozen, hashed.

Every field has a constraint and a description; `covey sim --help` and the README are
written from them. A config is immutable once loaded and hashes (canonical JSON, sha256)
to the id that names its run directory. No environment variable overrides any field.
"""

from __future__ import annotations

import hashlib
import json
import re
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


def _drop_defaults(
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
        return _drop_defaults(self, handler(self), names)


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
        return _drop_defaults(self, handler(self), ("round_offset",))


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
    """Where and how peers compute (issue 12; covey/devices.py). `device` and `compile`
    are each peer's own choice (a worker's --device overrides `device`); `precision` and
    `verify_device` are the run's: every inner step runs in `precision`, and
    contributions are re-executed on the `verify_device` class, so a validator on another
    class refuses its checks rather than convict an honest peer for rounding."""

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
    verify_device: Literal["cpu", "cuda", "mps"] = Field(
        "cpu", description="device class that re-executes contributions (validators, referee)"
    )


def _without_default_peer(model: SimConfig | RunConfig, dumped: dict[str, Any]) -> dict[str, Any]:
    """A spec's dump without a default [peer] table: specs written before issue 12 keep
    their hash, so their run ids and sim checkpoints."""
    if dumped.get("peer") is not None and model.peer == type(model).model_fields["peer"].default:
        del dumped["peer"]
    return dumped


class SimConfig(Frozen):
    seed: int = Field(0, description="seeds model init, data and churn")
    workers: int = Field(8, ge=1, description="number of simulated workers")
    steps: int = Field(600, ge=1, description="inner steps per worker over the whole run")
    eval_every: int = Field(1, ge=1, description="evaluate every this many rounds")
    eval_batches: int = Field(8, ge=1, description="held-out batches per evaluation")
    threads: int | None = Field(None, ge=1, description="torch CPU threads; default: torch's")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    algorithm: AlgorithmConfig = DiLoCoConfig()
    network: NetworkConfig = NetworkConfig()
    compute: ComputeConfig = ComputeConfig()
    churn: ChurnConfig = ChurnConfig()
    trust: TrustConfig = Field(
        default_factory=lambda: TrustConfig(),  # defined below: built on first use
        description="a run spec's [trust] table; the simulator aggregates as the run would "
        "(aggregation, trim_fraction, clip_factor), the rest is for networked runs",
    )
    peer: PeerConfig = Field(
        PeerConfig(device="cpu"),
        description="device, precision and torch.compile of the simulated peers (the CPU "
        "unless asked: a simulation's records then repeat bit for bit on any machine)",
    )

    @model_serializer(mode="wrap")
    def _dump_peer(self, handler: Any) -> dict[str, Any]:
        return _without_default_peer(self, handler(self))

    @model_validator(mode="before")
    @classmethod
    def _default_method(cls, data: Any) -> Any:
        return _default_algorithm(data)

    @model_validator(mode="after")
    def _enough_steps(self) -> SimConfig:
        per_round = steps_per_round(self.algorithm)
        if self.steps < per_round:
            raise ValueError(f"steps ({self.steps}) is fewer than one round ({per_round} steps)")
        if self.churn.min_workers > self.workers:
            raise ValueError(
                f"churn.min_workers ({self.churn.min_workers}) exceeds workers ({self.workers})"
            )
        return self

    @property
    def rounds(self) -> int:
        return self.steps // steps_per_round(self.algorithm)

    def config_hash(self) -> str:
        return config_hash(self)


def _default_algorithm(data: Any) -> Any:
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


def load_sim_config(path: str | Path | None = None, **overrides: Any) -> SimConfig:
    data = load_toml(path) if path else {}
    return SimConfig.model_validate(merge(data, overrides))


# --- networked runs ---------------------------------------------------------------------


class RoundsConfig(Frozen):
    """How the coordinator paces rounds (../shared/DESIGN.md, "The round"). Every wait in a
    round is bounded by a field here."""

    heartbeat_s: float = Field(2.0, gt=0, description="peers heartbeat this often")
    dead_after_s: float = Field(6.0, gt=0, description="a peer silent this long is dead")
    target_compute_s: float = Field(
        10.0, gt=0, description="compute one round aims for; caps a slow peer's inner steps"
    )
    deadline_slack: float = Field(
        2.0, ge=1, description="deadline = slack x the slowest expected compute + transfers"
    )
    deadline_min_s: float = Field(5.0, gt=0, description="a round's deadline is at least this")
    deadline_max_s: float = Field(300.0, gt=0, description="... and at most this")
    min_peers: int = Field(1, ge=1, description="a round opens once this many peers are live")
    max_rounds: int | None = Field(
        None, ge=1, description="stop after this many committed rounds; none = until stopped"
    )
    checkpoint_every: int = Field(5, ge=1, description="K: keep a checkpoint every K rounds")
    keep_checkpoints: int = Field(3, ge=1, description="checkpoints kept on disk")
    eval_every: int = Field(1, ge=1, description="evaluate the canonical state every N rounds")
    eval_batches: int = Field(4, ge=1, description="held-out batches per evaluation")
    samples_every: int = Field(
        5, ge=0, description="refresh the status page's samples every N rounds; 0 = none"
    )
    sample_prompts: tuple[str, ...] = Field(
        ("def ", "import ", "The "),
        max_length=8,
        description="prompts the status page shows the model's continuations of",
    )
    sample_tokens: int = Field(40, ge=1, le=256, description="tokens generated per prompt")
    bandwidth_mbps: float = Field(
        100.0, gt=0, description="assumed link speed for peers that report none"
    )
    lease_s: float = Field(
        20.0,
        gt=0,
        description="a worker's participation lease: every accepted heartbeat renews it, and "
        "a worker whose lease ran out stops training until one is accepted again",
    )

    @model_validator(mode="after")
    def _ordered(self) -> RoundsConfig:
        if self.dead_after_s <= self.heartbeat_s:
            raise ValueError(
                f"dead_after_s ({self.dead_after_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        if self.lease_s <= self.heartbeat_s:
            raise ValueError(
                f"lease_s ({self.lease_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        if self.deadline_max_s < self.deadline_min_s:
            raise ValueError(
                f"deadline_max_s ({self.deadline_max_s}) is below deadline_min_s "
                f"({self.deadline_min_s})"
            )
        return self


class LimitsConfig(Frozen):
    """Request-size limits and the peers' patience: bad or huge input is refused early."""

    max_json_bytes: int = Field(256 << 10, ge=1024, description="largest JSON request body")
    max_blob_bytes: int = Field(1 << 30, ge=1024, description="largest blob a peer may upload")
    request_timeout_s: float = Field(30.0, gt=0, description="per HTTP request")
    retries: int = Field(4, ge=1, description="attempts per request before giving up on it")
    chunk_bytes: int = Field(
        4 << 20, ge=4096, description="blobs larger than this are fetched in parallel ranges"
    )
    coordinator_lost_s: float = Field(
        120.0, gt=0, description="a worker exits after this long without reaching the coordinator"
    )
    # -- the coordinator's defences against cheap requests (covey/coordinator/limits.py) --
    body_timeout_s: float = Field(
        10.0, gt=0, description="a request body must arrive within this (plus size/min rate)"
    )
    min_upload_bytes_s: int = Field(
        64 << 10, ge=1024, description="slowest accepted body rate, bytes/s; slower is cut off"
    )
    keep_alive_s: float = Field(
        5.0, gt=0, description="an idle keep-alive connection is closed after this long"
    )
    max_connections: int = Field(
        1024, ge=16, description="concurrent connections; more are answered 503"
    )
    peer_rate: float = Field(20.0, gt=0, description="sustained requests/s per peer id")
    peer_burst: int = Field(40, ge=1, description="requests a peer id may send at once")
    address_rate: float = Field(
        200.0, gt=0, description="sustained requests/s per client address (all its peers)"
    )
    address_burst: int = Field(400, ge=1, description="requests an address may send at once")
    join_rate: float = Field(
        1.0, gt=0, description="sustained joins/s per client address (each writes the ledger)"
    )
    join_burst: int = Field(20, ge=1, description="joins an address may send at once")
    max_long_polls: int = Field(
        256, ge=1, description="long-polls held at once, of each kind (certificate, round)"
    )
    max_long_polls_per_peer: int = Field(
        2, ge=1, description="long-polls held at once for one peer id (or one address: x16)"
    )
    max_pending_uploads: int = Field(
        4, ge=1, description="blobs a peer uploaded that no submission or report names yet"
    )
    no_show_backoff_s: float = Field(
        30.0, ge=0, description="a repeated no-show sits out rounds this long, doubling"
    )
    no_show_backoff_max_s: float = Field(
        3600.0, ge=0, description="the longest a no-show is left out of rounds"
    )


class TrustConfig(Frozen):
    """Verification, robust aggregation and incentives (../shared/DESIGN.md, "Trust",
    "Incentives"). Amounts are in the run's credits; everything is derived from the ledger."""

    min_stake: float = Field(0.0, ge=0, description="credits a peer must stake to join")
    sample_rate: float = Field(
        0.25, ge=0, le=1, description="share of accepted contributions validators re-execute"
    )
    new_peer_rate: float = Field(
        1.0, ge=0, le=1, description="sampling rate for new and low-reputation peers"
    )
    new_peer_contributions: int = Field(
        3, ge=0, description="a peer is new until this many of its contributions were accepted"
    )
    low_reputation: float = Field(
        0.5, ge=0, le=1, description="below this reputation a peer is sampled as a new one"
    )
    commit_every: int = Field(
        10, ge=1, description="k: a contribution commits to its state every k inner steps"
    )
    tolerance: float = Field(
        0.02,
        gt=0,
        description="relative distance within which a re-execution agrees (calibrated: "
        "see BENCHMARKS.md, covey bench trust)",
    )
    aggregation: Literal["mean", "trimmed_mean", "median"] = Field(
        "trimmed_mean", description="how contributions combine after clipping"
    )
    trim_fraction: float = Field(
        0.25, ge=0, lt=0.5, description="trimmed mean: share dropped at each end per coordinate"
    )
    clip_factor: float = Field(
        2.0, ge=0, description="clip each contribution's norm to this x the round's median; 0 = off"
    )
    reward_per_token: float = Field(0.001, ge=0, description="credits per verified token")
    slash_fraction: float = Field(
        0.5, ge=0, le=1, description="share of stake lost on proven fraud (and excluded)"
    )
    catch_reward: float = Field(10.0, ge=0, description="credits to a validator per proven catch")
    challenge_rounds: int = Field(
        2, ge=0, description="a contribution is paid this many rounds after it, unless disputed"
    )
    verify_timeout_s: float = Field(
        120.0, gt=0, description="a claimed verification not reported in time goes back"
    )
    nonce_window_s: float = Field(
        300.0, gt=0, description="signed requests older (or newer) than this are refused"
    )
    min_validator_stake: float = Field(
        0.0, ge=0, description="credits a validator must stake to join (and so to check)"
    )
    validator_slash_fraction: float = Field(
        0.2,
        ge=0,
        le=1,
        description="share of its stake a validator loses for a false accusation (the "
        "referee found it wrong) or for agreeing with a canary",
    )
    check_reward: float = Field(
        0.1,
        ge=0,
        description="credits to a validator per completed assigned check (a report that "
        "was accepted); never for holding a check it did not report",
    )
    dispute_attempts: int = Field(
        3,
        ge=1,
        description="times the referee tries a dispute whose judging raised, before it is "
        "closed 'inconclusive' (nobody slashed)",
    )
    validators_per_check: int = Field(
        2,
        ge=1,
        description="k: validators that each check a sampled contribution of a new or "
        "low-reputation peer (others: one); fewer when fewer validators are eligible",
    )
    validator_round_cap: int = Field(
        8,
        ge=1,
        description="most checks one validator is assigned per round (a single key cannot "
        "hold every check)",
    )
    canary_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="chance per round per validator that the coordinator plants a canary "
        "among its checks (an accepted contribution's payload sign-flipped): agreeing with "
        "one costs validator_slash_fraction of stake and the check's pay",
    )
    # sharded aggregation (issue 13 §1, covey/coordinator/sharding.py)
    sharded_above_peers: int | None = Field(
        16,
        ge=0,
        description="a DiLoCo round with at least this many accepted contributions is "
        "aggregated shard by shard by staked validators that run --aggregate (none ready: "
        "the coordinator aggregates as below it); 0 or None = never. 16: the measured byte "
        "crossover per worker (micro model, int4; covey bench shards)",
    )
    shards: int = Field(16, ge=1, description="parameter shards of sharded aggregation")
    shard_check_rate: float = Field(
        0.25, ge=0, le=1, description="share of shards re-aggregated by a second aggregator"
    )
    shard_publish_timeout_s: float = Field(
        30.0,
        gt=0,
        description="an aggregator silent this long loses its shard to the next; twice "
        "this after the round closed, the coordinator finishes what is left itself",
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        names = ("sharded_above_peers", "shards", "shard_check_rate", "shard_publish_timeout_s")
        return _drop_defaults(self, handler(self), names)


class RunConfig(Frozen):
    """A training run served by `covey coordinator`. Its hash is the run id, and the hash
    covers the coordinator's public key: a peer given the run id trusts no other
    coordinator (no trust on first use)."""

    name: str = Field("covey-run", min_length=1, max_length=80, description="display name")
    coordinator_key: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="the coordinator's Ed25519 public key (hex), which signs certificates, "
        "ledger entries and draws; empty: `covey coordinator` fills in the key of its data "
        "dir, and refuses a spec that names another",
    )
    owner_key: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="the Ed25519 public key (hex) of the run's owner, who may stop it with "
        "`covey halt`; empty: the coordinator's key is the owner's",
    )
    seed: int = Field(0, description="seeds the model's initial weights and the data")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    algorithm: AlgorithmConfig = DiLoCoConfig()
    rounds: RoundsConfig = RoundsConfig()
    limits: LimitsConfig = LimitsConfig()
    trust: TrustConfig = TrustConfig()
    peer: PeerConfig = PeerConfig()

    @model_serializer(mode="wrap")
    def _dump_peer(self, handler: Any) -> dict[str, Any]:
        return _without_default_peer(self, handler(self))

    @model_validator(mode="before")
    @classmethod
    def _default_method(cls, data: Any) -> Any:
        return _default_algorithm(data)

    @property
    def run_id(self) -> str:
        """The hash of the spec alone. The id a run is known by also covers its data: see
        `run_id_of`."""
        return config_hash(self)

    def with_coordinator_key(self, key: str) -> RunConfig:
        """This spec bound to the coordinator holding `key`: the field filled in when
        empty. ValueError when the spec names another coordinator's key."""
        if self.coordinator_key is None:
            return RunConfig.model_validate({**self.model_dump(), "coordinator_key": key})
        if self.coordinator_key != key:
            raise ValueError(
                f"the spec's coordinator_key {self.coordinator_key[:16]}... is not this "
                f"coordinator's key {key[:16]}... (from its data dir): another coordinator's "
                f"run, or the wrong --data-dir"
            )
        return self


def run_id_of(spec: RunConfig, data_fingerprint: str) -> str:
    """The run id: a hash of the spec (which names the coordinator's key) and of the
    fingerprint of its tokenized data (covey.data.corpus.Corpus.fingerprint), so two runs
    with one spec on different data have different ids, and a peer handed the id refuses a
    coordinator serving other data before it trains. The coordinator, `LocalCluster` and
    every peer's `--run-id` check compute it here. ValueError for a fingerprint that is not
    a lowercase hex digest."""
    if not re.fullmatch(r"[0-9a-f]{16,64}", data_fingerprint):
        raise ValueError(f"data fingerprint {data_fingerprint!r} is not a hex digest")
    body = {"spec": spec.model_dump(mode="json"), "data_fingerprint": data_fingerprint}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def to_toml(spec: dict[str, Any]) -> str:
    """A nested dict of scalars as TOML: how `covey demo` and `covey bench network` write
    the run specs they generate (scalars first, then one [table] per dict).
    None values are left out: TOML has no null, and the field's default is meant."""
    lines: list[str] = []

    def emit(table: dict[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) and v is not None}
        tables = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix and scalars:
            lines.append(f"\n[{prefix}]")
        for key, value in scalars.items():
            lines.append(f"{key} = {_toml_value(value)}")
        for key, sub in tables.items():
            emit(sub, f"{prefix}.{key}" if prefix else key)

    emit(spec, "")
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def load_run_config(path: str | Path | None = None, **overrides: Any) -> RunConfig:
    data = load_toml(path) if path else {}
    return RunConfig.model_validate(merge(data, overrides))
