"""Sharded aggregation as the round driver's path, through the HTTP API of a real
coordinator process.

Three staked validator keys join; two workers (this process, signed requests) submit int4
contributions to round 0. The round is above `sharded_above_peers`, so the driver does not
aggregate: it opens the shard board, and the three aggregators (polling `GET /v1/shards`)
compute its 4 shards, each reading only its shards' byte ranges of the contributions and
serving its new shards from its own blob server. One of them lies (it leaves one worker's
payload out of its shards, covey.peer.cheater_aggregator): the drawn checker
catches it, the referee recomputes the shard, the liar is slashed (ledger) and its shards
pass on; the driver assembles the certified shards and commits round 0 with the weights
hash of the unsharded `apply_round`, bit for bit. A peer assembles the same state shard by
shard, refusing the liar's copy."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from typer.testing import CliRunner

from covey.algorithms import Contribution
from covey.blobs import BlobServer, BlobStore
from covey.blobs.client import upload_headers
from covey.cli import app
from covey.io import audit
from covey.local.cluster import LocalCluster
from covey.peer.aggregator import (
    certified_shard,
    check_certificate,
    fetch_certified_state,
    shard_purpose,
)
from covey.peer.cheater_aggregator import LyingAggregator
from covey.peer.client import CoordinatorClient
from covey.peer.runsetup import set_up_run
from covey.protocol.content import content_id
from covey.trust.identity import Identity
from covey.trust.incentives import Book
from covey.trust.ledger import LedgerError, append, read_entries
from covey.trust.shard_evidence import board_digest, read_inputs

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
min_peers = 2
deadline_min_s = 30
deadline_max_s = 60
eval_batches = 1
max_rounds = 1
[trust]
min_stake = 1
sample_rate = 0
new_peer_rate = 0
canary_rate = 0
sharded_above_peers = 2
shards = 4
shard_check_rate = 1.0
shard_publish_timeout_s = 30
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
    def __init__(self, cluster: LocalCluster, http: httpx.Client, run_id: str) -> None:
        self.http, self.run_id, self.key = http, run_id, Identity.generate()
        cluster.fund(self.key.public_key, 1.0)  # the run's owner funds what it bonds
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


class Aggregators:
    """Three staked aggregator keys polling the pending board, each in its own thread,
    serving its shards from its own blob server; `liar` publishes wrong shards."""

    def __init__(self, cluster: LocalCluster, http: httpx.Client, setup: Any, tmp: Path) -> None:
        self.keys = [Identity.generate() for _ in range(3)]
        for k in self.keys:
            cluster.fund(k.public_key, 5.0)
            body = {"run_id": cluster.run_id, "validator_id": k.peer_id,
                    "public_key": k.public_key, "stake": 5.0}  # fmt: skip
            path = "/v1/validators/join"
            resp = post(http, path, k.sign_request(body, -1, purpose=f"POST {path}"))
            assert resp.status_code == 200, resp.text
        self.liar = ""  # shard 0's first aggregator, read off the board once it opens
        self._lock = threading.Lock()
        self.ready = 0
        self.servers, self.workers = [], []
        for i, k in enumerate(self.keys):
            store = BlobStore(tmp / f"agg{i}")
            server = BlobServer(store)
            self.servers.append(server)
            url = server.start()
            self.workers.append(
                LyingAggregator(  # honest until it is picked as the liar
                    cluster.url,
                    k,
                    cluster.run_id,
                    setup.strategy,
                    setup.cfg.algorithm,
                    store,
                    url,  # type: ignore[arg-type]
                )
            )
        self.stop, self.errors = threading.Event(), []
        self.threads = [
            threading.Thread(target=self._loop, args=(a, setup.template), daemon=True)
            for a in self.workers
        ]
        for t in self.threads:
            t.start()

    def _loop(self, agg: LyingAggregator, template: Any) -> None:
        http = httpx.Client(base_url=agg.coordinator, timeout=20, trust_env=False)
        agg.ready()  # in the draw from now on
        with self._lock:
            self.ready += 1
        while not self.liar:  # nobody publishes before the liar is known
            if self.stop.wait(0.1):
                return
            with self._lock:
                if not self.liar and (board := _json_if_ok(http, "/v1/shards")):
                    self.liar = board["shards"][0]["aggregator"]
        if agg.identity.peer_id == self.liar:
            agg.mode = "drop"  # leaves one worker's payload out of every shard it publishes
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
        for a in self.workers:
            a.close()
        for s in self.servers:
            s.close()


@pytest.fixture(scope="module")
def round0(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp: Path = tmp_path_factory.mktemp("shards")
    (tmp / "run.toml").write_text(SPEC)
    with LocalCluster(tmp / "run.toml", tmp) as cluster:
        cluster.start_coordinator()
        http = httpx.Client(base_url=cluster.url, timeout=20, trust_env=False)
        run_id = cluster.run_id
        setup = set_up_run(CoordinatorClient(cluster.url), threads=1)
        aggs = Aggregators(cluster, http, setup, tmp)
        until("the aggregators to be ready", lambda: aggs.ready == 3)
        workers = [Worker(cluster, http, run_id) for _ in range(2)]
        try:
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
            numel = sum(setup.template.params[n].numel() for n in setup.strategy.names)
            g = torch.Generator().manual_seed(0)
            payloads = {}
            for i, w in enumerate(workers):
                mine = http.get("/v1/round", params={"peer_id": w.key.peer_id}).json()
                steps = mine["assignment"]["inner_steps"]
                data = setup.strategy.codec.encode(torch.randn(numel, generator=g) * 1e-3 * (i + 1))
                cid = content_id(data)
                payloads[cid] = data
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
            cert = until(
                "round 0's certificate",
                lambda: _json_if_ok(http, "/v1/rounds/0/certificate"),
                timeout_s=120,
            )
            assert len(cert["accepted"]) == 2, cert
            yield {"cluster": cluster, "http": http, "setup": setup, "cert": cert, "tmp": tmp,
                   "aggs": aggs, "payloads": payloads}  # fmt: skip
        finally:
            for w in workers:
                w.stop.set()
            aggs.close()


def _upload(key: Identity, run_id: str, cid: str, size: int) -> dict[str, str]:
    return upload_headers(key, run_id, cid, size)


def _json_if_ok(http: httpx.Client, path: str) -> Any:
    resp = http.get(path)
    return resp.json() if resp.status_code == 200 else None


def test_the_round_driver_certifies_a_sharded_round_bit_exactly_and_slashes_a_liar(
    round0: dict[str, Any],
) -> None:
    cluster, http, setup, aggs = round0["cluster"], round0["http"], round0["setup"], round0["aggs"]
    cert = round0["cert"]
    # the driver's new_hash is the unsharded apply_round's, bit for bit
    contributions = [
        Contribution(round0["payloads"][a["cid"]], a["tokens"], a["inner_steps"], a["fragment"])
        for a in cert["accepted"]
    ]
    unsharded = setup.strategy.apply_round(setup.template, contributions)
    assert cert["new_hash"] == unsharded.digest()
    # ... and came from the aggregators' certified shards: the stored shard certificate
    board = http.get("/v1/shards/0").json()
    shard_cert = board["certificate"]
    assert shard_cert["new_hash"] == cert["new_hash"]
    check_certificate(shard_cert, setup.coordinator_key)
    coordinator_id = Identity.load_or_create(round0["tmp"] / "coordinator.key").peer_id
    assert {s["aggregator"] for s in shard_cert["shards"]} <= {k.peer_id for k in aggs.keys}
    assert coordinator_id not in {s["aggregator"] for s in shard_cert["shards"]}
    # the liar (first for at least one shard, every shard checked) was caught and slashed
    liar = aggs.liar
    balances = cluster.get("/v1/ledger/balances")["accounts"]
    assert balances[liar]["banned"] and balances[liar]["slashed"] == 2.5, balances[liar]
    assert liar not in {s["aggregator"] for s in shard_cert["shards"]}
    # each shard computed read only its ranges: a quarter of every contribution (+ heads)
    total = sum(a["size"] for a in cert["accepted"])
    for a in aggs.workers:
        assert a.bytes_read <= a.shards_computed * (total / 4 + 2 * 64), (a.bytes_read, total)
    # a peer refuses the liar's wrong shard, fetched from the liar's own server
    lying = next(a for a in aggs.workers if a.identity.peer_id == liar)
    assert lying.lies >= 1  # its wrong shards were taken, then caught
    bad = [c for c in lying.store.cids()]
    assert bad, "the liar published nothing"
    for c in bad:
        blob = http.get(f"{lying.blob_url}/v1/blobs/{c}").content
        index = next(
            (
                i
                for i in range(4)
                if len(blob) == 8 * (shard_cert["bounds"][i + 1] - shard_cert["bounds"][i])
            ),
            None,
        )
        if index is not None and c != shard_cert["shards"][index]["cid"]:
            with pytest.raises(ValueError, match="refused"):
                certified_shard(shard_cert, index, blob, True)
    # ... and assembles the state shard by shard from the certified sources
    state, refusals = fetch_certified_state(
        http, shard_cert, setup.coordinator_key, setup.template, setup.strategy.names, True
    )
    assert not refusals, refusals
    assert state.digest() == cert["new_hash"]


def _copy(cluster: LocalCluster, tmp: Path, name: str) -> tuple[Path, sqlite3.Connection]:
    """A copy of the coordinator's data directory (its blobs linked), its database open."""
    out = tmp / name
    out.mkdir()
    (out / "blobs").symlink_to(cluster.data_dir / "blobs")
    src = sqlite3.connect(f"file:{cluster.data_dir / audit.DB_FILE}?mode=ro", uri=True)
    dst = sqlite3.connect(out / audit.DB_FILE)
    src.backup(dst)
    src.close()
    return out, dst


