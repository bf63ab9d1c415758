"""The two kinds of run spec: `SimConfig` (covey sim) and `RunConfig` (a networked run), their
loaders from TOML with flag overrides, the run id and the TOML writer."""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    model_serializer,
    model_validator,
)

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover
    pass


from covey.config.networked import (
    LimitsConfig,
    MembershipConfig,
    RoundsConfig,
    TrustConfig,
    deterrent_stake,
)
from covey.config.parts import (
    AlgorithmConfig,
    ChurnConfig,
    ComputeConfig,
    DataConfig,
    DiLoCoConfig,
    Frozen,
    ModelConfig,
    NetworkConfig,
    PeerConfig,
    config_hash,
    default_algorithm,
    load_toml,
    merge,
    steps_per_round,
)


def _without_default_peer(model: SimConfig | RunConfig, dumped: dict[str, Any]) -> dict[str, Any]:
    """A spec's dump without a default [peer] table: specs written before the [peer] table
    existed keep their hash, so their run ids and sim checkpoints. The default's
    verify_device "auto" fixed to "cpu" (covey.spec.fix_run_compute on a machine without a
    GPU) is the default of before, so it is left out too."""
    default = type(model).model_fields["peer"].default
    if dumped.get("peer") is not None and model.peer in (
        default,
        default.model_copy(update={"verify_device": "cpu"}),
    ):
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
        return default_algorithm(data)

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


def load_sim_config(path: str | Path | None = None, **overrides: Any) -> SimConfig:
    data = load_toml(path) if path else {}
    return SimConfig.model_validate(merge(data, overrides))


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
        return default_algorithm(data)

    def round_pay(self, seq_len: int) -> float:
        """The most one contribution can be paid: reward_per_token x the tokens its round's
        steps make at `seq_len` (the intake refuses a claim of more: covey.coordinator.intake)."""
        steps = steps_per_round(self.algorithm)  # type: ignore[arg-type]
        return self.trust.reward_per_token * steps * self.data.batch_size * seq_len

    def min_stake(self, seq_len: int) -> float:
        """The stake a worker must hold to join: trust.min_stake, or when it is unset the
        least at which cheating one round has a negative expected value at the run's
        sample_rate and slash_fraction (`deterrent_stake` of `round_pay`, in
        whole credits, rounded up).
        `seq_len`: the run's context (data.seq_len or the model's)."""
        if self.trust.min_stake is not None:
            return self.trust.min_stake
        t = self.trust
        return float(
            math.ceil(deterrent_stake(t.sample_rate, t.slash_fraction, self.round_pay(seq_len)))
        )

    def membership(self) -> MembershipConfig:
        """What the host's membership reads of this spec (its rounds, trust and limits)."""
        return MembershipConfig.of(self.rounds, self.trust, self.limits)

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
