"""Nothing unsigned or cheap can stall the run: each attack goes through HTTP (raw sockets
where the attack is in the framing) against one real coordinator process. The tester is
its own peers: it joins, heartbeats and signs with keys it makes, so it controls exactly
what is sent."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from covey.algorithms.codecs import get_codec
from covey.blobs.client import upload_headers
from covey.config import RoundsConfig
from covey.coordinator.limits import LongPolls, TokenBuckets
from covey.io import audit
from covey.local.cluster import LocalCluster
from covey.protocol.content import content_id
from covey.protocol.rounds import PeerView, no_show_backoff, plan_round
from covey.trust.identity import Identity
from covey.trust.polls import poll_headers

network = pytest.mark.network  # the attacks; the unit tests at the end need no process

SPEC = """
name = "dos"
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 4
inner_state = "reset"  # no local state to name: a bare payload is a whole contribution
[rounds]
deadline_min_s = 2
deadline_max_s = 2
eval_batches = 1
[limits]
max_blob_bytes = 1048576
body_timeout_s = 2
min_upload_bytes_s = 1048576
peer_rate = 5
peer_burst = 10
max_long_polls_per_peer = 1
no_show_backoff_s = 60
[trust]
min_stake = 1
"""
NUMEL = 120_576  # nano GPT's parameters
PAYLOAD = get_codec("fp32").nbytes(NUMEL)  # the only contribution size this run takes


class Peer:
    """A worker that joins and heartbeats (every 0.5 s) and does nothing else unless told."""

    def __init__(self, cluster: LocalCluster, **join: Any) -> None:
        self.http = httpx.Client(base_url=cluster.url, timeout=10, trust_env=False)
        self.run_id = cluster.get("/v1/run")["run_id"]
        self.key = Identity.generate()
        self.id = self.key.peer_id
        cluster.fund(self.key.public_key, join.get("stake", 1.0))  # the owner funds it
        body = {
            "run_id": self.run_id,
            "peer_id": self.id,
            "public_key": self.key.public_key,
            "name": "tester",
            "step_time_s": 0.01,
            "stake": 1.0,  # the run's minimum: identities are not free
            **join,
        }
        for _ in range(20):  # the join-burst test may have spent this address's joins
            resp = self.http.post("/v1/join", json=self.sign("/v1/join", body))
            if resp.status_code != 429:
                break
            time.sleep(int(resp.headers["Retry-After"]))
        assert resp.status_code == 200, resp.text
        self.stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def sign(self, path: str, body: dict[str, Any], round: int = -1) -> dict[str, Any]:
        return self.key.sign_request(body, round, purpose=f"POST {path}")

    def heartbeat(self) -> httpx.Response:
        body = {"run_id": self.run_id, "peer_id": self.id}
        return self.http.post("/v1/heartbeat", json=self.sign("/v1/heartbeat", body))

    def _beat(self) -> None:
        while not self.stop.wait(0.5):
            for _ in range(20):  # a 429 from the burst test: try again shortly
                if self.stop.is_set() or self.heartbeat().status_code != 429:
                    break
                time.sleep(0.2)

    def put(self, data: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
        return self.http.put(f"/v1/blobs/{content_id(data)}", content=data, headers=headers)

    def signed(self, data: bytes) -> dict[str, str]:
        return upload_headers(self.key, self.run_id, content_id(data), len(data))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Peer]]:
    tmp: Path = tmp_path_factory.mktemp("dos")
    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    cluster = LocalCluster(spec, tmp)
    cluster.start_coordinator()
    peer = Peer(cluster)
    yield cluster, peer
    peer.stop.set()
    cluster.stop()


def payload(seed: int) -> bytes:
    return get_codec("fp32").encode(torch.full((NUMEL,), 1e-4 * (seed + 1)))


def unthrottled(send: Callable[[], httpx.Response], tries: int = 10) -> httpx.Response:
    """`send()` again while the rate limiter (not the handler) answers 429, waiting its
    Retry-After; at most `tries` sends."""
    for _ in range(tries):
        resp = send()
        if resp.status_code != 429 or "too many requests" not in resp.text:
            return resp
        time.sleep(int(resp.headers["Retry-After"]))
    return resp


def raw_request(cluster: LocalCluster, head: str, body: bytes = b"") -> socket.socket:
    """A socket that has sent `head` (request line and headers) and `body`, nothing more."""
    sock = socket.create_connection(("127.0.0.1", cluster.port), timeout=15)
    sock.sendall(head.encode() + b"\r\n" + body)
    return sock


def read_reply(sock: socket.socket) -> tuple[int, str]:
    """(status, whole reply) once the server answers or closes; every read has a timeout."""
    data = b""
    try:
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    finally:
        sock.close()
    text = data.decode("latin-1")
    return (int(text.split(" ", 2)[1]) if text.startswith("HTTP/") else 0), text


@network
def test_unsigned_and_stranger_uploads_store_nothing(world: tuple[LocalCluster, Peer]) -> None:
    _, peer = world
    data = payload(1)
    cid = content_id(data)
    resp = peer.put(data)
    assert resp.status_code == 401 and "unsigned" in resp.json()["error"], resp.text
    stranger = Identity.generate()  # signs correctly, but never joined
    resp = peer.put(data, upload_headers(stranger, peer.run_id, cid, len(data)))
    assert resp.status_code == 403 and "only members" in resp.json()["error"], resp.text
    other = payload(2)  # a member's signature for other bytes does not cover these
    resp = peer.put(data, {**peer.signed(other)})
    assert resp.status_code == 401 and "signature" in resp.json()["error"], resp.text
    assert peer.http.get(f"/v1/blobs/{cid}").status_code == 404
    headers = peer.signed(data)  # the member's own upload is taken, once
    assert peer.put(data, headers).status_code == 200
    assert peer.http.get(f"/v1/blobs/{cid}").content == data
    resp = peer.put(data, headers)
    assert resp.status_code == 401 and "replayed" in resp.json()["error"], resp.text


@network
def test_uploads_nobody_names_are_capped(world: tuple[LocalCluster, Peer]) -> None:
    """A member cannot fill the disk with blobs no submission names: max_pending_uploads
    (4), until a signed submission names one (accepted or refused)."""
    cluster, _ = world
    hoarder = Peer(cluster)
    try:
        blobs = [payload(10 + i) for i in range(5)]
        for data in blobs[:4]:
            assert hoarder.put(data, hoarder.signed(data)).status_code == 200
        resp = hoarder.put(blobs[4], hoarder.signed(blobs[4]))
        assert resp.status_code == 429 and "no submission names" in resp.text, resp.text
        assert resp.headers["Retry-After"] == "1"
        # any answer from the handler names blobs[0]; the rate limiter's 429 (the module's
        # other attacks share this address's bucket) means the handler never ran: again
        body = contribution(hoarder, content_id(blobs[0]), PAYLOAD)
        resp = unthrottled(
            lambda: hoarder.http.post(f"/v1/rounds/{body['round']}/contributions", json=body)
        )
        resp = unthrottled(lambda: hoarder.put(blobs[4], hoarder.signed(blobs[4])))
        assert resp.status_code == 200, resp.text
    finally:
        hoarder.stop.set()


@network
def test_wrong_size_refused_before_the_body(world: tuple[LocalCluster, Peer]) -> None:
    """A signed upload of a size the model does not imply is a 413 with no body sent."""
    cluster, peer = world
    size = 512 << 10  # under max_blob_bytes: the old code would wait for and store it
    cid = "ab" * 32
    signed = upload_headers(peer.key, peer.run_id, cid, size)
    head = f"PUT /v1/blobs/{cid} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in signed.items()
    )
    t0 = time.monotonic()
    status, reply = read_reply(raw_request(cluster, head))
    assert status == 413, reply
    assert f"{PAYLOAD} (contribution)" in reply
    assert time.monotonic() - t0 < 5  # answered at once, not after a body timeout


@network
def test_slow_senders_are_cut_off(world: tuple[LocalCluster, Peer]) -> None:
    cluster, peer = world
    body = b'{"run_id": "'  # 12 of 100 declared bytes, then silence
    head = "POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    t0 = time.monotonic()
    status, reply = read_reply(raw_request(cluster, head + "Content-Length: 100\r\n", body))
    assert status == 408 and "too slow" in reply, reply
    assert 1.5 < time.monotonic() - t0 < 8  # body_timeout_s = 2 (plus 100 B at 1 MiB/s)
    # a signed blob upload that stalls halfway: cut off, nothing stored, slot released
    data = payload(3)
    signed = peer.signed(data)
    head = (
        f"PUT /v1/blobs/{content_id(data)} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in signed.items())
    )
    status, reply = read_reply(raw_request(cluster, head, data[: len(data) // 2]))
    assert status == 408, reply
    assert peer.http.get(f"/v1/blobs/{content_id(data)}").status_code == 404
    assert peer.put(data, peer.signed(data)).status_code == 200


@network
def test_slow_headers_are_cut_off(world: tuple[LocalCluster, Peer]) -> None:
    """Slowloris: headers trickling in hold no connection past the deadline."""
    cluster, _ = world
    sock = socket.create_connection(("127.0.0.1", cluster.port), timeout=15)
    t0 = time.monotonic()
    sock.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never ends the headers
    for _ in range(3):  # a byte now and then does not keep it open
        time.sleep(0.5)
        try:
            sock.sendall(b"a")
        except OSError:
            break
    status, reply = read_reply(sock)
    assert status == 0 and reply == "", reply  # closed without an answer
    assert time.monotonic() - t0 < 8  # body_timeout_s = 2 also bounds the headers


@network
def test_joining_costs_the_minimum_stake(world: tuple[LocalCluster, Peer]) -> None:
    cluster, _ = world
    with pytest.raises(AssertionError, match="below this run's minimum stake"):
        Peer(cluster, stake=0.5)


@network
def test_a_burst_gets_429s_and_others_are_served(world: tuple[LocalCluster, Peer]) -> None:
    cluster, peer = world
    bursty = Peer(cluster)
    try:
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: bursty.heartbeat(), range(100)))
        limited = [r for r in codes if r.status_code == 429]
        assert len(limited) >= 50, [r.status_code for r in codes]
        assert all(r.status_code in (200, 429) for r in codes)
        assert int(limited[0].headers["Retry-After"]) >= 1
        assert peer.heartbeat().status_code == 200  # another peer is served meanwhile
        assert cluster.get("/v1/status")["run_id"]
        # a stranger replaying the bursty peer's id spends none of its budget for long
        forged = {"run_id": peer.run_id, "peer_id": bursty.id, "nonce": "x", "signature": "00"}
        assert peer.http.post("/v1/heartbeat", json=forged).status_code in (401, 422, 429)
    finally:
        bursty.stop.set()


@network
def test_fresh_keys_cannot_flood_joins(world: tuple[LocalCluster, Peer]) -> None:
    """Each join of a new key writes signed ledger entries: one address gets join_burst
    (20 in a row) and then 429s, while its other requests are still served."""
    cluster, peer = world
    keys = [Identity.generate() for _ in range(40)]
    for key in keys:  # each holds the stake it declares (deposits are not joins)
        cluster.fund(key.public_key, 1.0)
    before = len(cluster.get("/v1/ledger", start=0, limit=5000))

    def join(i: int) -> int:
        key = keys[i]
        body = {
            "run_id": peer.run_id,
            "peer_id": key.peer_id,
            "public_key": key.public_key,
            "name": "sybil",
            "step_time_s": 0.01,
            "stake": 1.0,
        }
        signed = key.sign_request(body, -1, purpose="POST /v1/join")
        return peer.http.post("/v1/join", json=signed).status_code

    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(join, range(40)))
    assert codes.count(429) >= 10 and set(codes) <= {200, 429}, codes
    assert peer.heartbeat().status_code == 200
    added = len(cluster.get("/v1/ledger", start=0, limit=5000)) - before
    assert added <= 2 * codes.count(200) + 10  # join + stake per admitted key (+ rounds)


def held_long_polls(cluster: LocalCluster) -> float:
    """The coordinator's own count of held long-polls, from /metrics."""
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "covey_long_polls_held":
            return family.samples[0].value
    raise AssertionError("/metrics has no covey_long_polls_held")


