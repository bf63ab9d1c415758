"""Run specifications: pydantic models, loaded from TOML, frozen, hashed.

Every field has a constraint and a description; `covey sim --help` and the README are
written from them. A config is immutable once loaded and hashes (canonical JSON, sha256)
to the id that names its run directory. No environment variable overrides any field.

The spec is a package: covey.config.parts (the tables every spec is built of),
covey.config.networked (rounds, limits, trust, membership) and covey.config.specs (SimConfig,
RunConfig, their loaders, the run id); every name is importable from covey.config.
"""

from covey.config.networked import (
    FundsConfig,
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
    DDPConfig,
    DeMoConfig,
    DiLoCoConfig,
    Frozen,
    InnerOptim,
    ModelConfig,
    NetworkConfig,
    PeerConfig,
    StreamingDiLoCoConfig,
    config_hash,
    load_toml,
    merge,
    steps_per_round,
)
from covey.config.specs import (
    RunConfig,
    SimConfig,
    load_run_config,
    load_sim_config,
    run_id_of,
    to_toml,
)

__all__ = [
    "AlgorithmConfig",
    "ChurnConfig",
    "ComputeConfig",
    "DDPConfig",
    "DataConfig",
    "DeMoConfig",
    "DiLoCoConfig",
    "Frozen",
    "FundsConfig",
    "InnerOptim",
    "LimitsConfig",
    "MembershipConfig",
    "ModelConfig",
    "NetworkConfig",
    "PeerConfig",
    "RoundsConfig",
    "RunConfig",
    "SimConfig",
    "StreamingDiLoCoConfig",
    "TrustConfig",
    "config_hash",
    "deterrent_stake",
    "load_run_config",
    "load_sim_config",
    "load_toml",
    "merge",
    "run_id_of",
    "steps_per_round",
    "to_toml",
]
