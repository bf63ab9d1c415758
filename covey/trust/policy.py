"""The incentive rules a run was created with (`Policy`, from the "run created" entry) and
one peer's standing under them (`Account`), as covey.trust.incentives.Book replays them.
Pure: no I/O."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from covey.config import TrustConfig


# how many fetches of a worker's evidence share its paced rate (trust.evidence_mbps) in a
# deadline: the two validators that check a new worker's contribution fetch at once
EVIDENCE_FETCHERS = 2
# the published states (covey.trust.evidence.evidence_of) one check may fetch: the one its
# round started from, and its end state when the re-execution is not bit-identical
CHECK_EVIDENCE_STATES = 2


def evidence_deadline_s(base_s: float, evidence_bytes: int, evidence_mbps: float) -> float:
    """`base_s` plus the time `evidence_bytes` of a worker's evidence take at its paced
    rate (`evidence_mbps`, the run's trust.evidence_mbps) shared by EVIDENCE_FETCHERS
    fetches. Every deadline that waits for evidence is this (docs/trust.md): a validator's
    fetch of one published state (base: limits.request_timeout_s), after which it attests
    the evidence withheld (covey.trust.withholding), and a check's whole time
    (`check_timeout_s`: the coordinator's expiry of a held check, and the unbonding
    period's count of checks)."""
    return base_s + evidence_bytes * 8 * EVIDENCE_FETCHERS / (evidence_mbps * 1e6)


def check_timeout_s(verify_timeout_s: float, state_bytes: int, evidence_mbps: float) -> float:
    """How long a validator may hold a drawn check before it is missed: verify_timeout_s
    (re-executing and reporting) plus CHECK_EVIDENCE_STATES published states of
    `state_bytes` (the run's model and method: covey.trust.verify.published_state_nbytes)
    at the paced rate (`evidence_deadline_s`). A validator's own fetches, each one request
    timeout plus one state, end within it (limits.request_timeout_s is below
    verify_timeout_s), so an honest check of a big model's evidence is not expired."""
    return evidence_deadline_s(verify_timeout_s, CHECK_EVIDENCE_STATES * state_bytes, evidence_mbps)


def unbonding_delay(
    *,
    round_s: float,
    challenge_rounds: int,
    verify_timeout_s: float,
    validators_per_check: int,
    dispute_attempts: int,
    shard_publish_timeout_s: float = 0.0,
    state_bytes: int = 0,
    evidence_mbps: float = 8.0,
) -> float:
    """The unbonding period: the longest a slash can take to reach a key after it leaves.

    (challenge_rounds + 1) x round_s: its last contribution's round closes and it is paid
    challenge_rounds rounds later (round_s: the longest round, deadline_max_s); plus
    (2 x validators_per_check + 2 + dispute_attempts) x a check's time (`check_timeout_s`:
    verify_timeout_s plus the evidence of `state_bytes` at `evidence_mbps`; 0 bytes: a
    method that keeps no private state): each drawn check may expire once and be drawn
    again (2 x validators_per_check), the audit and the withheld-evidence attestation (each
    within a check's time), and every referee attempt counted as a check's time; plus
    2 x shard_publish_timeout_s: a sharded round's aggregator is judged at most that long
    after its round closed."""
    checks = 2 * validators_per_check + 2 + dispute_attempts
    check_s = check_timeout_s(verify_timeout_s, state_bytes, evidence_mbps)
    return (challenge_rounds + 1) * round_s + checks * check_s + 2 * shard_publish_timeout_s


@dataclass(frozen=True)
class Policy:
    """The incentive rules a run was created with (see covey.config.TrustConfig)."""

    min_stake: float
    reward_per_token: float
    slash_fraction: float
    catch_reward: float
    new_peer_rate: float
    new_peer_contributions: int
    low_reputation: float
    sample_rate: float
    # added later: a "run created" entry without them gets these defaults (older ledgers)
    min_validator_stake: float = 0.0
    validator_slash_fraction: float = 0.0
    check_reward: float = 0.0
    validators_per_check: int = 1
    validator_round_cap: int = 1_000_000
    canary_rate: float = 0.0
    # 0 (older ledgers): validators ranked by the beacon's hash alone (covey.trust.draws)
    validator_stake_cap: float = 0.0
    established_checks: int = 0
    audit_rate: float = 0.0
    # the treasury (covey.trust.treasury): 1, a bond may not exceed what the key holds
    # (every mode's coordinator writes 1; 0, older ledgers: stakes were declared); the
    # least time from an unbond to its release
    held_stake: int = 0
    unbonding_s: float = 0.0
    # the bytes of one published end state (a drawn contribution's evidence) of the run's
    # model and method, which a check's time counts (`check_timeout_s`); 0: none (a method
    # with no private state, another mode, or an older ledger)
    evidence_bytes: int = 0

    @classmethod
    def from_config(
        cls,
        cfg: TrustConfig,
        round_s: float = 0.0,
        *,
        held_stake: bool = False,
        evidence_bytes: int = 0,
        min_stake: float | None = None,
    ) -> Policy:
        """The rules of a spec's trust table; `round_s` is the longest a round of the
        run may last (rounds: deadline_max_s), which the unbonding period covers;
        `held_stake`: a key bonds only what it holds (every mode's coordinator passes
        it; the RL, SWARM and serving modes set their own unbonding period over this
        one's, docs/trust.md); `evidence_bytes`: one published end state of the run's
        model and method, whose fetch a check's time allows for (`check_timeout_s`);
        `min_stake`: the worker's minimum stake when the trust table leaves it to the run
        (a rounds run's `RunConfig.min_stake`; unset there and here: 0)."""
        if cfg.min_stake is not None:
            min_stake = cfg.min_stake
        derived = {
            "min_stake": min_stake or 0.0,
            "held_stake": int(held_stake),
            "evidence_bytes": int(evidence_bytes),
            "unbonding_s": unbonding_delay(
                round_s=round_s,
                challenge_rounds=cfg.challenge_rounds,
                verify_timeout_s=cfg.verify_timeout_s,
                validators_per_check=cfg.validators_per_check,
                dispute_attempts=cfg.dispute_attempts,
                shard_publish_timeout_s=cfg.shard_publish_timeout_s,
                state_bytes=evidence_bytes,
                evidence_mbps=cfg.evidence_mbps,
            ),
        }
        return cls.from_dict(
            {f.name: derived.get(f.name, getattr(cfg, f.name, None)) for f in fields(cls)}
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Policy:
        """ValueError naming the field if one is missing, unknown, or not a non-negative
        finite number (new_peer_contributions: an int)."""
        names = [f.name for f in fields(cls)]
        if isinstance(data, dict):
            data = {**{n: getattr(_DEFAULTS, n) for n in _LATER_FIELDS}, **data}
        if not isinstance(data, dict) or set(data) != set(names):
            got = sorted(data) if isinstance(data, dict) else data
            raise ValueError(f"policy must have exactly the fields {names}, got {got}")
        values: dict[str, Any] = {}
        for name in names:
            v, cast = data[name], int if name in _INT_FIELDS else float
            ok = isinstance(v, int) if cast is int else isinstance(v, (int, float))
            if not ok or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"policy.{name} must be a non-negative {cast.__name__}, got {v!r}")
            values[name] = cast(v)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The "run created" entry's `policy` payload."""
        return asdict(self)


@dataclass
class Account:
    """One peer's standing. `slashed` is the amount of stake lost."""

    peer_id: str
    name: str
    role: str
    public_key: str
    stake: float = 0.0
    balance: float = 0.0
    tokens_paid: int = 0
    contributions: int = 0
    rejected: int = 0
    agreed: int = 0
    frauds: int = 0
    false_accusations: int = 0
    catches: int = 0
    slashed: float = 0.0
    banned: bool = False
    checks: int = 0  # a validator's reports on its checks
    refused_reports: int = 0
    missed_checks: int = 0
    canaries_passed: int = 0
    no_shows: int = 0  # repeated ones (the second in a row and later): they cost reputation
    withheld: int = 0  # contributions drawn for verification whose evidence never came
    # the treasury (covey.trust.treasury): credits ever bonded, released after unbonding,
    # and when the stake unbonding now is released (None: not unbonding)
    bonded: float = 0.0
    released: float = 0.0
    release_at: float | None = None

    @property
    def validator_faults(self) -> int:
        """What counts against a validator: false accusations, refused reports, checks it
        held and did not report in time, canaries it agreed with."""
        return (
            self.false_accusations + self.refused_reports + self.missed_checks
            + self.canaries_passed
        )  # fmt: skip

    @property
    def reputation(self) -> float:
        """A worker: (agreed + 1) / (agreed + frauds + no_shows + withheld + 2), counting
        repeated no-shows only (a first one is a crash anyone may have), and withheld the
        contributions drawn for verification whose local states it did not deliver
        (covey.trust.withholding). A validator: (good + 1) /
        (good + faults + 2), where good is its checks less its false accusations, and none
        once it passed a canary: that proves it agrees without re-executing, so none of its
        agreements is evidence of work. 0.5 for a peer with no record."""
        if self.role == "validator":
            good = 0 if self.canaries_passed else max(self.checks - self.false_accusations, 0)
            return (good + 1) / (good + self.validator_faults + 2)
        return (self.agreed + 1) / (self.agreed + self.frauds + self.no_shows + self.withheld + 2)


_DEFAULTS = Policy(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 0.0)
_LATER_FIELDS = (
    "min_validator_stake",
    "validator_slash_fraction",
    "check_reward",
    "validators_per_check",
    "validator_round_cap",
    "canary_rate",
    "validator_stake_cap",
    "established_checks",
    "audit_rate",
    "held_stake",
    "unbonding_s",
    "evidence_bytes",
)
_INT_FIELDS = (
    "new_peer_contributions",
    "validators_per_check",
    "validator_round_cap",
    "established_checks",
    "held_stake",
    "evidence_bytes",
)
