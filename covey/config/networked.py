"""The tables of a networked run's spec: how the coordinator paces rounds (`RoundsConfig`),
what it accepts from peers (`LimitsConfig`) and the incentive rules (`TrustConfig`)."""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover
    pass


from covey.config.parts import Frozen, drop_defaults

# --- networked runs ---------------------------------------------------------------------


class RoundsConfig(Frozen):
    """How the coordinator paces rounds. Every wait in a round is bounded by a field here."""

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


def derived_limits(data: Any, derived: dict[str, Any]) -> Any:
    """A spec's fields before validation with its [limits] table's fields that are unset
    taken from `derived`: how a mode whose body size is a field of its own (RL's
    max_batch_bytes, SWARM's max_body_bytes) gives its table the values its app has always
    used. A table given as a `LimitsConfig` keeps only the fields it was built with; one of
    another type is left for the model to refuse, naming it."""
    if not isinstance(data, dict):
        return data
    given = data.get("limits", {})
    if isinstance(given, LimitsConfig):
        given = given.model_dump(exclude_unset=True)
    if not isinstance(given, dict):
        return data
    return {**data, "limits": {**derived, **given}}


def limits_before(
    cls: Any, data: Any, field: str, default_limits: Callable[[int], LimitsConfig]
) -> Any:
    """The before-validator of a mode whose body size is its spec's `field` (RL's
    max_batch_bytes, SWARM's max_body_bytes): the [limits] table's unset fields from
    `default_limits(size)` (`derived_limits`). A size that is not a number is left for the
    field's own check to name."""
    if not isinstance(data, dict):
        return data
    try:
        size = int(data.get(field, cls.model_fields[field].default))
    except (TypeError, ValueError):
        return data
    return derived_limits(data, default_limits(size).model_dump())


def without_default_limits(
    dumped: dict[str, Any], limits: LimitsConfig, default: LimitsConfig
) -> dict[str, Any]:
    """A dumped spec without its [limits] table when the table is the mode's default: runs
    made before the table existed keep their ids."""
    if limits == default:
        dumped.pop("limits", None)
    return dumped


def body_limit_matches(limits: LimitsConfig, field: str, size: int) -> None:
    """ValueError unless `limits.max_json_bytes` is the mode's own body size `size` (its
    spec's `field`): one request-size limit, named in one place."""
    if limits.max_json_bytes != size:
        raise ValueError(
            f"limits.max_json_bytes ({limits.max_json_bytes}) differs from {field} ({size}): "
            f"the largest request body is {field}; set that instead"
        )


FUNDS_HELP = (
    "the run's treasury at start: public key (hex) -> credits deposited to it when the run "
    'is created (a "deposit" entry each); a key stakes only what it holds (docs/trust.md, '
    "Stake is held). More later: covey ledger deposit"
)


def check_funds(funds: dict[str, float]) -> dict[str, float]:
    """`funds` if every key is a public key (64 hex digits) granted a positive finite
    amount; ValueError naming the first that is not."""
    for key, amount in funds.items():
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"funds: {key[:70]!r} is not a public key (64 hex digits)")
        if not math.isfinite(amount) or amount <= 0:
            raise ValueError(f"funds: key {key[:16]}... gets {amount}: a positive amount")
    return funds


def deterrent_stake(sample_rate: float, slash_fraction: float, round_pay: float) -> float:
    """The least stake S at which one cheated round's expected value is negative: a cheat
    drawn (rate p) loses f x S of its stake and the round's pay; undrawn (1 - p) it keeps
    the pay and saves its compute, worth at most the pay R, so at most (1 - p) x 2R - p f S,
    negative from S = 2R(1 - p) / (p f) (docs/trust.md). 0 when p or f is 0: a run that
    checks or slashes nothing has no stake that deters, only exclusion; 0 when p is 1."""
    if sample_rate <= 0 or slash_fraction <= 0:
        return 0.0
    return 2 * round_pay * (1 - sample_rate) / (sample_rate * slash_fraction)


class FundsConfig(Frozen):
    """The `[trust]` table of the modes whose incentive rules are their own fields (RL,
    SWARM): the run's treasury at start, as the rounds mode's `trust.funds`."""

    funds: dict[str, float] = Field({}, description=FUNDS_HELP)

    @field_validator("funds")
    @classmethod
    def _funds_are_keys(cls, funds: dict[str, float]) -> dict[str, float]:
        return check_funds(funds)