def _forged(cluster: LocalCluster, tmp: Path, name: str, slash: dict[str, Any]) -> Path:
    """A copy whose ledger gains one more "slash", chained and signed with the
    coordinator's own key: what a coordinator framing an aggregator would write."""
    out, dst = _copy(cluster, tmp, name)
    key = Identity.load_or_create(cluster.data_dir / "coordinator.key")
    book = Book.replay(read_entries(out / audit.DB_FILE))
    with dst:
        append(dst, key, "slash", {**slash, "amount": book.slash_amount(slash["peer_id"])}, 1.0)
    dst.close()
    return out


def test_ledger_verify_recomputes_the_liars_shard_and_refuses_a_framed_aggregator(
    round0: dict[str, Any], tmp_path: Path
) -> None:
    """`covey ledger verify --recompute` recomputes the shard behind the liar's slash from
    the run's blobs, over HTTP and from the data directory. A coordinator that appends a
    slash of an honest aggregator is caught: citing its real signed hash (the ledger alone
    cannot tell; the recomputation gives that very hash), a hash it never signed, no
    evidence at all, or the honest hash of a board it misled the aggregator with (other
    weights), whether the evidence gives that board or the real one."""
    cluster, aggs = round0["cluster"], round0["aggs"]
    for source in (cluster.url, cluster.data_dir):
        report = audit.verify(source, recompute=True)
        assert report.shard_slashes == 1 and report.recomputed, source
    entries = read_entries(cluster.data_dir / audit.DB_FILE)
    (real,) = [e.payload for e in entries if e.type == "slash"]
    assert real["peer_id"] == aggs.liar and real["evidence"]["published"]["peer_id"] == aggs.liar
    # an honest aggregator's certified shard, published and signed by it with its board
    shard_cert = round0["http"].get("/v1/shards/0").json()["certificate"]
    keys = {k.peer_id: k for k in aggs.keys}
    honest = next(s for s in shard_cert["shards"] if s["aggregator"] in keys)
    i, bounds = honest["index"], shard_cert["bounds"]
    board = {**real["evidence"]["board"], "span": [bounds[i], bounds[i + 1]]}

    def reads(board: dict[str, Any], tamper: bool = False) -> str:
        """The digest of the byte ranges an aggregator of `board` reads (one byte of the
        first contribution altered in transit with `tamper`)."""
        readers = []
        for k, (_, cid, _) in enumerate(board["inputs"]):
            data, calls = round0["payloads"][cid], [0 if tamper and k == 0 else -1]

            def base(x: int, y: int, d: bytes = data, n: list = calls) -> bytes:
                out = bytearray(d[x:y])
                if n[0] >= 0:
                    n[0] += 1
                    if n[0] == 2:  # the second range it reads (past the header), one bit
                        out[-1] ^= 0x01
                return bytes(out)

            readers.append(base)
        codec = round0["setup"].strategy.codec
        return read_inputs(codec, board["numel"], tuple(board["span"]), readers)[1]

    def publish(board: dict[str, Any], hash: str, tamper: bool = False) -> dict[str, Any]:
        body = {"run_id": cluster.run_id, "peer_id": honest["aggregator"], "index": i,
                "hash": hash, "cid": honest["cid"], "url": ""}  # fmt: skip
        body["reads"] = reads(board, tamper)
        body["board"] = board_digest(**board)
        key = keys[honest["aggregator"]]
        return key.sign_request(body, 0, purpose=shard_purpose(0, "publish"))

    frame = {"round": 0, "peer_id": honest["aggregator"], "reason": "wrong aggregate"}
    evidence = {**real["evidence"], "shard": i, "board": board, "truth": "0" * 64}
    evidence["published"] = publish(board, honest["hash"])
    framed = _forged(cluster, tmp_path, "framed", {**frame, "evidence": evidence})
    assert audit.verify(framed).shard_slashes == 2  # the ledger alone cannot tell
    with pytest.raises(LedgerError, match="an honest aggregator was slashed"):
        audit.verify(framed, recompute=True)
    made_up = {**evidence, "published": {**evidence["published"], "hash": "1" * 64}}
    with pytest.raises(LedgerError, match="is not signed by"):
        audit.verify(_forged(cluster, tmp_path, "made-up", {**frame, "evidence": made_up}))
    with pytest.raises(LedgerError, match="carries no shard evidence"):
        audit.verify(_forged(cluster, tmp_path, "bare", frame))
    # misled: the board it was served weighs the inputs the other way round
    inputs = board["inputs"]
    weights = [w for _, _, w in inputs][::-1]
    reversed_weights = [[p, c, w] for (p, c, _), w in zip(inputs, weights, strict=True)]
    misled = {**board, "inputs": reversed_weights}
    assert misled != board
    signed = publish(misled, "2" * 64)  # its honest hash of that board, whatever it is
    cases = (("misled", misled, "no accepted contribution"),
             ("certified", board, "does not name the board"))  # fmt: skip
    for name, cited, why in cases:
        forged = {**evidence, "published": signed, "board": cited}
        with pytest.raises(LedgerError, match=why):
            audit.verify(_forged(cluster, tmp_path, name, {**frame, "evidence": forged}))
    # misled in transit: the coordinator served the aggregator one altered byte
    # of a contribution's range; it signed the real board, the hash of what it read, and
    # the digest of those bytes, which are not the contributions'
    altered = {**evidence, "published": publish(board, "3" * 64, tamper=True)}
    forged = _forged(cluster, tmp_path, "altered", {**frame, "evidence": altered})
    assert audit.verify(forged).shard_slashes == 2
    with pytest.raises(LedgerError, match="not the contributions'"):
        audit.verify(forged, recompute=True)
    # the command line says so, and exits 1
    result = CliRunner().invoke(app, ["ledger", "verify", "--recompute", str(framed)])
    assert result.exit_code == 1 and "an honest aggregator was slashed" in result.output
    result = CliRunner().invoke(app, ["ledger", "verify", "--recompute", str(cluster.data_dir)])
    assert result.exit_code == 0, result.output
    assert "1 slash(es) of aggregators checked recomputed" in result.output


