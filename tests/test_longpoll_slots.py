"""Long-poll slots (the round long-poll as an attacker sees it),
in-process ASGI calls on one event loop against a coordinator with max_long_polls = 2.

1. Round long-polls have a pool of their own: waiting peers that fill it never leave a
   member's certificate long-poll refused (429, which a worker retries until it gives up
   and exits with status 1). They shared one pool before.
2. A held long-poll gives its slot back when its client disconnects, not when its `wait`
   runs out: slots cannot be held without holding connections.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from covey.bench.coordinator import SPEC
from covey.config import load_run_config
from covey.coordinator.app import create_app
from covey.coordinator.service import Coordinator
from covey.trust.identity import Identity
from covey.trust.polls import poll_headers
from tests.asgi import acall


async def held(app: Any) -> float:
    _, text = await acall(app, "GET", "/metrics")
    line = next(x for x in text.splitlines() if x.startswith("covey_long_polls_held "))
    return float(line.split()[1])


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Coordinator]]:
    tmp: Path = tmp_path_factory.mktemp("review-longpoll")
    spec = tmp / "run.toml"
    text = SPEC.format(heartbeat_s=2.0, dead_after_s=10.0, lease_s=20.0, min_peers=99)
    spec.write_text(text.replace("max_long_polls = 4096", "max_long_polls = 2"))
    coord = Coordinator(load_run_config(spec), tmp / "data")
    assert coord.cfg.limits.max_long_polls == 2
    yield create_app(coord), coord
    coord.stop()


def _join(app: Any, coord: Coordinator, key: Identity) -> None:
    join = {
        "run_id": coord.run_id,
        "peer_id": key.peer_id,
        "public_key": key.public_key,
        "name": "p",
        "step_time_s": 0.1,
    }
    body = json.dumps(key.sign_request(join, purpose="POST /v1/join")).encode()
    status, reply = asyncio.run(acall(app, "POST", "/v1/join", body=body))
    assert status == 200, reply


def test_certificate_long_poll_not_refused_when_round_polls_fill_the_pool(
    setup: tuple[Any, Coordinator],
) -> None:
    """Two waiting peers hold the two slots with round long-polls (honest load: a run with
    more waiting peers than max_long_polls). A third peer, holding nothing, long-polls
    its certificate: it should be held or answered (404: no certificate yet), as a round
    poll would be answered as a plain poll; it is refused 429 'too many long-polls held
    for peer:<it>' instead, and the worker's client retries 429s until it gives up."""
    app, coord = setup
    waiters = [Identity.generate() for _ in range(2)]
    member = Identity.generate()
    for k in (*waiters, member):
        _join(app, coord, k)

    async def go() -> tuple[int, Any]:
        polls = [
            asyncio.create_task(
                acall(
                    app,
                    "GET",
                    "/v1/round",
                    query=f"peer_id={k.peer_id}&after=waiting:0&wait=2".encode(),
                    headers=poll_headers(k, coord.run_id, path="/v1/round"),
                )
            )
            for k in waiters
        ]
        t0 = time.monotonic()
        while await held(app) < 2:
            assert time.monotonic() - t0 < 5, "round polls never held"
            await asyncio.sleep(0.02)
        got = await acall(
            app,
            "GET",
            "/v1/rounds/0/certificate",
            query=f"wait=0.2&peer_id={member.peer_id}".encode(),
            headers=poll_headers(member, coord.run_id, 0),
        )
        await asyncio.gather(*polls)
        return got

    status, reply = asyncio.run(go())
    assert status != 429, f"certificate long-poll refused: {reply}"


def test_round_long_poll_slot_released_when_client_disconnects(
    setup: tuple[Any, Coordinator],
) -> None:
    """A client sends a round long-poll (wait=3) and disconnects at once: it is over at
    the disconnect, its slot free, long before its wait."""
    app, _ = setup

    async def go() -> tuple[float, float]:
        t0 = time.monotonic()
        poll = acall(
            app, "GET", "/v1/round", query=b"after=waiting:0&wait=3",
            client="10.9.9.9", disconnect_at_once=True,
        )  # fmt: skip
        await asyncio.wait_for(poll, 2.0)  # TimeoutError: held on for its wait
        return await held(app), time.monotonic() - t0

    now_held, took = asyncio.run(go())
    assert now_held == 0 and took < 2.0, (now_held, took)
