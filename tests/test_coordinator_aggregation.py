"""The rounds mode's aggregation is a component chosen from the run spec when the mode is
built (covey.coordinator.aggregation), not by the HTTP layer: a `Coordinator` built
without any app shards a round above the crossover (its round driver opens the shard
board, and with no aggregator delivering finishes the shards itself and commits the
`apply_round` bits), gathers below it or when the spec says so, and the app's shard
routes are the component's own, present only when the run shards."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from covey.config import load_run_config
from covey.coordinator.aggregation import GatherAggregation, shards_the_run
from covey.coordinator.app import create_app
from covey.coordinator.auth import _RECEIVED_AT
from covey.coordinator.service import Coordinator
from covey.coordinator.shard_rounds import OVERDUE, ShardedAggregation
from covey.protocol import schemas
from covey.trust.identity import Identity, request_purpose
from tests.test_coordinator_close import Worker, peers_new_state
from tests.treasury_helpers import fund

SPEC = """
name = "aggregation"
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 32
[algorithm]
{algorithm}
[rounds]
min_peers = 2
deadline_min_s = 600
deadline_max_s = 600
dead_after_s = 600
heartbeat_s = 60
lease_s = 600
checkpoint_every = 100000
eval_every = 100000
eval_batches = 1
[trust]
new_peer_contributions = 0
sample_rate = 0.0
canary_rate = 0
sharded_above_peers = {above}
shards = 4
shard_check_rate = 0.5
shard_publish_timeout_s = 30
"""
DILOCO = 'method = "diloco"\ninner_steps = 4\nouter_momentum = 0.9\ncodec = "int8"'
SHARD_PATHS = {
    "/v1/shards",
    "/v1/shards/ready",
    "/v1/shards/{round}",
    "/v1/shards/{round}/publish",
    "/v1/shards/{round}/check",
}


def coordinator(tmp: Path, *, above: int, algorithm: str = DILOCO) -> Coordinator:
    """A coordinator built as the CLI builds it, with no HTTP app and no driver thread:
    the test ticks its round driver by hand."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = tmp / "run.toml"
    spec.write_text(SPEC.format(algorithm=algorithm, above=above))
    return Coordinator(load_run_config(spec), tmp / "data")


def ready_aggregator(coord: Coordinator) -> str:
    """A validator joins with stake and says it aggregates (signed, as over HTTP): it is
    in the next sharded round's draw. It never publishes anything."""
    key = Identity.generate()
    fund(coord, key.public_key, 5.0)  # the run's owner funds what it bonds
    body = {"run_id": coord.run_id, "validator_id": key.peer_id,
            "public_key": key.public_key, "stake": 5.0}  # fmt: skip
    raw = key.sign_request(body, -1, purpose=request_purpose("/v1/validators/join"))
    token = _RECEIVED_AT.set(request_purpose("/v1/validators/join"))
    try:
        coord.validator_join(schemas.ValidatorJoin.model_validate(raw), raw)
    finally:
        _RECEIVED_AT.reset(token)
    ready = {"run_id": coord.run_id, "peer_id": key.peer_id}
    signed = key.sign_request(ready, -1, purpose=request_purpose("/v1/shards/ready"))
    assert coord.rounds.aggregation.ready(signed, time.time())["ok"]  # type: ignore[attr-defined]
    return key.peer_id


def play_round(coord: Coordinator, workers: list[Worker]) -> tuple[int, str]:
    """Open a round, every worker submits: (round, start cid)."""
    coord.tick(time.time())
    rnd = coord.open_round()
    assert rnd is not None, "no round opened with two live workers"
    start_cid = coord.state_cid
    for w in workers:
        w.work()
    return rnd.round, start_cid


