"""`--replica` on the RL trainer and the SWARM coordinator (covey.coordinator.replica):
two real processes on one PostgreSQL database and one S3 bucket. The first holds the
run's lease and serves; the second serves too, relaying every request to the leader (a
signed write reaches the leader's checks through it); the leader SIGKILLed, the second
takes the lease over, builds the run from the database and answers for the same run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.coordinator.db import Database
from covey.coordinator.lease import leader
from tests.rl_helpers import ROOT, SPEC
from tests.services import Postgres, S3Server, free_port, stop_all

TINY = {"n_layer": 2, "n_embd": 16, "n_head": 2, "seq_len": 8}


def _wait(what: str, timeout_s: float, check: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _run_of(url: str) -> dict[str, Any] | None:
    try:
        reply = httpx.get(f"{url}/v1/run", timeout=5, trust_env=False)
    except httpx.HTTPError:
        return None
    return reply.json() if reply.status_code == 200 else None


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.long  # ~30 s each; tests/test_replicas.py runs a follower and a leader by default
@pytest.mark.parametrize("mode", ["rl", "swarm"])
def test_a_mode_replica_relays_to_the_leader_and_takes_over(
    mode: str, postgres: Postgres, s3: S3Server, tmp_path: Path
) -> None:
    url, blobs, key = postgres.database(), f"s3://{s3.bucket()}/run", tmp_path / "c.key"
    (tmp_path / "rl.toml").write_text(SPEC)
    env = {**os.environ, **s3.env}
    procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(port: int) -> None:
        shared = ["--data-dir", str(tmp_path / f"cache-{port}"), "--port", str(port),
                  "--db", url, "--blobs", blobs, "--key", str(key), "--replica"]  # fmt: skip
        if mode == "rl":
            args = ["rl", "trainer", "--policy", "covey:nano", "--spec",
                    str(tmp_path / "rl.toml"), *shared]  # fmt: skip
        else:
            args = ["swarm", "coordinator", *shared,
                    *[f"--set={k}={json.dumps(v)}" for k, v in TINY.items()]]  # fmt: skip
        with open(tmp_path / f"replica-{port}.log", "ab") as out:
            procs[port] = subprocess.Popen(
                [sys.executable, "-m", "covey", *args], cwd=ROOT, env=env, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    first, second = free_port(), free_port()
    lease_db = Database(url)
    try:
        start(first)
        _wait("the first replica to lead", 120, lambda: leader(lease_db))
        start(second)
        run = _wait("the leader to serve", 120, lambda: _run_of(f"http://127.0.0.1:{first}"))
        relayed = _wait("the follower to relay", 120,
                        lambda: _run_of(f"http://127.0.0.1:{second}"))  # fmt: skip
        assert relayed["run_id"] == run["run_id"]
        held = leader(lease_db)
        assert held is not None and f":{first}:" in held[0]
        assert httpx.get(f"http://127.0.0.1:{second}/healthz").json() == {"ok": True}
        # a write through the follower meets the leader's checks: an unsigned join is refused
        join = "/v1/join" if mode == "rl" else "/v1/swarm/join"
        refused = httpx.post(f"http://127.0.0.1:{second}{join}", json={"run_id": "x"}, timeout=30)
        assert refused.status_code in (400, 401, 422), refused.text

        procs[first].send_signal(signal.SIGKILL)
        procs[first].wait(10)
        _wait("the second replica to take the lease", 60,
              lambda: (h := leader(lease_db)) is not None and f":{second}:" in h[0])  # fmt: skip
        after = _wait("the new leader to serve the run", 120,
                      lambda: _run_of(f"http://127.0.0.1:{second}"))  # fmt: skip
        assert after["run_id"] == run["run_id"]
        assert procs[second].poll() is None
    finally:
        stop_all(procs)
        lease_db.close()