def wait_until(ok: Callable[[], bool], timeout_s: float, what: str) -> None:
    give_up = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < give_up, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


@network
def test_long_polls_are_bounded_by_who_signs_them(world: tuple[LocalCluster, Peer]) -> None:
    """A long-poll counts against a peer only when that peer signed it (covey.trust.polls);
    an unsigned one counts against its address, whatever `peer_id` it names. So polls
    naming a victim's id cannot take the victim's slots, and polls spread over made-up ids
    are still bounded (max_long_polls_per_peer = 1: an address holds 16)."""
    cluster, peer = world
    future = cluster.status()["committed_rounds"] + 1000  # never commits during the test
    path = f"/v1/rounds/{future}/certificate"

    def poll(peer_id: str, headers: dict[str, str] | None = None) -> httpx.Response:
        return peer.http.get(path, params={"wait": 3, "peer_id": peer_id}, headers=headers)

    def signed() -> dict[str, str]:
        return poll_headers(peer.key, peer.run_id, future)

    with ThreadPoolExecutor(20) as pool:
        squatters = [pool.submit(poll, peer.id) for _ in range(2)]  # the victim's id, unsigned
        wait_until(lambda: held_long_polls(cluster) >= 2, 5, "the squatters' polls held")
        mine = pool.submit(poll, peer.id, signed())
        wait_until(lambda: held_long_polls(cluster) >= 3, 5, "the victim's own poll held")
        t0 = time.monotonic()
        second = poll(peer.id, signed())  # the victim's cap (1) is its own to spend
        assert second.status_code == 429 and "peer:" in second.text, second.text
        forged = poll(peer.id, {**signed(), "X-Covey-Signature": "00" * 64})
        assert forged.status_code == 401 and "does not verify" in forged.text, forged.text
        spread = [pool.submit(poll, f"{i:032x}") for i in range(14)]  # 2 + 14 = the address's 16
        wait_until(lambda: held_long_polls(cluster) >= 17, 10, "16 unsigned polls held")
        one_more = poll("f" * 32)
        assert one_more.status_code == 429 and "address:" in one_more.text, one_more.text
        assert time.monotonic() - t0 < 8
        held = [*squatters, mine, *spread]
        assert {f.result().status_code for f in held} == {404}


