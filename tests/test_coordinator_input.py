"""Bad input against a real coordinator process: each request gets a clear 4xx, is
logged, changes nothing, and the coordinator keeps serving. The test itself is the only
peer (it joins and heartbeats, signing with its own key), so it controls exactly what is
submitted, and it forges, replays and re-targets signatures (to other rounds, runs and
endpoints). A worker told another run id than the coordinator's refuses to join."""

from __future__ import annotations

import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from covey.algorithms.codecs import get_codec
from covey.blobs.client import upload_headers
from covey.config import RunConfig, run_id_of
from covey.local.cluster import LocalCluster
from covey.protocol.content import content_id
from covey.trust.identity import (
    NO_ROUND,
    Identity,
    body_content_id,
    make_nonce,
    request_message,
    request_purpose,
)

pytestmark = pytest.mark.network

SPEC = """
name = "bad-input"
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 4
inner_state = "reset"  # a contribution is then its payload alone: no local state to name
[rounds]
# generous: under CI load neither a deadline nor a late heartbeat may close the tester's
# round in the middle of a test (each test expects the round it saw open to stay open)
deadline_min_s = 600
deadline_max_s = 600
dead_after_s = 60
eval_batches = 1
[limits]
max_json_bytes = 4096
max_blob_bytes = 1048576
[trust]
min_stake = 0.0  # the tester joins unfunded: what is tested is the input, not the stake
"""
NUMEL = 120_576  # nano GPT's parameters


def signed(key: Identity, body: dict[str, Any], path: str, round: int = NO_ROUND) -> dict:
    """`body` signed by `key` for a POST to `path` (its purpose) and `round`."""
    return key.sign_request(body, round, purpose=request_purpose(path))


class Peer:
    def __init__(self, cluster: LocalCluster) -> None:
        self.http = httpx.Client(base_url=cluster.url, timeout=10, trust_env=False)
        self.run_id = cluster.get("/v1/run")["run_id"]
        self.key = Identity.generate()
        self.id = self.key.peer_id
        join = {
            "run_id": self.run_id,
            "peer_id": self.id,
            "public_key": self.key.public_key,
            "name": "tester",
            "step_time_s": 0.01,
        }
        assert (
            self.http.post("/v1/join", json=signed(self.key, join, "/v1/join")).status_code == 200
        )
        self.stop = threading.Event()
        self.beats = threading.Thread(target=self._beat, daemon=True)
        self.beats.start()

    def _beat(self) -> None:
        body = {"run_id": self.run_id, "peer_id": self.id}
        while not self.stop.wait(1.0):
            try:  # one slow or refused beat must not end the thread (the peer would die)
                self.http.post("/v1/heartbeat", json=signed(self.key, body, "/v1/heartbeat"))
            except httpx.HTTPError:
                continue

    def contribution(self, cid: str, size: int, **changes: Any) -> dict[str, Any]:
        """A signed contribution (signed for the body's round, after `changes`)."""
        info = self.http.get("/v1/round", params={"peer_id": self.id}).json()
        body = {
            "run_id": self.run_id,
            "round": info["round"],
            "attempt": info["attempt"],
            "peer_id": self.id,
            "cid": cid,
            "start_hash": info["start_hash"],
            "size": size,
            "tokens": 4 * 64 * 4,
            "inner_steps": 4,
        }
        body = {**body, **changes}
        path = f"/v1/rounds/{body['round']}/contributions"
        return signed(self.key, body, path, body["round"])

    def upload(self, data: bytes) -> str:
        cid = content_id(data)
        headers = upload_headers(self.key, self.run_id, cid, len(data))  # members only
        assert self.http.put(f"/v1/blobs/{cid}", content=data, headers=headers).status_code == 200
        return cid


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Peer]]:
    tmp: Path = tmp_path_factory.mktemp("bad-input")
    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    cluster = LocalCluster(spec, tmp)
    cluster.start_coordinator()
    peer = Peer(cluster)
    cluster.wait_for(lambda s: s["phase"] == "open", 30, "the tester's round to open")
    yield cluster, peer
    peer.stop.set()
    cluster.stop()


def snapshot(cluster: LocalCluster) -> tuple[Any, ...]:
    s = cluster.status()
    return s["weights_hash"], s["committed_rounds"], s["round"], s["submitted"], s["bytes_total"]


