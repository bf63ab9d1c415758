"""The late check of a sharded round (covey.coordinator.shard_audit), through a real
coordinator process: after a round's shard certificate, the coordinator recomputes every
certified shard from the signed board and convicts a wrong one late.

Two staked aggregator keys (threads here, each serving its shards from its own blob
server) do the 4 shards of round 0; one lies (it leaves one worker's payload out of every
shard it publishes, covey.peer.cheater_aggregator). Two ways its lies get certified:

- no shard is drawn for a check (`shard_check_rate = 0`): the other aggregator is honest;
- every shard is drawn (`shard_check_rate = 1`), and the other key, drawn to check the
  liar's shards, agrees with whatever was published (`agree_blindly`).

Either way the late check convicts the liar (a slash per wrong shard, with evidence that
`covey ledger verify --recompute` recomputes), and the checker that agreed pays the
missed-fraud penalty, on the ledger, backed by its own signed check; the aggregator whose
shards were right is never slashed. A ledger copy that writes a checker as having agreed
with a lie without its signed word does not verify."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from covey.algorithms import Contribution
from covey.blobs import BlobServer, BlobStore
from covey.io import audit
from covey.local.cluster import LocalCluster
from covey.peer.cheater_aggregator import LyingAggregator
from covey.peer.client import CoordinatorClient
from covey.peer.runsetup import set_up_run
from covey.protocol.content import content_id
from covey.trust.identity import Identity
from covey.trust.ledger import LedgerError, append, read_entries
from tests.test_shards_network import SPEC, Worker, _copy, _json_if_ok, _upload, post, until

pytestmark = [pytest.mark.network]

STAKE = 5.0


class Pair:
    """Two staked aggregator keys polling the pending board in threads: `liar` drops a
    payload from its shards; `other` is honest, or agrees blindly with what it checks."""

    def __init__(self, cluster: LocalCluster, http: httpx.Client, setup: Any, tmp: Path,
                 blind: bool) -> None:  # fmt: skip
        self.keys = [Identity.generate() for _ in range(2)]
        self.aggs: list[LyingAggregator] = []
        self.servers: list[BlobServer] = []
        for i, k in enumerate(self.keys):
            cluster.fund(k.public_key, STAKE)
            body = {"run_id": cluster.run_id, "validator_id": k.peer_id,
                    "public_key": k.public_key, "stake": STAKE}  # fmt: skip
            path = "/v1/validators/join"
            resp = post(http, path, k.sign_request(body, -1, purpose=f"POST {path}"))
            assert resp.status_code == 200, resp.text
            store = BlobStore(tmp / f"agg{i}")
            self.servers.append(BlobServer(store))
            url = self.servers[-1].start()
            mode = {"mode": "drop"} if i == 0 else {"agree_blindly": blind}
            self.aggs.append(LyingAggregator(cluster.url, k, cluster.run_id, setup.strategy,
                                             setup.cfg.algorithm, store, url, **mode))  # fmt: skip
        self.liar, self.other = self.keys[0].peer_id, self.keys[1].peer_id
        self.stop, self.errors, self.ready = threading.Event(), [], 0
        self.threads = [
            threading.Thread(target=self._loop, args=(a, setup.template), daemon=True)
            for a in self.aggs
        ]
        for t in self.threads:
            t.start()

    def _loop(self, agg: LyingAggregator, template: Any) -> None:
        agg.ready()
        self.ready += 1
        while not self.stop.wait(0.2):
            try:
                agg.poll(template)
            except Exception as e:  # a banned liar is refused (403): it stops
                self.errors.append(f"{agg.identity.peer_id[:8]}: {e}")
                if "excluded" in str(e):
                    return

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        for a in self.aggs:
            a.close()
        for s in self.servers:
            s.close()


def _round0(tmp: Path, check_rate: float, blind: bool) -> Iterator[dict[str, Any]]:
    spec = SPEC.replace("shard_check_rate = 1.0", f"shard_check_rate = {check_rate}")
    (tmp / "run.toml").write_text(spec)
    with LocalCluster(tmp / "run.toml", tmp) as cluster:
        cluster.start_coordinator()
        http = httpx.Client(base_url=cluster.url, timeout=20, trust_env=False)
        setup = set_up_run(CoordinatorClient(cluster.url), threads=1)
        pair = Pair(cluster, http, setup, tmp, blind)
        until("the aggregators to be ready", lambda: pair.ready == 2)
        workers = [Worker(cluster, http, cluster.run_id) for _ in range(2)]
        try:
            info = until(
                "round 0 to open with both workers",
                lambda: (
                    (r := http.get("/v1/round").json())["phase"] == "open"
                    and all(
                        http.get("/v1/round", params={"peer_id": w.key.peer_id}).json()["member"]
                        for w in workers
                    )
                    and r
                ),
            )
            numel = sum(setup.template.params[n].numel() for n in setup.strategy.names)
            g = torch.Generator().manual_seed(1)
            payloads = {}
            for i, w in enumerate(workers):
                mine = http.get("/v1/round", params={"peer_id": w.key.peer_id}).json()
                steps = mine["assignment"]["inner_steps"]
                data = setup.strategy.codec.encode(torch.randn(numel, generator=g) * 1e-3 * (i + 1))
                cid = content_id(data)
                payloads[cid] = data
                resp = http.put(f"/v1/blobs/{cid}", content=data,
                                headers=_upload(w.key, cluster.run_id, cid, len(data)))  # fmt: skip
                assert resp.status_code in (200, 201), resp.text
                body = {"run_id": cluster.run_id, "round": 0, "attempt": info["attempt"],
                        "peer_id": w.key.peer_id, "cid": cid, "start_hash": info["start_hash"],
                        "size": len(data), "tokens": steps * 4 * 32 - i,
                        "inner_steps": steps}  # fmt: skip
                path = "/v1/rounds/0/contributions"
                resp = post(http, path, w.key.sign_request(body, 0, purpose=f"POST {path}"))
                assert resp.status_code == 200, resp.text
            cert = until("round 0's certificate",
                         lambda: _json_if_ok(http, "/v1/rounds/0/certificate"), 120)  # fmt: skip
            late = until(
                "round 0's late check",
                lambda: (
                    (b := _json_if_ok(http, "/v1/shards/0"))
                    and b["late_check"]["status"] == "done"
                    and b["late_check"]
                ),
                120,
            )
            contributions = [
                Contribution(payloads[a["cid"]], a["tokens"], a["inner_steps"], a["fragment"])
                for a in cert["accepted"]
            ]
            clean = setup.strategy.apply_round(setup.template, contributions).digest()
            yield {"cluster": cluster, "http": http, "cert": cert, "late": late, "pair": pair,
                   "clean": clean, "tmp": tmp}  # fmt: skip
        finally:
            for w in workers:
                w.stop.set()
            pair.close()


@pytest.fixture(scope="module")
def colluded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every shard drawn for a check; the liar's checker agrees blindly."""
    yield from _round0(tmp_path_factory.mktemp("colluded"), 1.0, blind=True)


