"""Gather vs sharded aggregation per round, on 127.0.0.1: where the two cross over.

For each peer count N and each path, a real coordinator process runs one DiLoCo round of
N signed peers (this process) that upload int4 contributions of the model's size; on the
sharded path three staked aggregators (threads here, ShardAggregator.poll) do the shards.
Measured after the last submission: the seconds until the round's certificate, and until
one worker holds the certified new state (gather: it downloads the N - 1 other
contributions and applies them, as `covey worker` does; sharded: it fetches the new state
shard by shard); the bytes that worker downloads; the aggregators' bytes read.

    covey bench shards --peers 4,8,16,32 --model micro --json out.json

With `--liar drop|noise`, only the sharded path runs, `--trials` rounds per peer count, each
a fresh run (fresh keys, so a fresh beacon draw), one of the three aggregators a liar
(covey.peer.cheater_aggregator). Per round: whether the liar was caught, in the round (slashed
by the drawn checker's referee) or by the late check after the certificate (every certified
shard recomputed, covey.coordinator.shard_audit), how many of its first-turn shards the draw
checked, how many of its shards the certificate holds (its lies in the model: caught late,
they stay there), whether the certified state is the unsharded `apply_round`'s (a model kept
clean), and the seconds the late check took (its cost: one unsharded aggregation).

    covey bench shards --peers 4 --liar drop --trials 20 --json liars.json
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from covey.algorithms import Contribution
from covey.blobs import BlobServer, BlobStore
from covey.blobs.client import upload_headers
from covey.coordinator.sharding import assign_shards, drawn_for_check
from covey.local.cluster import LocalCluster
from covey.peer.aggregator import ShardAggregator, fetch_round_shards
from covey.peer.cheater_aggregator import LyingAggregator
from covey.peer.client import CoordinatorClient
from covey.peer.runsetup import set_up_run
from covey.protocol.content import content_id
from covey.trust.identity import Identity

SPEC = """
name = "bench-shards-{mode}-{n}"
seed = 5
[model]
size = "{model}"
[data]
batch_size = 4
seq_len = 32
[algorithm]
method = "diloco"
inner_steps = 4
codec = "int4"
outer_momentum = 0.9
inner_state = "reset"
[rounds]
min_peers = {n}
deadline_min_s = 120
deadline_max_s = 300
eval_batches = 1
max_rounds = 1
[limits]
# every simulated peer and aggregator shares 127.0.0.1: lift the per-address rate limit
# (on a real network each has its own address)
address_rate = 1000000
address_burst = 1000000
peer_rate = 1000000
peer_burst = 1000000
[trust]
sample_rate = 0
new_peer_rate = 0
canary_rate = 0
shards = {shards}
shard_check_rate = {check_rate}
{sharded}
"""


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    for _ in range(200):
        resp = http.post(path, json=body)
        if resp.status_code != 429:
            return resp
        time.sleep(float(resp.headers.get("Retry-After", "0.5")))
    raise RuntimeError(f"{path}: 429 two hundred times")


def until(what: str, check: Any, timeout_s: float = 300.0) -> Any:
    give_up = time.monotonic() + timeout_s
    while not (got := check()):
        if time.monotonic() > give_up:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return got


CHECK_RATE = 0.25  # the default trust.shard_check_rate


def one(
    n: int, mode: str, model: str, shards: int, tmp: Path, liar: str | None = None
) -> dict[str, Any]:
    sharded = "sharded_above_peers = 2" if mode == "sharded" else ""
    spec = SPEC.format(
        mode=mode, n=n, model=model, shards=shards, sharded=sharded, check_rate=CHECK_RATE
    )
    (tmp / "run.toml").write_text(spec)
    stop = threading.Event()
    with LocalCluster(tmp / "run.toml", tmp) as cluster:
        cluster.start_coordinator()
        http = httpx.Client(base_url=cluster.url, timeout=60, trust_env=False)
        run_id = cluster.run_id
        setup = set_up_run(CoordinatorClient(cluster.url), threads=1)
        aggs: list[ShardAggregator] = []
        servers: list[BlobServer] = []
        if mode == "sharded":
            for i in range(3):
                k = Identity.generate()
                cluster.fund(k.public_key, 5.0)  # the run's owner funds what it bonds
                body = {
                    "run_id": run_id,
                    "validator_id": k.peer_id,
                    "public_key": k.public_key,
                    "stake": 5.0,
                }
                path = "/v1/validators/join"
                assert post(http, path, k.sign_request(body, -1, purpose=f"POST {path}")).is_success
                store = BlobStore(tmp / f"agg{i}")
                servers.append(BlobServer(store))
                url = servers[-1].start()
                kind = LyingAggregator if i == 0 and liar else ShardAggregator
                extra = {"mode": liar} if kind is LyingAggregator else {}
                aggs.append(
                    kind(
                        cluster.url,
                        k,
                        run_id,
                        setup.strategy,
                        setup.cfg.algorithm,
                        store,
                        url,
                        **extra,
                    )
                )  # type: ignore[arg-type]

            def loop(a: ShardAggregator) -> None:
                while not stop.wait(0.05):
                    try:
                        a.poll(setup.template)
                    except Exception as e:  # report and go on; a banned liar stops
                        print("aggregator:", e, file=sys.stderr)
                        if "excluded" in str(e):
                            return

            for a in aggs:
                threading.Thread(target=loop, args=(a,), daemon=True).start()
        keys = [Identity.generate() for _ in range(n)]
        for k in keys:
            body = {
                "run_id": run_id,
                "peer_id": k.peer_id,
                "public_key": k.public_key,
                "step_time_s": 0.01,
            }
            assert post(
                http, "/v1/join", k.sign_request(body, -1, purpose="POST /v1/join")
            ).is_success

        def beat() -> None:
            while not stop.wait(0.5):
                for k in keys:
                    body = {"run_id": run_id, "peer_id": k.peer_id}
                    http.post(
                        "/v1/heartbeat", json=k.sign_request(body, -1, purpose="POST /v1/heartbeat")
                    )

        threading.Thread(target=beat, daemon=True).start()
        info = until(
            "round 0 with every peer",
            lambda: (r := http.get("/v1/round").json())["phase"] == "open" and r,
        )
        numel = sum(setup.template.params[nm].numel() for nm in setup.strategy.names)
        g = torch.Generator().manual_seed(0)
        payloads = {}
        for i, k in enumerate(keys):
            mine = http.get("/v1/round", params={"peer_id": k.peer_id}).json()
            assert mine["member"], f"peer {i} is not in round 0"
            steps = mine["assignment"]["inner_steps"]
            data = setup.strategy.codec.encode(torch.randn(numel, generator=g) * 1e-3)
            cid = content_id(data)
            payloads[cid] = data
            resp = http.put(
                f"/v1/blobs/{cid}", content=data, headers=upload_headers(k, run_id, cid, len(data))
            )
            assert resp.status_code in (200, 201), resp.text
            body = {
                "run_id": run_id,
                "round": 0,
                "attempt": info["attempt"],
                "peer_id": k.peer_id,
                "cid": cid,
                "start_hash": info["start_hash"],
                "size": len(data),
                "tokens": steps * 128,
                "inner_steps": steps,
            }
            path = "/v1/rounds/0/contributions"
            resp = post(http, path, k.sign_request(body, 0, purpose=f"POST {path}"))
            assert resp.status_code == 200, resp.text
        t0 = time.monotonic()
        cert = until(
            "the certificate",
            lambda: (r := http.get("/v1/rounds/0/certificate")).status_code == 200 and r.json(),
        )
        t_cert = time.monotonic() - t0
        # one worker's result step: it holds its own contribution, fetches the rest
        got = 0
        if mode == "gather":
            contributions = []
            for j, a in enumerate(cert["accepted"]):
                blob = payloads[a["cid"]] if j == 0 else http.get(f"/v1/blobs/{a['cid']}").content
                got += 0 if j == 0 else len(blob)
                contributions.append(
                    Contribution(blob, a["tokens"], a["inner_steps"], a["fragment"])
                )
            digest = setup.strategy.apply_round(setup.template, contributions).digest()
        else:
            board = http.get("/v1/shards/0").json()
            state = fetch_round_shards(
                board,
                cert["new_hash"],
                cluster.url,
                setup.coordinator_key,
                setup.template,
                list(setup.strategy.names),
                True,
            )
            assert state is not None
            digest = state.digest()
            bounds = board["certificate"]["bounds"]
            got = 8 * (bounds[-1] - bounds[0])  # params and momentum, float32
        t_done = time.monotonic() - t0
        assert digest == cert["new_hash"], "the worker's state is not the certified one"
        caught = None
        if liar:
            caught = _caught(http, cluster.url, aggs, payloads, setup, cert, shards)
        stop.set()
        for a in aggs:
            a.close()
        for s in servers:
            s.close()
        return {
            "peers": n,
            "path": mode,
            "model": model,
            "numel": numel,
            "contribution_bytes": len(next(iter(payloads.values()))),
            "worker_download_bytes": got,
            "aggregator_read_bytes": sum(a.bytes_read for a in aggs),
            "certificate_s": round(t_cert, 3),
            "worker_state_s": round(t_done, 3),
            **(caught or {}),
        }


def _caught(
    http: httpx.Client,
    url: str,
    aggs: list[ShardAggregator],
    payloads: dict[str, bytes],
    setup: Any,
    cert: dict[str, Any],
    shards: int,
) -> dict[str, Any]:
    """What one round did to the liar (aggs[0]) and to the model (see the module)."""
    liar = aggs[0]
    me = liar.identity.peer_id
    board = until(  # the late check runs after the commit: its verdict is part of the round
        "the late check",
        lambda: (
            (b := http.get("/v1/shards/0").json()).get("late_check", {}).get("status") == "done"
            and b
        ),
    )
    final, late = board["certificate"], board["late_check"]
    accounts = http.get("/v1/ledger/balances").json()["accounts"]
    banned = accounts[me]["banned"]
    honest_banned = sum(accounts[a.identity.peer_id]["banned"] for a in aggs[1:])
    late_liar = any(c["aggregator"] == me for c in late["convicted"])
    # the draw, recomputed from the board's public beacon: the liar's first-turn shards
    # and which of them were drawn for a check
    beacon = board.get("beacon")  # the board is kept a few rounds after its commit
    drawn = None
    if beacon is not None:
        orders = assign_shards(beacon, 0, shards, [a.identity.peer_id for a in aggs])
        mine = [s for s in range(shards) if orders[s][0] == me]
        drawn = sum(drawn_for_check(beacon, 0, s, CHECK_RATE) for s in mine)
    contributions = [
        Contribution(payloads[a["cid"]], a["tokens"], a["inner_steps"], a["fragment"])
        for a in cert["accepted"]
    ]
    clean = setup.strategy.apply_round(setup.template, contributions).digest()
    return {
        "liar": getattr(liar, "mode", None),
        "lies": getattr(liar, "lies", 0),
        "caught": bool(banned),
        "caught_in_round": bool(banned) and not late_liar,
        "caught_late": late_liar,
        "late_check_s": late["seconds"],
        "honest_banned": honest_banned,
        "liar_shards_drawn_for_check": drawn,
        "liar_shards_certified": sum(s["aggregator"] == me for s in final["shards"]),
        "model_clean": cert["new_hash"] == clean,
    }


def run_shards_bench(
    peers: list[int],
    model: str,
    shards: int,
    json_path: Path | None,
    liar: str | None = None,
    trials: int = 1,
) -> list[dict[str, Any]]:
    """Both paths at every peer count (with `liar`: the sharded path, `trials` rounds);
    rows as `one` returns them, printed as they come, and with a liar a summary row."""
    rows = []
    paths = ("sharded",) if liar else ("gather", "sharded")
    for n in peers:
        for mode in paths:
            for _ in range(trials if liar else 1):
                with tempfile.TemporaryDirectory() as d:
                    row = one(n, mode, model, shards, Path(d), liar)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if json_path is not None:
                    json_path.write_text(json.dumps(rows, indent=1))
    if liar and rows:
        mine = [r for r in rows if "caught" in r]
        summary = {
            "summary": f"lying aggregator ({liar}), 1 of 3, shard_check_rate {CHECK_RATE}",
            "rounds": len(mine),
            "caught": sum(r["caught"] for r in mine),
            "caught_per_round": round(sum(r["caught"] for r in mine) / len(mine), 3),
            "caught_in_round": sum(r["caught_in_round"] for r in mine),
            "caught_late": sum(r["caught_late"] for r in mine),
            "honest_banned": sum(r["honest_banned"] for r in mine),
            "late_check_s_mean": round(sum(r["late_check_s"] for r in mine) / len(mine), 3),
            "certificate_s_mean": round(sum(r["certificate_s"] for r in mine) / len(mine), 3),
            "rounds_with_lies_in_model": sum(not r["model_clean"] for r in mine),
            "lies_published": sum(r["lies"] for r in mine),
        }
        rows.append(summary)
        print(json.dumps(summary), flush=True)
        if json_path is not None:
            json_path.write_text(json.dumps(rows, indent=1))
    return rows
