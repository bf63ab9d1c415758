"""Heartbeats and round polls answered by covey.coordinator.fastpaths give the answers the
FastAPI routes give: the same app over one coordinator, with and without the fast paths,
asked the same requests (good, forged, malformed) through its ASGI interface in-process.
Over HTTP they are exercised by every network test (test_dos: bursts, forgeries,
schemathesis in test_openapi)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from covey.bench.coordinator import SPEC
from covey.config import load_run_config
from covey.coordinator.app import create_app
from covey.coordinator.fastpaths import FastPaths
from covey.coordinator.limits import LongPolls
from covey.coordinator.service import Coordinator
from covey.trust.identity import Identity
from tests.asgi import call


@pytest.fixture(scope="module")
def apps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Coordinator]]:
    tmp: Path = tmp_path_factory.mktemp("fastpaths")
    spec = tmp / "run.toml"
    spec.write_text(SPEC.format(heartbeat_s=2.0, dead_after_s=10.0, lease_s=20.0, min_peers=99))
    coord = Coordinator(load_run_config(spec), tmp / "data")
    yield create_app(coord), create_app(coord, fast_paths=False), coord
    coord.stop()


def test_fast_paths_answer_as_the_routes_do(apps: tuple[Any, Any, Coordinator]) -> None:
    fast, slow, coord = apps
    key, stranger = Identity.generate(), Identity.generate()
    join = {
        "run_id": coord.run_id,
        "peer_id": key.peer_id,
        "public_key": key.public_key,
        "name": "p",
        "step_time_s": 0.1,
    }
    signed_join = key.sign_request(join, purpose="POST /v1/join")
    assert call(slow, "POST", "/v1/join", json.dumps(signed_join).encode())[0] == 200

    def beat(who: Identity, **extra: Any) -> bytes:
        body = {"run_id": coord.run_id, "peer_id": key.peer_id, **extra}
        return json.dumps(who.sign_request(body, purpose="POST /v1/heartbeat")).encode()

    heartbeats = {
        "good": beat(key),
        "good with a step time": beat(key, step_time_s=0.5),
        "forged": beat(stranger),
        "another run": json.dumps(
            key.sign_request(
                {"run_id": "cd" * 8, "peer_id": key.peer_id}, purpose="POST /v1/heartbeat"
            )
        ).encode(),
        "unknown field": beat(key, bonus=1),
        "wrong type": beat(key, step_time_s="fast"),
        "not json": b"\xff\x00{",
        "not an object": b"[1, 2]",
        "empty": b"",
    }
    for what, body in heartbeats.items():
        a, b = call(fast, "POST", "/v1/heartbeat", body), call(slow, "POST", "/v1/heartbeat", body)
        if what.startswith("good"):  # a nonce is spent once: the second answer is a replay
            assert a[0] == 200 and a[1]["ok"] and b[0] == 401, (what, a, b)
            continue
        assert a[0] == b[0] and a[0] >= 400, (what, a, b)
        assert ("problems" in a[1]) == ("problems" in b[1]), (what, a, b)
    long_polls = (  # the round long-poll's parameters (tag "waiting:0": min_peers = 99)
        b"after=waiting:0&wait=0.05",  # held 50 ms, then the unchanged view
        b"after=open:9:9&wait=0.05",  # another tag, but no news (no round): held too
        b"after=waiting:0&wait=31",
        b"after=waiting:0&wait=-1",
        b"after=waiting:0&wait=soon",
        b"after=" + b"x" * 65 + b"&wait=1",
        b"wait=5",  # no tag to wait past: answered at once
    )
    for query in (b"", b"peer_id=" + key.peer_id.encode(), b"peer_id=", b"peer_id=XYZ",
                  *long_polls):  # fmt: skip
        a, b = (
            call(fast, "GET", "/v1/round", query=query),
            call(slow, "GET", "/v1/round", query=query),
        )
        assert a == b, (query, a, b)


def test_a_round_long_poll_past_every_slot_is_a_plain_poll(
    apps: tuple[Any, Any, Coordinator],
) -> None:
    """More peers than limits.max_long_polls: a long-poll that finds every slot taken is
    answered at once with the view (the peer polls), not refused, not held."""
    _, _, coord = apps
    slots = LongPolls(total=1, per_key=2)
    fast = FastPaths(None, coord, slots)  # type: ignore[arg-type]  # never passes on
    query = b"after=waiting:0&wait=5"
    with slots.hold("someone else"):
        t0 = time.monotonic()
        status, view = call(fast, "GET", "/v1/round", query=query)
        assert status == 200 and view["tag"] == "waiting:0"
        assert time.monotonic() - t0 < 2.5  # not held for its 5 s (0.75-1x)
    t0 = time.monotonic()
    assert call(fast, "GET", "/v1/round", query=b"after=waiting:0&wait=0.3")[0] == 200
    assert time.monotonic() - t0 >= 0.2  # a free slot: held again