class TrustConfig(Frozen):
    """Verification, robust aggregation and incentives. Amounts are in the run's credits;
    everything is derived from the ledger."""

    min_stake: float | None = Field(
        None,
        ge=0,
        description="credits a worker must stake to join; unset: the least stake at which "
        "cheating a round does not pay at sample_rate (2 x the most a round pays x "
        "(1 - sample_rate) / (sample_rate x slash_fraction): covey.config.RunConfig.min_stake); "
        "0: no stake, a run defended by detection and exclusion alone",
    )
    sample_rate: float = Field(
        0.03,
        ge=0,
        le=1,
        description="share of accepted contributions validators re-execute (a new or "
        "low-reputation peer's: new_peer_rate); a lower rate needs a higher stake (min_stake)",
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
        120.0,
        gt=0,
        description="a claimed verification not reported in time goes back: this long plus "
        "its evidence at evidence_mbps (covey.trust.policy.check_timeout_s)",
    )
    evidence_mbps: float = Field(
        8.0,
        gt=0,
        description="Mbit/s a worker's blob server sends its verification evidence at, every "
        "validator's fetch together (its payloads are not paced): the share of its uplink "
        "checks may take (8% of 100 Mbit/s); validators wait for evidence at this rate shared "
        "by two fetches before they attest it withheld",
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
    validator_stake_cap: float = Field(
        100.0,
        ge=0,
        description="validators are drawn with probability in proportion to their stake, "
        "counted up to this cap per key (a larger stake buys no more checks); 0: drawn by "
        "the beacon's hash alone, stake aside",
    )
    established_checks: int = Field(
        5,
        ge=0,
        description="a validator with at least this many checks (less false accusations) "
        "and no canary passed has an established record; every drawn set of checks holds "
        "one when one is eligible (fresh keys cannot clear work among themselves); 0: no rule",
    )
    audit_rate: float = Field(
        0.1,
        ge=0,
        le=1,
        description="chance that a contribution cleared by its checks (all agreeing) is "
        "checked once more by a validator not yet tried (an audit, drawn by the coordinator's "
        "signature; its pay waits for it): a party's own keys cannot count on clearing it",
    )
    canary_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="rounds: chance per round that a house worker's contribution (the run "
        "owner's, covey worker --house-of) is a canary, trained on other data; RL: chance "
        "per step that a house rollout worker's batch is a canary; serve: chance that a "
        "house worker's answer to one of the server's house requests is a canary. Agreeing "
        "with one costs validator_slash_fraction of stake and the check's pay "
        "(docs/trust.md, Canaries)",
    )
    # sharded aggregation (covey/coordinator/sharding.py; docs/sharded-aggregation.md)
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

    funds: dict[str, float] = Field({}, description=FUNDS_HELP)

    @field_validator("funds")
    @classmethod
    def _funds_are_keys(cls, funds: dict[str, float]) -> dict[str, float]:
        return check_funds(funds)

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        names = (
            "sharded_above_peers", "shards", "shard_check_rate", "shard_publish_timeout_s",
            "funds",
        )  # fmt: skip
        return drop_defaults(self, handler(self), names)


class MembershipConfig(Frozen):
    """What the host's membership (covey.coordinator.membership) reads: liveness, the
    participation lease, the signature window and the no-show backoff (the stakes to join
    are the run's policy, in its ledger's "run created" entry).
    Not a table of any spec: every mode derives it from its own (`RunConfig.membership`,
    covey.rl.runspec.membership_config, `SwarmConfig.membership_config`), so no run id
    changes with it."""

    heartbeat_s: float = Field(2.0, gt=0, description="peers heartbeat this often")
    dead_after_s: float = Field(6.0, gt=0, description="a peer silent this long is dead")
    lease_s: float = Field(20.0, gt=0, description="a heartbeat renews the lease this long")
    nonce_window_s: float = Field(
        300.0, gt=0, description="signed requests older (or newer) than this are refused"
    )
    no_show_backoff_s: float = Field(
        30.0, ge=0, description="a repeated no-show sits out rounds this long, doubling"
    )
    no_show_backoff_max_s: float = Field(
        3600.0, ge=0, description="the longest a no-show is left out of rounds"
    )

    @model_validator(mode="after")
    def _ordered(self) -> MembershipConfig:
        if self.dead_after_s <= self.heartbeat_s:
            raise ValueError(
                f"dead_after_s ({self.dead_after_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        if self.lease_s <= self.heartbeat_s:
            raise ValueError(
                f"lease_s ({self.lease_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        return self

    @classmethod
    def of(cls, rounds: RoundsConfig, trust: TrustConfig, limits: LimitsConfig) -> MembershipConfig:
        """The membership of a spec with rounds, trust and limits tables."""
        return cls(
            heartbeat_s=rounds.heartbeat_s,
            dead_after_s=rounds.dead_after_s,
            lease_s=rounds.lease_s,
            nonce_window_s=trust.nonce_window_s,
            no_show_backoff_s=limits.no_show_backoff_s,
            no_show_backoff_max_s=limits.no_show_backoff_max_s,
        )