class Redirector:
    """A blob 'server' that answers every request with a redirect to `target`."""

    def __init__(self, target: Callable[[str], str]) -> None:
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.hits += 1
                self.send_response(302)
                self.send_header("Location", target(self.path))
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_GET

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def contribution(peer: Peer, cid: str, size: int) -> dict[str, Any]:
    info = peer.http.get("/v1/round", params={"peer_id": peer.id}).json()
    body = {
        "run_id": peer.run_id,
        "round": info["round"],
        "attempt": info["attempt"],
        "peer_id": peer.id,
        "cid": cid,
        "start_hash": info["start_hash"] or "00" * 32,  # between rounds: refused, but signed
        "size": size,
        "tokens": 4 * 64 * 4,
        "inner_steps": 4,
    }
    return peer.key.sign_request(body, body["round"], purpose=_submit_purpose(body["round"]))


def _submit_purpose(round_: int) -> str:
    return f"POST /v1/rounds/{round_}/contributions"


@network
def test_blob_urls_are_not_ssrf(world: tuple[LocalCluster, Peer]) -> None:
    cluster, _ = world
    with pytest.raises(AssertionError, match="422"):  # file:// is not a blob URL
        Peer(cluster, accepts_connections=True, blob_url="file:///etc/passwd")
    elsewhere = Redirector(lambda path: "http://unused.invalid/")
    inside = Redirector(lambda path: f"{elsewhere.url}{path}")  # bounce to another server
    member = Peer(cluster, accepts_connections=True, blob_url=inside.url)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # a round this peer is a member of
            info = member.http.get("/v1/round", params={"peer_id": member.id}).json()
            if info["phase"] == "open" and info["member"] and (info["deadline_in_s"] or 0) > 1:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the redirecting peer never became a member of an open round")
        body = contribution(member, content_id(payload(4)), PAYLOAD)
        resp = member.http.post(f"/v1/rounds/{body['round']}/contributions", json=body)
        assert resp.status_code == 409 and "could not fetch" in resp.text, resp.text
        assert inside.hits >= 1 and elsewhere.hits == 0  # asked once, never followed
    finally:
        member.stop.set()
        inside.close()
        elsewhere.close()


