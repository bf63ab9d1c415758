"""Sharded aggregation through the HTTP API of a real coordinator process (issue 13 §1).

Two workers (this process, signed requests) submit int4 contributions to round 0; three
staked validator keys aggregate its 4 shards, each reading only its shards' byte ranges
of the contributions from the blob plane and serving its new shards from its own blob
server. One of them lies: the drawn checker catches it, the coordinator's referee
recomputes the shard, the liar is slashed (ledger) and its shards pass on; the shard
certificate is signed, and a peer that assembles the state shard by shard (refusing a
tampered copy) reaches the weights hash of the coordinator's own unsharded round."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from covey.blobs import BlobServer, BlobStore
from covey.blobs.client import upload_headers
from covey.local.cluster import LocalCluster
from covey.peer.aggregator import ShardAggregator, certified_shard, fetch_certified_state
from covey.peer.client import CoordinatorClient
from covey.peer.runsetup import set_up_run
from covey.protocol.content import content_id
from covey.trust.identity import Identity

pytestmark = [pytest.mark.network]

SPEC = """
name = "shards"
seed = 5
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 32
[algorithm]
method = "diloco"
inner_steps = 4
codec = "int4"
inner_state = "reset"
[rounds]
deadline_min_s = 30
deadline_max_s = 60
eval_batches = 1
max_rounds = 1
[trust]
min_stake = 1
sample_rate = 0
new_peer_rate = 0
canary_rate = 0
sharded_above_peers = 1
shards = 4
shard_check_rate = 1.0
"""


def until(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """Poll `check` until it returns something truthy; generous for a loaded machine."""
    give_up = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.2)


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST, retried while the rate limiter answers 429 (the handler never ran)."""
    for _ in range(50):
        resp = http.post(path, json=body)
        if resp.status_code != 429:
            return resp
        time.sleep(float(resp.headers.get("Retry-After", "0.5")))
    raise AssertionError(f"{path}: 429 fifty times")


class Worker:
    def __init__(self, http: httpx.Client, run_id: str) -> None:
        self.http, self.run_id, self.key = http, run_id, Identity.generate()
        body = {"run_id": run_id, "peer_id": self.key.peer_id, "public_key": self.key.public_key,
                "step_time_s": 0.01, "stake": 1.0}  # fmt: skip
        resp = post(http, "/v1/join", self.key.sign_request(body, -1, purpose="POST /v1/join"))
        assert resp.status_code == 200, resp.text
        self.stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        body = {"run_id": self.run_id, "peer_id": self.key.peer_id}
        while not self.stop.wait(0.5):
            self.http.post(
                "/v1/heartbeat", json=self.key.sign_request(body, -1, purpose="POST /v1/heartbeat")
            )


