"""A SWARM run's configuration: the model and its stages, data, pacing, verification.

Frozen and hashed into the run id like a data-parallel run's spec (STYLE.md rule 4). The
coordinator owns it; servers and trainers read it from `GET /v1/swarm/spec`, so every
peer builds the same model, plan and batches.

The `limits` table is the host's `LimitsConfig`, its `max_json_bytes` always the spec's
`max_body_bytes`. A table holding what the coordinator used before the spec had one
(`default_limits`) is left out of the dump, so of the run id.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_serializer, model_validator

from covey.config import Frozen, FundsConfig, LimitsConfig, MembershipConfig, TrustConfig
from covey.config.networked import body_limit_matches, limits_before, without_default_limits
from covey.trust.policy import Policy


class SwarmConfig(Frozen):
    """One SWARM run. Every wait below is bounded by a field here."""

    name: str = Field("covey-swarm", min_length=1, max_length=80, description="display name")
    seed: int = Field(0, description="seeds the initial weights of every stage and the data")
    model: str = Field(
        "",
        pattern=r"^(|hf:.+)$",
        description="'' = covey's GPT of n_layer/n_embd/n_head; 'hf:DIR' = a Hugging Face "
        "decoder (Llama or GPT-2 family) from a local directory (its config.json, and its "
        "*.safetensors weights if any); n_layer, n_embd and n_head are then ignored",
    )
    model_digest: str = Field(
        "",
        pattern="^([0-9a-f]{64})?$",
        description="sha256 of the hf: model's config.json (canonical JSON) and weight files; "
        "filled in from the directory where the spec is made, so the run id names the model "
        "and a peer loads only the run's files",
    )
    n_layer: int = Field(4, ge=1, description="GPT blocks, cut into `stages` stages")
    n_embd: int = Field(32, ge=8, description="GPT hidden size")
    n_head: int = Field(2, ge=1, description="GPT attention heads")
    seq_len: int = Field(32, ge=2, description="tokens per sequence (the GPT's block size)")
    stages: int = Field(2, ge=1, description="pipeline stages")
    microbatch: int = Field(4, ge=1, description="sequences per microbatch")
    target_samples: int = Field(
        16, ge=1, description="a stage's servers average their updates once they hold this many"
    )
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate of every stage")
    data_paths: tuple[str, ...] = Field((), description="text files or dirs; empty = stdlib")
    data_fingerprint: str = Field(
        "",
        pattern="^([0-9a-f]{16})?$",
        description="the fingerprint of data_paths' corpus (covey.data.corpus), filled in "
        "where the spec is made. A trainer sends nothing from data whose fingerprint differs, "
        "so a coordinator cannot have trainers read out a file it does not know already",
    )
    tokenizer: str = Field(
        "",
        pattern=r"^(|bytes|hf:.+)$",
        description="what trainers tokenize the data with: 'bytes' (covey's), or 'hf:DIR' "
        "(its tokenizer.json). Left empty for an hf: model, it is resolved where the spec is "
        "made: the model directory's own tokenizer.json when it has one, else bytes",
    )
    tokenizer_digest: str = Field(
        "",
        pattern="^([0-9a-f]{64})?$",
        description="sha256 of the tokenizer.json trainers use; filled in where the spec is "
        "made, so every trainer tokenizes alike (a different file is refused)",
    )
    codec: str = Field(
        "int8",
        pattern="^(int8|plain|subspace)$",
        description="activations and gradients between stages: blockwise 8-bit, fp32, or "
        "subspace coefficients (arXiv 2506.01260; fp32, `subspace_rank` values a token)",
    )
    subspace_rank: int = Field(
        8, ge=1, description="codec subspace: rank of the fixed basis stage outputs live in"
    )
    heartbeat_s: float = Field(1.0, gt=0, description="servers heartbeat this often")
    dead_after_s: float = Field(10.0, gt=0, description="a server silent this long is dead")
    round_timeout_s: float = Field(
        10.0, gt=0, description="an averaging round drops members silent for this long"
    )
    request_timeout_s: float = Field(
        10.0, gt=0, description="a trainer reroutes a hop unanswered for this long"
    )
    rebalance_s: float = Field(10.0, gt=0, description="the rebalancer looks every T seconds")
    hysteresis: float = Field(1.2, gt=1, description="a move must raise min throughput this much")
    verify_rate: float = Field(
        0.1, ge=0, le=1, description="share of microbatches also sent to a second server"
    )
    spot_check_rate: float = Field(
        0.1, ge=0, le=1, description="share of paid checks the referee recomputes first"
    )
    tolerance: float = Field(
        0.05, gt=0, description="relative L2 distance above which two replies disagree"
    )
    verify_device: Literal["cpu", "cuda", "mps"] = Field(
        "cpu",
        description="device class the referee recomputes disputed replies on; a "
        "coordinator without it judges nothing",
    )
    payout_s: float = Field(
        5.0, gt=0, description="the ledger pays verified microbatches this often"
    )
    max_body_bytes: int = Field(
        64 << 20, ge=1 << 16, description="largest request the coordinator reads (gradient sums)"
    )
    min_stake: float = Field(0.0, ge=0, description="credits a server stakes to join")
    slash_fraction: float = Field(0.5, ge=0, le=1, description="stake a proven liar loses")
    trust: FundsConfig = Field(
        default_factory=FundsConfig,
        description="the run's treasury at start ([trust.funds]: public key -> credits): a "
        "server bonds only credits it holds (docs/trust.md, Stake is held)",
    )
    limits: LimitsConfig = Field(
        default_factory=lambda: default_limits(SwarmConfig.model_fields["max_body_bytes"].default),
        description="the coordinator's HTTP limits (rates per peer and address, joins, body "
        "deadline, connections); max_json_bytes is max_body_bytes; unless set, max_blob_bytes "
        "is max_body_bytes too and body_timeout_s 30",
    )

    @model_validator(mode="before")
    @classmethod
    def _limits_of_body(cls, data: Any) -> Any:
        return limits_before(cls, data, "max_body_bytes", default_limits)

    @model_serializer(mode="wrap")
    def _dump_limits(self, handler: Any) -> dict[str, Any]:
        dumped = without_default_limits(
            handler(self), self.limits, default_limits(self.max_body_bytes)
        )
        if not self.trust.funds:  # added later: a run that grants nothing keeps its id
            dumped.pop("trust", None)
        return dumped

    @classmethod
    def received(cls, spec: Any) -> SwarmConfig:
        """A spec as a peer receives it from the coordinator: validated, nothing filled in.
        A field left empty stays empty: a peer never fills in a digest or fingerprint from
        its own files (a coordinator could send one empty to have it match anything)."""
        cfg = cls.model_validate(spec, context={"received": True})
        if cfg.model.startswith("hf:") and not cfg.model_digest:
            raise ValueError(
                f"the spec names model {cfg.model} without its model_digest: a peer loads "
                "only the files the run names by digest"
            )
        if cfg.tokenizer.startswith("hf:") and not cfg.tokenizer_digest:
            raise ValueError(
                f"the spec names tokenizer {cfg.tokenizer} without its tokenizer_digest: a "
                "trainer tokenizes only with the file the run names by digest"
            )
        return cfg

    @model_validator(mode="before")
    @classmethod
    def _digest(cls, data: Any, info: ValidationInfo) -> Any:
        # only where the spec is made (the coordinator): peers receive it filled in
        if info.context and info.context.get("received"):
            return data
        hf = isinstance(data, dict) and str(data.get("model", "")).startswith("hf:")
        if hf and not data.get("model_digest"):
            from covey.swarm.hfmodel import model_digest

            data = {**data, "model_digest": model_digest(str(data["model"])[3:])}
        if hf and not data.get("tokenizer"):
            # resolved here, where the spec is made: a peer parsing the spec it received
            # never resolves it again from its own copy of the directory
            own = Path(str(data["model"])[3:]) / "tokenizer.json"
            data = {**data, "tokenizer": f"{data['model']}" if own.is_file() else "bytes"}
        tokenizer = str(data.get("tokenizer", "")) if isinstance(data, dict) else ""
        if tokenizer.startswith("hf:") and not data.get("tokenizer_digest"):
            data = {**data, "tokenizer_digest": tokenizer_digest(tokenizer[3:])}
        paths = data.get("data_paths") if isinstance(data, dict) else None
        if paths and not data.get("data_fingerprint"):
            from covey.data.corpus import load_corpus

            source = tokenizer if tokenizer.startswith("hf:") else "bytes"
            corpus = load_corpus([str(p) for p in paths], tokenizer=source)
            data = {**data, "data_fingerprint": corpus.fingerprint}
        return data

    @model_validator(mode="after")
    def _fits(self) -> SwarmConfig:
        body_limit_matches(self.limits, "max_body_bytes", self.max_body_bytes)
        if self.model:
            return self  # the directory's config.json is checked when a stage is built
        if self.stages > self.n_layer:
            raise ValueError(
                f"stages ({self.stages}) cannot be greater than n_layer ({self.n_layer})"
            )
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        return self

    @property
    def run_id(self) -> str:
        data = self.model_dump(mode="json")
        # added later: hashed only when they change what trainers do, so earlier runs keep
        # their ids (covey's bytes, named or resolved, is what every run did before)
        if data["tokenizer"] in ("", "bytes"):
            del data["tokenizer"]
        if not data["tokenizer_digest"]:
            del data["tokenizer_digest"]
        if not data["data_fingerprint"]:
            del data["data_fingerprint"]
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def tokenizer_source(self) -> str:
        """`bytes` or `hf:DIR` for covey.data.corpus.load_corpus. ValueError naming the file
        when this peer's tokenizer.json is missing or is not the one the run names."""
        if not self.tokenizer.startswith("hf:"):
            return "bytes"
        directory = self.tokenizer[3:]
        got = tokenizer_digest(directory)
        if self.tokenizer_digest and got != self.tokenizer_digest:
            raise ValueError(
                f"{directory}/tokenizer.json has digest {got[:12]}, the run names "
                f"{self.tokenizer_digest[:12]}: every trainer must tokenize alike"
            )
        return f"hf:{directory}"

    def membership_config(self) -> MembershipConfig:
        """What the host's membership reads: the servers' liveness (their stake to join
        is the run's policy)."""
        return MembershipConfig(heartbeat_s=self.heartbeat_s, dead_after_s=self.dead_after_s)

    def trust_config(self) -> TrustConfig:
        """The incentive rules the ledger's "run created" entry records (covey.trust.
        incentives.Policy): the stake and slash of this spec, nothing sampled."""
        return TrustConfig(
            min_stake=self.min_stake, slash_fraction=self.slash_fraction, sample_rate=0.0
        )

    def policy(self) -> Policy:
        """The ledger's incentive policy ("run created"): this spec's stake and slash, a
        server bonds only what it holds, and unbonds after `unbonding_s`."""
        rules = Policy.from_config(self.trust_config(), held_stake=True).to_dict()
        return Policy.from_dict({**rules, "unbonding_s": self.unbonding_s()})

    def unbonding_s(self) -> float:
        """How long a leaving server's stake stays bonded (covey.trust.treasury): the
        longest a slash can take to reach it after its last reply. A hop and its
        duplicate each end within 3 x request_timeout_s (the trainer's bound on a hop,
        rerouted included); the check waits for its state to be agreed at most
        2 x round_timeout_s (parked); the referee fetches the evidence with two retries
        (3 x request_timeout_s); a check is paid, or its spot check convicts, at the next
        payout (payout_s). 9 x request_timeout_s + 2 x round_timeout_s + payout_s."""
        return 9 * self.request_timeout_s + 2 * self.round_timeout_s + self.payout_s


def default_limits(max_body_bytes: int) -> LimitsConfig:
    """The limits a coordinator serves with unless its spec says otherwise: the host's
    defaults with the run's body size for JSON and blobs alike (stage states travel as
    JSON) and a longer body deadline (30 s: gradient sums are large)."""
    size = max(1024, max_body_bytes)
    return LimitsConfig(max_json_bytes=size, max_blob_bytes=size, body_timeout_s=30.0)


def tokenizer_digest(directory: str) -> str:
    """sha256 of `directory`/tokenizer.json; ValueError naming the path when it is missing."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer directory {directory} has no tokenizer.json")
    return hashlib.sha256(path.read_bytes()).hexdigest()