class SlowBlobServer:
    """A peer's blob server that serves `data` only after `delay_s`: the coordinator's
    fetch of it keeps a submission in flight that long."""

    def __init__(self, data: bytes, delay_s: float) -> None:
        self.fetching = threading.Event()  # set when the coordinator's fetch has arrived
        fetching = self.fetching

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                fetching.set()
                time.sleep(delay_s)  # the server under test waits on this, not the test
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@network
def test_a_second_submission_in_flight_is_refused_and_changes_nothing(
    world: tuple[LocalCluster, Peer],
) -> None:
    """While a member's submission is in flight (the coordinator fetching its blob from
    the member's slow server), another signed submission of it to the same round is a 409
    at once, and leaves no trace: no ledger entry, no rejection; the first is accepted."""
    cluster, _ = world
    data = payload(40)
    server = SlowBlobServer(data, delay_s=1.0)
    member = Peer(cluster, accepts_connections=True, blob_url=server.url)
    try:
        deadline = time.monotonic() + 30
        while True:  # a round it is a member of, with time left for a 1 s fetch
            info = member.http.get("/v1/round", params={"peer_id": member.id}).json()
            if info["phase"] == "open" and info["member"] and (info["deadline_in_s"] or 0) > 1.6:
                break
            assert time.monotonic() < deadline, "never a member of an open round"
            time.sleep(0.02)
        before = len(cluster.get("/v1/ledger", start=0, limit=5000))
        first_body = contribution(member, content_id(data), PAYLOAD)
        path = f"/v1/rounds/{first_body['round']}/contributions"
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(member.http.post, path, json=first_body)
            # the first is in flight once the coordinator is fetching its blob
            assert server.fetching.wait(10), "the coordinator never fetched the blob"
            t0 = time.monotonic()
            second = member.http.post(path, json=contribution(member, content_id(data), PAYLOAD))
            assert second.status_code == 409 and "already submitting" in second.text, second.text
            assert time.monotonic() - t0 < 0.9  # refused at once, not after the fetch
            assert first.result().status_code == 200, first.result().text
        added = cluster.get("/v1/ledger", start=before, limit=5000)
        rejected = [e for e in added if e["type"] == "contribution rejected"]
        assert not [e for e in rejected if e["payload"]["peer_id"] == member.id], rejected
    finally:
        member.stop.set()
        server.close()


