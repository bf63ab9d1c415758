"""An RL run's spec: the rules every role reads from the trainer and never from a batch.

`RLSpec` is frozen and hashed into the run id together with the model config, the first
policy's content id and the trainer's public key, so a worker handed a run id refuses a
trainer serving another run. It says which task (built-in arithmetic or JSONL prompts with
a `py:` reward), how rollouts are drawn (prompts per step, G, temperature, token budget,
eos), how the trainer learns (async_level, samples per step) and verifies (prefill checks
per batch, audit rate, deadlines), and the incentive rules its ledger is created with.

Verification across devices (docs/gpus.md): GPUs do not round like CPUs, and RL's checks
(prefill logprobs against a worker's proofs, the tolerances of covey.rl.proofs) were
calibrated on CPU in fp32. `verify_device` names the device class every check of the run
runs on (validators, the trainer's re-checks and audits), `verify_precision` its
precision; a peer of another class refuses to judge rather than convict honest work for
rounding (`verify_refusal`), and a worker's `--device auto` means that class
(`peer_device`). Both enter the run id only when not the default, so runs created before
they existed keep their ids.

The `limits` table is the host's `LimitsConfig` (rates, body deadline, connections), its
`max_json_bytes` always the spec's `max_batch_bytes`. A table holding what the trainer used
before the spec had one (`default_limits`) is left out of the dump, so of the run id.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from covey.config import FundsConfig, LimitsConfig, MembershipConfig
from covey.config.networked import body_limit_matches, limits_before, without_default_limits
from covey.coordinator.rejected import Rejected
from covey.devices import (
    DeviceError,
    RefereeCompute,
    device_class,
    device_name,
    referee_compute,
    resolve_device,
    verification_mismatch,
)
from covey.rl.batch import RolloutSpec
from covey.rl.tasks import ArithmeticTask, JsonlTask, Task
from covey.trust.policy import Policy, unbonding_delay

log = logging.getLogger("covey.rl.runspec")
# fields hashed into the run id only when they differ from these (older runs' ids stand)
_HASHED_IF_SET = {"verify_device": "cpu", "verify_precision": "fp32"}


class TaskSpec(BaseModel):
    """Which task: `arithmetic` (its generator's parameters) or `jsonl` (path + reward)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["arithmetic", "jsonl"] = "arithmetic"
    seed: int = 0
    max_operand: int = Field(99, ge=1, le=10_000)
    ops: str = "+"
    format_reward: float = Field(0.0, ge=0, le=1)
    path: str = ""
    reward: str = ""

    def build(self) -> Task:
        if self.kind == "arithmetic":
            return ArithmeticTask(
                seed=self.seed,
                max_operand=self.max_operand,
                ops=self.ops,
                format_reward=self.format_reward,
            )
        return JsonlTask(self.path, self.reward)


class RLSpec(BaseModel):
    """The run's rules. Every field is part of the run id."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field("rl", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    task: TaskSpec = TaskSpec()
    prompts_per_step: int = Field(2, ge=1, le=256, description="prompts per worker batch")
    group_size: int = Field(8, ge=2, le=64, description="G samples per prompt")
    temperature: float = Field(1.0, gt=0, le=10)
    max_new_tokens: int = Field(6, ge=1, le=512)
    eos_id: int | None = Field(10, description="newline ends a completion; None: fixed length")
    async_level: int = Field(2, ge=0, le=64, description="batches at most this stale train")
    samples_per_step: int = Field(16, ge=1, description="verified samples a trainer step needs")
    verify_samples: int = Field(
        2,
        ge=1,
        description="sequences per batch whose proofs the validator checks (every sequence's "
        "tokens and logprobs are checked against its prefill)",
    )
    audit_rate: float = Field(0.1, ge=0, le=1, description="accepted batches the trainer re-checks")
    verify_timeout_s: float = Field(60.0, gt=0, description="an unreported check is reassigned")
    lr: float = Field(2e-4, gt=0, description="AdamW; covey.rl.learn.DEFAULT_LR, bench's too")
    eval_prompts: int = Field(64, ge=1, description="held-out prompts for pass@1")
    eval_every: int = Field(5, ge=1, description="trainer steps between pass@1 evaluations")
    max_batch_bytes: int = Field(4 << 20, ge=1024, description="largest batch submission")
    heartbeat_s: float = Field(2.0, gt=0)
    dead_after_s: float = Field(6.0, gt=0)
    min_stake: float = Field(1.0, ge=0)
    min_validator_stake: float = Field(10.0, ge=0)
    reward_per_token: float = Field(0.001, ge=0)
    slash_fraction: float = Field(0.5, ge=0, le=1)
    catch_reward: float = Field(1.0, ge=0)
    check_reward: float = Field(0.01, ge=0)
    validator_slash_fraction: float = Field(0.2, ge=0, le=1)
    validator_round_cap: int = Field(
        8,
        ge=1,
        description="most batches of one policy version a validator claims; the next-ranked "
        "validator (or, past verify_timeout_s, the trainer) checks the rest",
    )
    canary_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description="chance per step that a house worker's batch (the run owner's, covey rl "
        "worker --house-of) is a canary, bad in every sample (covey.rl.canaries): the "
        "validator that passes one pays a missed fraud, validator_slash_fraction of its stake",
    )

    verify_device: Literal["cpu", "cuda", "mps"] = Field(
        "cpu",
        description="device class every check runs on (validators, the trainer's re-checks "
        "and audits); cpu: the class RL's proof tolerances are calibrated on",
    )
    verify_precision: Literal["fp32"] = Field(
        "fp32",
        description="precision of sampling and checks: fp32 only (RL's rollouts and prefill "
        "checks do not autocast; the trainer's learning step may, with --precision)",
    )
    trust: FundsConfig = Field(
        default_factory=FundsConfig,
        description="the run's treasury at start ([trust.funds]: public key -> credits): a "
        "worker or validator bonds only credits it holds (docs/trust.md, Stake is held)",
    )
    limits: LimitsConfig = Field(
        default_factory=lambda: default_limits(RLSpec.model_fields["max_batch_bytes"].default),
        description="the trainer's HTTP limits (rates per peer and address, joins, body "
        "deadline, connections); max_json_bytes is max_batch_bytes",
    )

    @model_validator(mode="before")
    @classmethod
    def _limits_of_batch(cls, data: Any) -> Any:
        return limits_before(cls, data, "max_batch_bytes", default_limits)

    @model_serializer(mode="wrap")
    def _dump_limits(self, handler: Any) -> dict[str, Any]:
        dumped = without_default_limits(
            handler(self), self.limits, default_limits(self.max_batch_bytes)
        )
        if not self.trust.funds:  # added later: a run that grants nothing keeps its id
            dumped.pop("trust", None)
        return dumped

    @model_validator(mode="after")
    def _consistent(self) -> RLSpec:
        if self.dead_after_s <= self.heartbeat_s:
            raise ValueError(
                f"dead_after_s ({self.dead_after_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        if self.task.kind == "jsonl" and not (self.task.path and self.task.reward):
            raise ValueError("a jsonl task needs task.path and task.reward (py:<mod>:<fn>)")
        body_limit_matches(self.limits, "max_batch_bytes", self.max_batch_bytes)
        return self


def default_limits(max_batch_bytes: int) -> LimitsConfig:
    """The limits a trainer serves with unless its spec says otherwise: the host's
    defaults, with the largest batch as the largest request body."""
    return LimitsConfig(max_json_bytes=max(1024, max_batch_bytes))


def run_id_of(spec: RLSpec, model_cfg: dict[str, Any], policy_cid: str, trainer_key: str) -> str:
    """16 hex digits of sha256 over the spec, the model, the first policy and the trainer.
    The verify device class and precision are left out at their defaults (cpu, fp32), so
    a run's id is what it was before the spec had them."""
    dumped = spec.model_dump(mode="json")
    for field, default in _HASHED_IF_SET.items():
        if dumped.get(field) == default:
            del dumped[field]
    body = {
        "spec": dumped,
        "model": model_cfg,
        "policy0": policy_cid,
        "trainer_key": trainer_key,
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rollout_spec(spec: RLSpec, run_id: str, vocab_size: int) -> RolloutSpec:
    """The batch checks' view of the run (covey.rl.batch)."""
    return RolloutSpec(
        run_id=run_id,
        prompts_per_step=spec.prompts_per_step,
        group_size=spec.group_size,
        temperature=spec.temperature,
        max_new_tokens=spec.max_new_tokens,
        vocab_size=vocab_size,
        eos_id=spec.eos_id,
    )


def ledger_policy(spec: RLSpec) -> Policy:
    """The incentive rules of the run's ledger ("run created"). Every batch is checked
    before it is accepted, so no accepted batch is "sampled" for a later check."""
    return Policy(
        min_stake=spec.min_stake,
        reward_per_token=spec.reward_per_token,
        slash_fraction=spec.slash_fraction,
        catch_reward=spec.catch_reward,
        new_peer_rate=1.0,
        new_peer_contributions=0,
        low_reputation=0.0,
        sample_rate=1.0,
        min_validator_stake=spec.min_validator_stake,
        validator_slash_fraction=spec.validator_slash_fraction,
        check_reward=spec.check_reward,
        validator_round_cap=spec.validator_round_cap,
        canary_rate=spec.canary_rate,
        held_stake=1,
        unbonding_s=unbonding_s(spec),
    )


def unbonding_s(spec: RLSpec) -> float:
    """How long a leaving key's stake stays bonded (covey.trust.treasury): the longest a
    slash can take to reach it after its last batch. Every batch is judged before it is
    accepted, so RL's longest "round" is one batch's check: 5 x verify_timeout_s: the
    batch waits at most verify_timeout_s for a validator to claim it (else the trainer
    checks it), a claim is held at most verify_timeout_s, an expired claim goes to another
    validator (its wait and claim again, 2 x), and the trainer's own re-check, audit or
    canary reveal at the report (one more). covey.trust.policy.unbonding_delay with one
    validator per check, no challenge rounds and one referee try."""
    return unbonding_delay(
        round_s=0.0,
        challenge_rounds=0,
        verify_timeout_s=spec.verify_timeout_s,
        validators_per_check=1,
        dispute_attempts=1,
    )


def membership_config(spec: RLSpec) -> MembershipConfig:
    """What the host's membership (covey.coordinator.membership) reads, from the RL spec:
    the liveness here, a lease of three heartbeats (past dead_after_s); the stakes to join
    are the run's policy (`ledger_policy`)."""
    return MembershipConfig(
        heartbeat_s=spec.heartbeat_s,
        dead_after_s=spec.dead_after_s,
        lease_s=max(3 * spec.heartbeat_s, spec.dead_after_s + 1),
    )


class VerifyRefused(RuntimeError):
    """A peer whose device cannot judge the run's batches (another device class or
    precision than the spec's `verify_device` / `verify_precision`)."""


class NotJudged(Rejected):
    """The trainer cannot recompute a verdict here (it lacks the run's verify class): the
    batch stays undecided (409 to a validator reporting on it; nobody is paid or
    penalized for it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(409, f"not judged: {reason}")


def verify_refusal(spec: RLSpec, device: torch.device | str, precision: str = "fp32") -> str | None:
    """Why a peer computing on `device` in `precision` must not judge this run's batches,
    or None when it may (covey.devices.verification_mismatch against the spec's class)."""
    return verification_mismatch(spec.verify_device, spec.verify_precision, device, precision)


def verify_compute(spec: RLSpec, device: str | None = None) -> RefereeCompute:
    """Where the trainer re-checks and audits batches: the run's verify class (cuda means
    cuda:0), or a `refusal` when this machine has none; then it judges nothing. `device`
    is resolved as covey.devices.resolve_device does (DeviceError when malformed or
    absent) and refused when of another class."""
    return referee_compute(spec.verify_device, spec.verify_precision, device)


def peer_device(spec: RLSpec, setting: str, role: str = "worker") -> torch.device:
    """The device a worker or validator computes on. `setting` "auto": the run's verify
    class (cuda: cuda:0), DeviceError naming it when this machine has none (a validator:
    VerifyRefused); any other
    setting: covey.devices.resolve_device's device. A worker on another class than the
    run's is warned (honest work may fail the checks); a validator on one raises
    VerifyRefused, before it claims anything."""
    auto = setting.strip().lower() == "auto"
    try:
        where = resolve_device(spec.verify_device if auto else setting)
    except DeviceError as e:
        if role == "validator" and auto:
            raise VerifyRefused(
                f"refusing to validate: this run verifies on {spec.verify_device}, which "
                f"this machine lacks: {e}"
            ) from None
        if auto:
            raise DeviceError(
                f"--device auto means this run's verify class, {spec.verify_device}: {e}; "
                f"pass --device cpu to generate elsewhere (warned)"
            ) from None
        raise
    if role == "validator":
        reason = verify_refusal(spec, where)
        if reason is not None:
            raise VerifyRefused(f"refusing to validate: {reason}")
    elif device_class(where) != spec.verify_device:
        log.warning(
            "this run verifies on %s; this worker generates on %s (%s): its batches are "
            "checked on %s, where rounding differs, so honest work may fail the checks "
            "and be slashed. Use --device auto (the run's class) to avoid it",
            spec.verify_device,
            device_class(where),
            device_name(where),
            spec.verify_device,
        )
    return where
