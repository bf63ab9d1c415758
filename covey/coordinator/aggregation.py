"""How the rounds mode aggregates a closed round: a component chosen from the run spec when
the mode is built (`choose_aggregation`, called by covey.coordinator.rounds.Rounds), and
owned by it.

- `GatherAggregation`: the coordinator aggregates every round itself with the strategy's
  `apply_round`, as every peer does; it serves no routes of its own.
- `ShardedAggregation` (covey.coordinator.shard_rounds): a DiLoCo round with at least
  `trust.sharded_above_peers` accepted contributions, and staked aggregators ready, is
  aggregated shard by shard by them (docs/sharded-aggregation.md); a smaller round, or one
  with no aggregator ready, is gathered as above. It serves the shard board's
  `/v1/shards` routes (covey.coordinator.shard_routes).

The round driver calls the component in two places: `begin` when a round closes (True:
the component took the round and commits it later), and `advance` on every tick while it
is `waiting` (nothing else moves meanwhile). Its `router` is what the HTTP app includes:
the app makes no decision about aggregation.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import APIRouter

from covey.config import DiLoCoConfig, RunConfig, StreamingDiLoCoConfig

from .shard_rounds import Commit, RoundsState, ShardedAggregation
from .views import OpenRound

if TYPE_CHECKING:
    from covey.blobs import BlobStore
    from covey.trust.identity import Identity

    from .accounts import Accounts
    from .db import Database
    from .model import RunModel

log = logging.getLogger("covey.coordinator")


class Aggregation(Protocol):
    """What the round driver calls, and the routes the app serves for it."""

    name: str  #: "gather" or "sharded"
    router: APIRouter  #: this aggregation's own routes, included by the HTTP app

    @property
    def waiting(self) -> bool:
        """A closed round waits on this component: the driver only calls `advance`."""
        ...

    def begin(self, rnd: OpenRound, rows: list[Any], reason: str) -> bool:
        """Take the closed round `rnd` (its accepted contribution rows) when this component
        aggregates it: True, and it commits the round later; False: the driver aggregates
        it now with `apply_round`."""
        ...

    def advance(self, now: float) -> None:
        """One driver tick of the round this component waits on."""
        ...

    def close(self) -> None:
        """Let go of what it holds (connections); the driver has stopped."""
        ...


class GatherAggregation:
    """Every accepted contribution is fetched and aggregated by the coordinator itself."""

    name = "gather"

    def __init__(self) -> None:
        self.router = APIRouter()  # no routes of its own

    @property
    def waiting(self) -> bool:
        return False

    def begin(self, rnd: OpenRound, rows: list[Any], reason: str) -> bool:
        return False

    def advance(self, now: float) -> None:
        return None

    def close(self) -> None:
        return None


def shards_the_run(cfg: RunConfig) -> bool:
    """Whether a run's rounds are aggregated shard by shard above the crossover: DiLoCo
    (outer Nesterov SGD, not streaming) with `trust.sharded_above_peers` set and not 0."""
    algo = cfg.algorithm
    diloco = isinstance(algo, DiLoCoConfig) and not isinstance(algo, StreamingDiLoCoConfig)
    if cfg.trust.sharded_above_peers and not diloco:
        log.info("sharded aggregation supports DiLoCo only, not %r: gather", algo.method)
    return bool(cfg.trust.sharded_above_peers) and diloco


def choose_aggregation(
    cfg: RunConfig,
    *,
    run_id: str,
    identity: Identity,
    db: Database,
    accounts: Accounts,
    blobs: BlobStore,
    model: RunModel,
    rounds: RoundsState,
    commit: Commit,
) -> Aggregation:
    """The aggregation the run spec asks for (`shards_the_run`). `rounds` is the mode's
    current state (read when a round closes), `commit` how a sharded round is committed
    once its shards are assembled."""
    if not shards_the_run(cfg):
        return GatherAggregation()
    return ShardedAggregation(
        cfg,
        run_id=run_id,
        identity=identity,
        db=db,
        accounts=accounts,
        blobs=blobs,
        model=model,
        rounds=rounds,
        commit=commit,
    )
