"""The serving run's spec: a frozen pydantic model (TOML table [serve] or flags), hashed
with the model's content id and the coordinator's key into the run id."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from covey.config import LimitsConfig, MembershipConfig, TrustConfig
from covey.trust.ledger import LedgerError
from covey.trust.policy import Policy, unbonding_delay
from covey.trust.treasury import check_spec_hash, mode_table

# the lowest temperature served: seeded Gumbel-max needs T > 0, and below this the
# scaled logits' float noise between a worker and a validator nears the check's tolerance
MIN_TEMPERATURE = 0.05


class ServeConfig(BaseModel):
    """What a `covey serve` run promises its users and its workers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field("serve", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="model name")
    max_tokens: int = Field(256, ge=1, le=4096, description="largest max_tokens of a request")
    max_prompt_tokens: int = Field(
        1024, ge=1, le=65536, description="longest prompt (after the chat template), in tokens"
    )
    request_timeout_s: float = Field(
        60.0, gt=0, description="a request not answered by a worker in this long gets a 504"
    )
    queue_per_worker: int = Field(
        2, ge=0, description="requests waiting per live worker before new ones get a 429"
    )
    worker_slots: int = Field(
        4,
        ge=1,
        le=64,
        description="most requests one worker answers at a time: each of its slots pulls "
        "one request, answers it (seeded by that request alone) and pulls again",
    )
    pull_wait_s: float = Field(
        5.0, gt=0, le=60, description="a worker's long-poll for a request waits this long"
    )
    stream_segment: int = Field(
        8,
        ge=1,
        le=256,
        description="a streamed answer comes from its worker this many tokens "
        "at a time (each segment seeded on its own: covey.serve.checks.segment_seed)",
    )
    verify_rate: float = Field(
        0.1, ge=0, le=1, description="share of an established worker's answers re-checked"
    )
    new_worker_rate: float = Field(
        1.0, ge=0, le=1, description="share re-checked of a new or low-reputation worker's"
    )
    new_worker_answers: int = Field(
        3, ge=0, description="a worker is new until this many of its answers were paid"
    )
    claim_timeout_s: float = Field(
        30.0, gt=0, description="a validator's claim on an answer lapses after this long"
    )
    heartbeat_s: float = Field(1.0, gt=0, description="peers heartbeat this often")
    dead_after_s: float = Field(4.0, gt=0, description="a peer silent this long is dead")
    min_stake: float = Field(0.0, ge=0, description="credits a worker stakes to join")
    min_validator_stake: float = Field(0.0, ge=0, description="credits a validator stakes")
    trust: TrustConfig = Field(
        default_factory=TrustConfig,
        description="incentives: reward_per_token, slash_fraction, check and catch rewards",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="request limits")

    @model_validator(mode="after")
    def _ordered(self) -> ServeConfig:
        if self.dead_after_s <= self.heartbeat_s:
            raise ValueError(
                f"dead_after_s ({self.dead_after_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        return self

    def membership_config(self) -> MembershipConfig:
        """What the host's membership reads: liveness and a lease of three beats (the stakes
        to join are the run's policy)."""
        return MembershipConfig(
            heartbeat_s=self.heartbeat_s,
            dead_after_s=self.dead_after_s,
            lease_s=max(3 * self.heartbeat_s, self.dead_after_s + 1),
        )

    def policy(self) -> Policy:
        """The ledger's incentive policy ("run created"), from the trust table: a key bonds
        only what it holds (the treasury: `trust.funds`, the owner's deposits, pay earned)
        and unbonds after `unbonding_s`."""
        rules = Policy.from_config(self.trust, held_stake=True).to_dict()
        return Policy.from_dict({**rules, "unbonding_s": self.unbonding_s()})

    def unbonding_s(self) -> float:
        """How long a leaving key's stake stays bonded (covey.trust.treasury): the longest
        a slash can take to reach it after its last answer. The answer comes within
        request_timeout_s; a drawn one is checked by a claim held at most
        claim_timeout_s, a lapsed claim goes to another validator (its claim again,
        2 x), and the referee's re-check of a rejection or a canary's reveal at the report
        counts as one more: request_timeout_s + 5 x claim_timeout_s (covey.trust.policy.
        unbonding_delay with one validator per check and one referee try)."""
        return unbonding_delay(
            round_s=self.request_timeout_s,
            challenge_rounds=0,
            verify_timeout_s=self.claim_timeout_s,
            validators_per_check=1,
            dispute_attempts=1,
        )


def run_id_of(cfg: ServeConfig, model_cid: str, coordinator_key: str) -> str:
    """16 hex digits of sha256 over the spec, the served model's content id and the key."""
    body = {"serve": cfg.model_dump(mode="json"), "model": model_cid, "key": coordinator_key}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ledger_terms(entries: Sequence[Any]) -> Policy | None:
    """`covey ledger verify`: the policy a serving run's spec gives (`ServeConfig.policy`,
    held stake and its unbonding period), None for a ledger of another mode. LedgerError
    when the spec does not hash to the run id with the model and the coordinator's key
    (a coordinator cannot write other terms or other funds than it served)."""
    found = mode_table(entries, "serve")
    if found is None:
        return None
    created, table = found
    try:
        cfg = ServeConfig.model_validate(table)
    except ValidationError as e:
        raise LedgerError(0, f"run created: not a serving spec ({str(e)[:200]})") from None
    model, key = str(created["spec"].get("model")), str(created.get("coordinator_key"))
    check_spec_hash(created, run_id_of(cfg, model, key))
    return cfg.policy()