@pytest.fixture(scope="module")
def round0(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp: Path = tmp_path_factory.mktemp("shards")
    (tmp / "run.toml").write_text(SPEC)
    with LocalCluster(tmp / "run.toml", tmp) as cluster:
        cluster.start_coordinator()
        http = httpx.Client(base_url=cluster.url, timeout=20, trust_env=False)
        run_id = cluster.run_id
        workers = [Worker(http, run_id) for _ in range(2)]
        info = until(
            "round 0 to open with both workers",
            lambda: (
                (r := http.get("/v1/round").json())["phase"] == "open"
                and http.get("/v1/round", params={"peer_id": workers[1].key.peer_id}).json()[
                    "member"
                ]
                and r
            ),
        )
        setup = set_up_run(CoordinatorClient(cluster.url), threads=1)
        numel = sum(setup.template.params[n].numel() for n in setup.strategy.names)
        g = torch.Generator().manual_seed(0)
        for i, w in enumerate(workers):
            mine = http.get("/v1/round", params={"peer_id": w.key.peer_id}).json()
            steps = mine["assignment"]["inner_steps"]
            data = setup.strategy.codec.encode(torch.randn(numel, generator=g) * 1e-3 * (i + 1))
            cid = content_id(data)
            resp = http.put(f"/v1/blobs/{cid}", content=data,
                            headers=_upload(w.key, run_id, cid, len(data)))  # fmt: skip
            assert resp.status_code in (200, 201), resp.text
            body = {
                "run_id": run_id,
                "round": 0,
                "attempt": info["attempt"],
                "peer_id": w.key.peer_id,
                "cid": cid,
                "start_hash": info["start_hash"],
                "size": len(data),
                "tokens": steps * 4 * 32 - i,
                "inner_steps": steps,
            }
            path = "/v1/rounds/0/contributions"
            resp = post(http, path, w.key.sign_request(body, 0, purpose=f"POST {path}"))
            assert resp.status_code == 200, resp.text
        cert = until("round 0's certificate", lambda: _json_if_ok(http, "/v1/rounds/0/certificate"))
        assert len(cert["accepted"]) == 2, cert
        for w in workers:
            w.stop.set()
        yield {"cluster": cluster, "http": http, "setup": setup, "cert": cert, "tmp": tmp}


def _upload(key: Identity, run_id: str, cid: str, size: int) -> dict[str, str]:
    return upload_headers(key, run_id, cid, size)


def _json_if_ok(http: httpx.Client, path: str) -> Any:
    resp = http.get(path)
    return resp.json() if resp.status_code == 200 else None


def test_a_lying_aggregator_is_slashed_and_the_round_still_certifies(
    round0: dict[str, Any],
) -> None:
    cluster, http, setup = round0["cluster"], round0["http"], round0["setup"]
    keys = [Identity.generate() for _ in range(3)]
    for k in keys:
        body = {"run_id": cluster.run_id, "validator_id": k.peer_id,
                "public_key": k.public_key, "stake": 5.0}  # fmt: skip
        path = "/v1/validators/join"
        resp = post(http, path, k.sign_request(body, -1, purpose=f"POST {path}"))
        assert resp.status_code == 200, resp.text
    board = until("the shard board", lambda: _json_if_ok(http, "/v1/shards/0"))
    start = http.get(f"/v1/blobs/{board['inputs']['start_cid']}")
    assert content_id(start.content) == board["inputs"]["start_cid"]  # aggregators' W_0
    liar = board["shards"][0]["aggregator"]
    servers, aggregators = [], []
    for i, k in enumerate(keys):
        store = BlobStore(round0["tmp"] / f"agg{i}")
        server = BlobServer(store)
        servers.append(server)
        aggregators.append(
            ShardAggregator(
                cluster.url,
                k,
                cluster.run_id,
                setup.strategy,
                setup.cfg.algorithm,
                store,
                server.start(),  # type: ignore[arg-type]
                lie=k.peer_id == liar,
            )
        )
    try:
        give_up = time.monotonic() + 60
        while (board := http.get("/v1/shards/0").json())["certificate"] is None:
            assert time.monotonic() < give_up, board
            for a in aggregators:
                if not cluster.get("/v1/ledger/balances")["accounts"][a.identity.peer_id]["banned"]:
                    a.work(0, setup.template)
        cert = board["certificate"]
        balances = cluster.get("/v1/ledger/balances")["accounts"]
        assert balances[liar]["banned"] and balances[liar]["slashed"] == 2.5, balances[liar]
        assert [f["aggregator"] for f in board["frauds"]] == [liar]
        assert liar not in {s["aggregator"] for s in cert["shards"]}
        # each shard computed read only its ranges: a quarter of every contribution (+ heads)
        total = sum(a["size"] for a in round0["cert"]["accepted"])
        for a in aggregators:
            assert a.bytes_read <= a.shards_computed * (total / 4 + 2 * 64), (a.bytes_read, total)
        # a peer refuses the liar's shard 0, fetched from the liar's own server
        lying = next(a for a in aggregators if a.identity.peer_id == liar)
        cids = [c for c in lying.store.cids() if lying.store.size(c) == 8 * cert["bounds"][1]]
        assert cids, "the liar published no shard 0"
        blob = http.get(f"{lying.blob_url}/v1/blobs/{cids[0]}").content
        with pytest.raises(ValueError, match="refused"):
            certified_shard(cert, 0, blob, True)
        # ... and assembles the state shard by shard from the certified sources
        state, refusals = fetch_certified_state(
            http, cert, setup.coordinator_key, setup.template, setup.strategy.names, True
        )
        assert not refusals, refusals
        assert state.digest() == round0["cert"]["new_hash"]  # the unsharded round's hash
    finally:
        for a in aggregators:
            a.close()
        for s in servers:
            s.close()
