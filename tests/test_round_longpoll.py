"""The round long-poll: `GET /v1/round?after=TAG&wait=S` is held until the
round view's tag changes and answered at once when it does, so waiting peers do not poll.
Against a real coordinator process over 127.0.0.1; the test joins peers itself (signing
with their own keys), so it decides when a round can open (min_peers = 2)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.local.cluster import LocalCluster
from covey.trust.identity import Identity, request_purpose
from covey.trust.polls import ROUND_POLL, poll_headers

pytestmark = pytest.mark.network

SPEC = """
name = "round-long-poll"
[model]
size = "nano"
[data]
batch_size = 2
seq_len = 32
[algorithm]
method = "diloco"
inner_steps = 2
[rounds]
min_peers = 2
dead_after_s = 60
deadline_min_s = 600
deadline_max_s = 600
[trust]
min_stake = 0.0  # the pollers join unfunded
"""


class Peer:
    def __init__(self, cluster: LocalCluster, name: str) -> None:
        self.http = httpx.Client(base_url=cluster.url, timeout=40, trust_env=False)
        self.run_id = cluster.get("/v1/run")["run_id"]
        self.key = Identity.generate()
        self.id = self.key.peer_id
        join = {
            "run_id": self.run_id,
            "peer_id": self.id,
            "public_key": self.key.public_key,
            "name": name,
            "step_time_s": 0.01,
        }
        body = self.key.sign_request(join, -1, purpose=request_purpose("/v1/join"))
        assert self.http.post("/v1/join", json=body).status_code == 200

    def poll(self, after: str, wait: float, signed: bool = True, **headers: str) -> httpx.Response:
        params: dict[str, Any] = {"peer_id": self.id, "after": after, "wait": wait}
        sign = poll_headers(self.key, self.run_id, path=ROUND_POLL) if signed else {}
        return self.http.get("/v1/round", params=params, headers={**sign, **headers})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp: Path = tmp_path_factory.mktemp("long-poll")
    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    cluster = LocalCluster(spec, tmp)
    cluster.start_coordinator()
    yield cluster
    cluster.stop()


def held(cluster: LocalCluster) -> float:
    """covey_long_polls_held from the coordinator's /metrics."""
    text = httpx.get(f"{cluster.url}/metrics", trust_env=False).text
    line = next(x for x in text.splitlines() if x.startswith("covey_long_polls_held "))
    return float(line.split()[1])


def test_a_waiting_peer_is_woken_when_the_round_opens(cluster: LocalCluster) -> None:
    first = Peer(cluster, "first")
    view = first.http.get("/v1/round", params={"peer_id": first.id}).json()
    assert (view["phase"], view["tag"]) == ("waiting", "waiting:0")  # one peer of two
    # no news past `wait` (another tag, but still no round): the view, after about `wait`
    for after in ("waiting:0", "open:99:0"):
        t0 = time.monotonic()
        same = first.poll(after, 0.5)
        assert same.status_code == 200 and same.json()["tag"] == "waiting:0"
        assert time.monotonic() - t0 >= 0.35  # held 0.75-1x `wait`

    got: dict[str, Any] = {}

    def long_poll() -> None:
        t = time.monotonic()
        got["reply"] = first.poll("waiting:0", 30)
        got["at"] = time.monotonic() - t

    waiter = threading.Thread(target=long_poll)
    waiter.start()
    deadline = time.monotonic() + 20
    while held(cluster) < 1:  # the coordinator holds it (no thread, no answer yet)
        assert time.monotonic() < deadline, "the long-poll was never held"
        time.sleep(0.05)
    assert "reply" not in got
    opened = time.monotonic()
    Peer(cluster, "second")  # the second peer: the round opens, the poll is answered
    waiter.join(35)
    reply = got["reply"].json()
    assert reply["phase"] == "open" and reply["tag"] == "open:0:0" and reply["member"]
    assert reply["assignment"] is not None
    assert got["at"] < 25, f"answered by its timeout ({got['at']:.1f} s), not the change"
    assert time.monotonic() - opened < 20
    assert held(cluster) == 0
    # news already there (its round is open): answered at once
    t0 = time.monotonic()
    assert first.poll("waiting:0", 30).json()["tag"] == "open:0:0"
    assert time.monotonic() - t0 < 10
    # a peer that is not in the open round has no news in it: held for its `wait`
    late = Peer(cluster, "late")
    t0 = time.monotonic()
    reply = late.poll("waiting:0", 1.0).json()
    assert reply["tag"] == "open:0:0" and not reply["member"]
    assert time.monotonic() - t0 >= 0.7


def test_long_polls_are_bounded_per_signer_and_forgeries_refused(cluster: LocalCluster) -> None:
    peer = Peer(cluster, "bounded")
    tag = peer.http.get("/v1/round").json()["tag"]
    replies: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: replies.append(peer.poll(tag, 3))) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while held(cluster) < 2:
        assert time.monotonic() < deadline, "the two long-polls were never held"
        time.sleep(0.05)
    third = peer.poll(tag, 3)  # the peer's share (max_long_polls_per_peer = 2) is taken
    assert third.status_code == 429 and "too many long-polls" in third.json()["error"]
    for t in threads:
        t.join(10)
    assert [r.status_code for r in replies] == [200, 200]
    # a signature by another key, or for the certificate's purpose, is refused
    mallory = Identity.generate()
    forged = poll_headers(mallory, peer.run_id, path=ROUND_POLL)
    forged["X-Covey-Peer"] = peer.id
    refused = peer.poll(tag, 1, signed=False, **forged)
    assert refused.status_code == 401 and "does not verify" in refused.json()["error"]
    other_purpose = poll_headers(peer.key, peer.run_id, 0)  # the certificate of round 0
    assert peer.poll(tag, 1, signed=False, **other_purpose).status_code == 401
    assert cluster.status()["phase"] in ("open", "waiting")  # still serving


@pytest.mark.parametrize(
    "params, words",
    [
        ({"after": "waiting:0", "wait": 31}, "query.wait"),
        ({"after": "waiting:0", "wait": -1}, "query.wait"),
        ({"after": "waiting:0", "wait": "soon"}, "query.wait"),
        ({"after": "x" * 65, "wait": 1}, "query.after"),
    ],
)
def test_bad_long_poll_parameters_are_422(
    cluster: LocalCluster, params: dict[str, Any], words: str
) -> None:
    resp = httpx.get(f"{cluster.url}/v1/round", params=params, trust_env=False)
    assert resp.status_code == 422, resp.text
    assert words in " ".join(resp.json()["problems"])