@network
@pytest.mark.long  # a no-show's rounds run out their deadline: seconds of waiting
def test_no_shows_sit_out_rounds(world: tuple[LocalCluster, Peer]) -> None:
    cluster, _ = world
    idle = Peer(cluster)  # joins, heartbeats, never submits
    try:
        member_of: set[tuple[int, int]] = set()  # round attempts it was made a member of
        deadline = time.monotonic() + 30
        while True:  # two rounds of 2 s it lets pass, each closed at its deadline
            info = idle.http.get("/v1/round", params={"peer_id": idle.id}).json()
            if info["phase"] == "open" and info["member"]:
                member_of.add((info["round"], info["attempt"]))
            elif len(member_of) >= 2:
                break
            assert time.monotonic() < deadline, f"a member of only {member_of} in 30 s"
            time.sleep(0.05)
        watch_until = time.monotonic() + 5  # more than two rounds' deadlines
        while time.monotonic() < watch_until:
            info = idle.http.get("/v1/round", params={"peer_id": idle.id}).json()
            assert not info["member"], f"a no-show was made a member again: {info}"
            time.sleep(0.1)
        assert idle.heartbeat().status_code == 200  # still live: excluded, not dead
        # on the ledger, replayed by `covey ledger verify`: the repeated one costs reputation
        entries = cluster.get("/v1/ledger", start=0, limit=5000)
        mine = [e["payload"] for e in entries if e["type"] == "no show"]
        mine = [p for p in mine if p["peer_id"] == idle.id]
        assert [p["consecutive"] for p in mine][:2] == [1, 2], mine
        assert mine[0]["sits_out_s"] == 0 and mine[1]["sits_out_s"] == 60, mine
        account = cluster.get("/v1/ledger/balances")["accounts"][idle.id]
        assert account["counts"]["no_shows"] >= 1 and account["reputation"] < 0.5, account
        report = audit.verify(cluster.url)
        assert report.summary["accounts"][idle.id]["counts"]["no_shows"] >= 1
    finally:
        idle.stop.set()