def test_a_coordinator_without_the_app_shards_above_the_crossover(tmp_path: Path) -> None:
    coord = coordinator(tmp_path, above=2)
    try:
        sharded = coord.rounds.aggregation
        assert isinstance(sharded, ShardedAggregation) and sharded.name == "sharded"
        workers = [Worker(coord, "a"), Worker(coord, "b")]

        # no aggregator ready: even above the crossover the driver aggregates itself
        r, start_cid = play_round(coord, workers)
        want = peers_new_state(coord, start_cid, r)
        coord.tick(time.time())
        assert not sharded.waiting and coord.state.round == r + 1
        assert coord.state_hash == want and sharded.stored(r) is None

        # an aggregator is ready: the close opens the shard board instead of aggregating
        aggregator = ready_aggregator(coord)
        r, start_cid = play_round(coord, workers)
        want = peers_new_state(coord, start_cid, r)
        coord.tick(time.time())
        assert sharded.waiting, "the round above the crossover was not sharded"
        assert coord.state.round == r, "a sharded round committed before its shards"
        board = sharded.board.view(r)
        assert [s["aggregator"] for s in board["shards"]] == [aggregator] * 4
        assert board["beacon"] and board["certificate"] is None
        status = coord.db.one("SELECT status FROM rounds WHERE round = ?", (r,))
        assert status is not None and status["status"] == "closing"
        coord.tick(time.time())  # the aggregator has time left: nothing moves
        assert sharded.waiting and coord.state.round == r

        # it never publishes: past the round's sharding deadline the coordinator
        # aggregates every shard itself, and commits what apply_round gives, bit for bit
        late = time.time() + OVERDUE * coord.cfg.trust.shard_publish_timeout_s + 1
        coord.tick(late)
        assert not sharded.waiting and coord.state.round == r + 1
        assert coord.state_hash == want and coord.state.digest() == want
        final = sharded.stored(r)
        assert final is not None and final["new_hash"] == want
        assert coord.certificate(r).new_hash == want
    finally:
        coord.stop()


def test_the_spec_can_ask_for_gather(tmp_path: Path) -> None:
    """sharded_above_peers = 0: gather, even with a ready validator and contributions
    past any crossover; the round commits on the closing tick."""
    coord = coordinator(tmp_path, above=0)
    try:
        gather = coord.rounds.aggregation
        assert isinstance(gather, GatherAggregation) and gather.name == "gather"
        workers = [Worker(coord, "a"), Worker(coord, "b")]
        r, start_cid = play_round(coord, workers)
        want = peers_new_state(coord, start_cid, r)
        coord.tick(time.time())
        assert not gather.waiting and coord.state.round == r + 1 and coord.state_hash == want
    finally:
        coord.stop()


@pytest.mark.parametrize(
    ("algorithm", "above", "shards"),
    [
        (DILOCO, 16, True),
        (DILOCO, 0, False),
        ('method = "streaming"\ninner_steps = 4\nfragments = 2', 16, False),
        ('method = "ddp"', 16, False),
        ('method = "demo"', 16, False),
    ],
    ids=["diloco", "diloco-crossover-0", "streaming", "ddp", "demo"],
)
def test_which_runs_shard(tmp_path: Path, algorithm: str, above: int, shards: bool) -> None:
    """Sharded aggregation is DiLoCo's outer Nesterov step, shard by shard: another method,
    or a crossover of 0, gathers."""
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(algorithm=algorithm, above=above))
    assert shards_the_run(load_run_config(spec)) is shards


def test_the_apps_shard_routes_are_the_components(tmp_path: Path) -> None:
    sharded = coordinator(tmp_path / "sharded", above=2)
    gather = coordinator(tmp_path / "gather", above=0)
    try:
        component = {r.path for r in sharded.rounds.aggregation.router.routes}  # type: ignore[attr-defined]
        assert component == SHARD_PATHS
        assert gather.rounds.aggregation.router.routes == []
        for coord, want in ((sharded, SHARD_PATHS), (gather, set())):
            app = create_app(coord)
            documented = set(app.openapi()["paths"])
            assert {p for p in documented if p.startswith("/v1/shards")} == want
            # served (in-process ASGI calls, no socket: the test is the app's routing)
            http = TestClient(app)
            pending = http.get("/v1/shards")
            assert pending.status_code == 404
            waiting = "no sharded round is waiting" in pending.text
            assert waiting is bool(want), pending.text
            ready = http.post("/v1/shards/ready", content=b"[]")
            assert ready.status_code == (400 if want else 404), ready.text
    finally:
        sharded.stop()
        gather.stop()