@pytest.fixture(scope="module")
def undrawn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """No shard drawn for a check; the other aggregator is honest."""
    yield from _round0(tmp_path_factory.mktemp("undrawn"), 0.0, blind=False)


def _entries(run: dict[str, Any]) -> list[Any]:
    return read_entries(run["cluster"].data_dir / audit.DB_FILE)


def _convicted_late(run: dict[str, Any]) -> list[int]:
    """The liar's shards of round 0 the late check convicted (asserting it is the liar's
    and only the liar's), and the ledger's slashes of it, each with shard evidence."""
    pair, late, entries = run["pair"], run["late"], _entries(run)
    (conviction,) = late["convicted"]
    assert conviction["aggregator"] == pair.liar, late
    assert late["checked"] == 4 and not late["unjudged"], late
    slashes = [e.payload for e in entries if e.type == "slash"]
    assert {s["peer_id"] for s in slashes} == {pair.liar}, "only the liar is slashed"
    assert sorted(s["evidence"]["shard"] for s in slashes) == conviction["shards"]
    assert all("late check" in s["reason"] for s in slashes)
    balances = run["cluster"].get("/v1/ledger/balances")["accounts"]
    assert balances[pair.liar]["banned"]
    assert not balances[pair.other]["banned"]  # its shards were right: never slashed
    # its lies were certified (the round's state is not undone: docs/trust.md), and the
    # ledger replays, each slash's shard recomputed from the signed board and the blobs
    assert run["cert"]["new_hash"] != run["clean"]
    report = audit.verify(run["cluster"].data_dir, recompute=True)
    assert report.shard_slashes == len(slashes) and report.recomputed
    return conviction["shards"]


def test_a_liar_whose_shards_no_check_drew_is_convicted_late(undrawn: dict[str, Any]) -> None:
    pair = undrawn["pair"]
    shards = _convicted_late(undrawn)
    cert = undrawn["http"].get("/v1/shards/0").json()["certificate"]
    assert shards == [s["index"] for s in cert["shards"] if s["aggregator"] == pair.liar]
    assert undrawn["late"]["convicted"][0]["agreed"] == []  # nobody checked anything
    entries = _entries(undrawn)
    assert not [e for e in entries if e.type in ("penalty", "verification")]
    assert pair.aggs[0].lies == len(shards) >= 1


def test_a_checker_that_agreed_with_a_lying_shard_pays_missed_fraud(
    colluded: dict[str, Any], tmp_path: Path
) -> None:
    pair, cluster = colluded["pair"], colluded["cluster"]
    _convicted_late(colluded)
    conviction = colluded["late"]["convicted"][0]
    assert conviction["agreed"] == [pair.other] and conviction["penalised"] == [pair.other]
    entries = _entries(colluded)
    (penalty,) = [e.payload for e in entries if e.type == "penalty"]
    spec = next(e.payload for e in entries if e.type == "run created")["spec"]
    fraction = spec.get("trust", {}).get("validator_slash_fraction", 0.5)
    assert penalty["peer_id"] == pair.other and penalty["kind"] == "missed fraud"
    assert penalty["amount"] == pytest.approx(fraction * STAKE)
    agreed = [e for e in entries if e.type == "verification"]
    assert agreed
    for e in agreed:  # each backed by the checker's own signed check
        assert e.payload["validator_id"] == e.payload["shard_check"]["peer_id"] == pair.other
    balances = cluster.get("/v1/ledger/balances")["accounts"]
    assert balances[pair.other]["stake"] == pytest.approx(STAKE - penalty["amount"])
    # the liar's own checks of the other's (right) shards cost it nothing more
    assert not [e for e in entries if e.type == "penalty" and e.payload["peer_id"] == pair.liar]

    # a coordinator cannot write a checker as having agreed with a lie it did not sign
    key = Identity.load_or_create(cluster.data_dir / "coordinator.key")
    signed = agreed[0].payload["shard_check"]
    forgeries = {
        "unsigned": {k: v for k, v in agreed[0].payload.items() if k != "shard_check"},
        "other hash": {**agreed[0].payload, "shard_check": {**signed, "hash": "0" * 64}},
        "other round": {**agreed[0].payload, "round": 1},
    }
    for name, payload in forgeries.items():
        out, dst = _copy(cluster, tmp_path, name.replace(" ", "-"))
        with dst:
            append(dst, key, "verification", payload, 1.0)
        dst.close()
        with pytest.raises(LedgerError, match="verification of aggregator"):
            audit.verify(out)