# ---- the arithmetic, without processes ----------------------------------------------


def test_token_buckets() -> None:
    buckets = TokenBuckets(rate=2.0, burst=3)
    assert [buckets.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a", 0.0) == pytest.approx(0.5)  # empty: one token in 0.5 s
    assert buckets.take("b", 0.0) == 0.0  # another key has its own bucket
    assert buckets.take("a", 0.5) == 0.0  # refilled
    buckets.give_back("a")  # a request that was not a's: its token comes back
    assert buckets.take("a", 0.5) == 0.0
    assert buckets.take("a", 0.5) > 0
    with pytest.raises(ValueError, match="rate"):
        TokenBuckets(rate=0, burst=1)


def test_long_polls_are_counted_per_key_and_in_total() -> None:
    polls = LongPolls(total=3, per_key=2)
    with polls.hold("a") as a1, polls.hold("a") as a2, polls.hold("a") as a3:
        assert (a1, a2, a3) == (True, True, False)
        with polls.hold("b") as b1, polls.hold("c") as c1:
            assert (b1, c1) == (True, False)  # the total is taken
            assert polls.held() == 3  # refusals hold nothing
    assert polls.held() == 0
    with polls.hold("a") as again:
        assert again  # released when the blocks ended


def test_no_show_backoff_and_planning() -> None:
    assert [no_show_backoff(n, 30, 100) for n in range(6)] == [0, 0, 30, 60, 100, 100]
    cfg = RoundsConfig()
    peers = [
        PeerView("a", 0.1, None, 100.0, "live"),
        PeerView("b", 0.1, None, 100.0, "live", excluded_until=160.0),
    ]
    members, _ = plan_round(
        100.0, "run", 0, peers, steps_per_round=4, flexible=True, payload_bytes=10, cfg=cfg
    )
    assert [m.peer_id for m in members] == ["a"]  # b sits out until 160
    later = [PeerView(p.peer_id, 0.1, None, 160.0, "live", p.excluded_until) for p in peers]
    members, _ = plan_round(
        160.0, "run", 1, later, steps_per_round=4, flexible=True, payload_bytes=10, cfg=cfg
    )
    assert [m.peer_id for m in members] == ["a", "b"]