def refused(cluster: LocalCluster, resp: httpx.Response, status: int, words: str) -> None:
    """The reply is `status` with a message containing `words`; nothing changed."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    message = " ".join([body["error"], *body.get("problems", [])])
    assert words in message, message
    assert cluster.get("/v1/status")["phase"] == "open"  # still serving


def fp32_payload(values: torch.Tensor) -> bytes:
    return get_codec("fp32").encode(values)


CASES = {
    "malformed json": lambda p: p.http.post(
        "/v1/join", content=b"{not json", headers={"content-type": "application/json"}
    ),
    "wrong types": lambda p: p.http.post(
        "/v1/join", json={"run_id": p.run_id, "peer_id": "x", "step_time_s": "fast"}
    ),
    "unknown field": lambda p: p.http.post(
        "/v1/heartbeat",
        json=signed(p.key, {"run_id": p.run_id, "peer_id": p.id, "admin": True}, "/v1/heartbeat"),
    ),
    "oversized json": lambda p: p.http.post(
        "/v1/join", json={"run_id": p.run_id, "peer_id": "x", "device": "y" * 5000}
    ),
}
EXPECT = {
    "malformed json": (422, "JSON"),
    "wrong types": (422, "step_time_s"),
    "unknown field": (422, "admin"),
    "oversized json": (413, "limit of 4096 bytes"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_requests_are_refused(world: tuple[LocalCluster, Peer], case: str) -> None:
    cluster, peer = world
    before = snapshot(cluster)
    refused(cluster, CASES[case](peer), *EXPECT[case])
    assert snapshot(cluster) == before


def test_oversized_and_mismatched_blobs(world: tuple[LocalCluster, Peer]) -> None:
    cluster, peer = world
    before = snapshot(cluster)
    big = b"x" * (1048576 + 1)
    refused(cluster, peer.http.put(f"/v1/blobs/{content_id(big)}", content=big), 413, "limit")
    data = fp32_payload(torch.zeros(NUMEL))  # a size this run takes, signed for another cid
    liar = content_id(b"other bytes")
    sign = upload_headers(peer.key, peer.run_id, liar, len(data))
    refused(cluster, peer.http.put(f"/v1/blobs/{liar}", content=data, headers=sign), 400, "hash")
    assert peer.http.get(f"/v1/blobs/{liar}").status_code == 404  # nothing was stored
    refused(cluster, peer.http.put("/v1/blobs/..coordinator.db", content=data), 400, "content id")
    refused(cluster, peer.http.put("/v1/blobs/..%2fdb", content=data), 404, "Not Found")
    assert snapshot(cluster) == before


def test_bad_contributions_are_refused(world: tuple[LocalCluster, Peer]) -> None:
    cluster, peer = world
    good = fp32_payload(torch.full((NUMEL,), 1e-3))
    good_cid = peer.upload(good)
    before = snapshot(cluster)
    post = peer.http.post
    rnd = before[2]

    def submit(body: dict[str, Any], round_: int = rnd) -> httpx.Response:
        return post(f"/v1/rounds/{round_}/contributions", json=body)

    other_round = peer.contribution(good_cid, len(good), round=rnd + 1)
    refused(cluster, submit(other_round, rnd + 1), 409, "not open")
    refused(cluster, submit(peer.contribution(good_cid, len(good), run_id="0" * 16)), 409, "run")
    not_uploaded = content_id(b"never uploaded")
    refused(cluster, submit(peer.contribution(not_uploaded, len(good))), 409, "not uploaded")
    refused(cluster, submit(peer.contribution(good_cid, len(good) + 1)), 422, "bytes")
    stale = peer.contribution(good_cid, len(good), start_hash="a" * 64)
    refused(cluster, submit(stale), 409, "trained from weights")
    greedy = peer.contribution(good_cid, len(good), inner_steps=99, tokens=10**9)
    refused(cluster, submit(greedy), 422, "assigned")
    # wrong shape: a tensor with too few elements
    short = fp32_payload(torch.zeros(NUMEL - 1))  # refused at upload: not the run's size
    sign = upload_headers(peer.key, peer.run_id, content_id(short), len(short))
    put = peer.http.put(f"/v1/blobs/{content_id(short)}", content=short, headers=sign)
    refused(cluster, put, 413, "this run's blobs")
    # wrong dtype: fp16 bytes where the run takes fp32
    half = get_codec("fp16").encode(torch.zeros(NUMEL))  # half the size: refused at upload
    sign = upload_headers(peer.key, peer.run_id, content_id(half), len(half))
    put = peer.http.put(f"/v1/blobs/{content_id(half)}", content=half, headers=sign)
    refused(cluster, put, 413, "this run's blobs")
    # NaN and Inf smuggled into otherwise valid fp32 bytes
    for bad in (float("nan"), float("inf")):
        raw = bytearray(good)
        raw[-4:] = struct.pack("<f", bad)
        blob = bytes(raw)
        resp = submit(peer.contribution(peer.upload(blob), len(blob)))
        refused(cluster, resp, 422, "NaN or Inf")
    garbage = b"CVY1" + bytes(len(good) - 4)
    resp = submit(peer.contribution(peer.upload(garbage), len(garbage)))
    refused(cluster, resp, 422, "unknown codec id")
    assert snapshot(cluster)[:4] == before[:4]  # blobs were stored, nothing was submitted
    log = cluster.tail("coordinator", lines=400)
    assert "contribution rejected" in log and "not uploaded" in log

    # the same coordinator still takes a good contribution, and commits the round with it
    assert submit(peer.contribution(good_cid, len(good))).status_code == 200
    status = cluster.wait_for(lambda s: s["committed_rounds"] == before[1] + 1, 60, "the commit")
    cert = cluster.get(f"/v1/rounds/{rnd}/certificate")
    assert [a["name"] for a in cert["accepted"]] == ["tester"]
    assert status["weights_hash"] == cert["new_hash"] != before[0]
    # once the round is closed, a contribution for it is late, and says so
    late = peer.contribution(good_cid, len(good), round=rnd)
    refused(cluster, submit(late), 409, "late")


def test_forged_replayed_and_retargeted_signatures(world: tuple[LocalCluster, Peer]) -> None:
    """A wrong key, an altered body, a replayed request, and signatures made for another
    run or another round are all refused with 401, and change nothing."""
    cluster, peer = world
    payload = fp32_payload(torch.full((NUMEL,), 2e-3))
    cid = peer.upload(payload)
    before = snapshot(cluster)
    rnd = before[2]
    url = f"/v1/rounds/{rnd}/contributions"
    good = peer.contribution(cid, len(payload))

    mallory = Identity.generate()  # signs as if it were the tester
    forged = signed(mallory, {k: v for k, v in good.items() if k != "nonce"}, url, rnd)
    refused(cluster, peer.http.post(url, json=forged), 401, "signature does not verify")
    altered = {**good, "tokens": good["tokens"] - 1}  # signed body, then changed
    refused(cluster, peer.http.post(url, json=altered), 401, "signature does not verify")
    # signed for the next round, then sent as this round's (body says this round)
    wrong_round = {**good, "signature": signed(peer.key, good, url, rnd + 1)["signature"]}
    refused(cluster, peer.http.post(url, json=wrong_round), 401, "signature does not verify")
    # a signature made for another run's id, with the run id then set to this run
    other = {**good, "run_id": "f" * 16}
    other = {**signed(peer.key, other, url, rnd), "run_id": peer.run_id}
    refused(cluster, peer.http.post(url, json=other), 401, "signature does not verify")
    old = {**good, "nonce": "1000000000000-0000000000000000"}  # 2001: far outside the window
    old["signature"] = peer.key.sign(request_message(old, rnd, request_purpose(url)))
    refused(cluster, peer.http.post(url, json=old), 401, "old")
    # heartbeats too: a forged one, then a replay of a genuine one
    beat = signed(peer.key, {"run_id": peer.run_id, "peer_id": peer.id}, "/v1/heartbeat")
    assert peer.http.post("/v1/heartbeat", json=beat).status_code == 200
    refused(cluster, peer.http.post("/v1/heartbeat", json=beat), 401, "replayed")
    fake_beat = signed(mallory, {"run_id": peer.run_id, "peer_id": peer.id}, "/v1/heartbeat")
    refused(cluster, peer.http.post("/v1/heartbeat", json=fake_beat), 401, "signature")
    # a join whose id is not its key's hash
    join = {
        "run_id": peer.run_id,
        "peer_id": peer.id,
        "public_key": mallory.public_key,
        "step_time_s": 0.01,
    }
    refused(
        cluster, peer.http.post("/v1/join", json=signed(mallory, join, "/v1/join")), 400, "hash"
    )
    assert snapshot(cluster)[:4] == before[:4]

    # the genuine request is accepted once; sent again verbatim it is a replay
    assert peer.http.post(url, json=good).status_code == 200, "genuine contribution refused"
    refused(cluster, peer.http.post(url, json=good), 401, "replayed")


def test_openapi_document_is_served(world: tuple[LocalCluster, Peer]) -> None:
    cluster, _ = world
    doc = cluster.get("/openapi.json")
    for path in (
        "/v1/join",
        "/v1/heartbeat",
        "/v1/leave",
        "/v1/round",
        "/v1/status",
        "/v1/rounds/{round}/contributions",
        "/v1/rounds/{round}/certificate",
        "/v1/checkpoints",
        "/v1/blobs/{cid}",
        "/v1/run",
    ):
        assert path in doc["paths"], path


def test_a_signed_body_is_valid_at_its_own_endpoint_only(world: tuple[LocalCluster, Peer]) -> None:
    """A signature covers the endpoint it was made for: a heartbeat captured on its way to
    the coordinator is refused as a leave (and a leave as a heartbeat), nothing changes,
    and the heartbeat still counts where it was meant to go."""
    cluster, peer = world
    # a round nobody has submitted to yet: the last test's round has committed (and written
    # its certificate to the ledger), and nothing else will happen until the tester submits
    cluster.wait_for(
        lambda s: s["phase"] == "open" and s["submitted"] == 0, 60, "a fresh round to open"
    )
    before = snapshot(cluster)
    ledger_before = len(cluster.get("/v1/ledger"))
    who = {"run_id": peer.run_id, "peer_id": peer.id}
    beat = signed(peer.key, who, "/v1/heartbeat")  # captured, never delivered
    refused(cluster, peer.http.post("/v1/leave", json=beat), 401, "at POST /v1/leave")
    leave = signed(peer.key, who, "/v1/leave")  # the reason left at its default
    refused(cluster, peer.http.post("/v1/heartbeat", json=leave), 401, "another endpoint")
    # the same body signed as before purposes existed (covey-request/v1) is refused too
    legacy = {**who, "nonce": make_nonce()}
    text = f"covey-request/v1\n{peer.run_id}\n-1\n{body_content_id(legacy)}\n{legacy['nonce']}"
    legacy["signature"] = peer.key.sign(text.encode())
    refused(cluster, peer.http.post("/v1/leave", json=legacy), 401, "signature does not verify")

    states = {p["peer_id"]: p["state"] for p in cluster.status()["peers"]}
    assert states[peer.id] not in ("left", "dead")  # it did not leave
    assert len(cluster.get("/v1/ledger")) == ledger_before  # no "leave" entry
    assert snapshot(cluster) == before
    # refused before its nonce was used: the captured heartbeat is good at its own endpoint
    assert peer.http.post("/v1/heartbeat", json=beat).status_code == 200


def test_a_coordinator_of_another_run_id_is_refused(world: tuple[LocalCluster, Peer]) -> None:
    """A worker told a run id refuses a coordinator whose spec hashes to another one: here
    the same spec under another coordinator key (no trust on first use)."""
    cluster, _ = world
    spec = cluster.get("/v1/run")["spec"]
    impostor = {**spec, "coordinator_key": Identity.generate().public_key}
    wrong = RunConfig.model_validate(impostor).run_id
    assert wrong != cluster.run_id
    served = cluster.get("/v1/run")["corpus_fingerprint"]
    assert run_id_of(RunConfig.model_validate(spec), served) == cluster.run_id  # key in the id
    cluster.start_worker("stranger", "--run-id", wrong, "--connect-timeout", "30")
    assert cluster.wait_exit("stranger", 60) == 1
    log = cluster.tail("stranger", lines=50)
    assert f"refusing coordinator {cluster.url}" in log and f"not --run-id {wrong}" in log, log
    ids = {p["peer_id"] for p in cluster.status()["peers"]}
    assert cluster.ids["stranger"] not in ids  # it never joined


def test_a_coordinator_refuses_a_spec_naming_another_key(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(f'coordinator_key = "{Identity.generate().public_key}"\n' + SPEC)
    done = subprocess.run(
        [sys.executable, "-m", "covey", "coordinator", str(spec), "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "is not this coordinator's key" in done.stderr, done.stderr