def test_a_blob_source_cannot_feed_the_auditor_without_bound() -> None:
    """A hole once open: `--recompute URL` read each blob whole, unbounded, before its
    hash was checked; the source is the party under audit. Now the run's blob client
    fetches it: a body past what the blob can be (`max_bytes`) fails at once."""
    sent = [0]
    chunk, cap = 1 << 20, 8 << 20

    class Endless(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            try:
                for _ in range(160):
                    self.wfile.write(b"\0" * chunk)
                    sent[0] += chunk
            except OSError:
                pass

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fetch = audit._blob_fetcher(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(audit.SourceError, match="cannot fetch blob"):
            fetch("ab" * 32, cap)
    finally:
        server.shutdown()
        server.server_close()
    assert sent[0] <= cap + 8 * chunk, f"the auditor was sent {sent[0] >> 20} MiB of one blob"


def test_ledger_verify_refuses_a_spec_other_than_the_one_served(
    round0: dict[str, Any], tmp_path: Path
) -> None:
    """A hole once open: --recompute took the spec from "run created" unchecked,
    so a coordinator could serve peers one spec and write another (another outer lr)
    under which an honest aggregator's shard recomputes differently. "run created" names
    the data fingerprint now, and its spec must hash with it to the run id peers checked."""
    cluster = round0["cluster"]
    entries = read_entries(cluster.data_dir / audit.DB_FILE)
    created = entries[0].payload
    assert audit.verify(cluster.data_dir).entries == len(entries)
    spec = {**created["spec"]}
    spec["algorithm"] = {**spec["algorithm"], "outer_lr": spec["algorithm"]["outer_lr"] / 2}
    out, dst = _copy(cluster, tmp_path, "swapped")
    key = Identity.load_or_create(cluster.data_dir / "coordinator.key")
    with dst:  # the whole chain written again, signed with the coordinator's key
        dst.execute("DELETE FROM ledger")
        for e in entries:
            payload = {**e.payload, "spec": spec} if e.index == 0 else e.payload
            append(dst, key, e.type, payload, e.at)
    dst.close()
    (out / audit.BALANCES_FILE).unlink(missing_ok=True)
    with pytest.raises(LedgerError, match="not run id"):
        audit.verify(out)
