"""What the RL process tests share: a `covey rl trainer` process on 127.0.0.1, in-process
validators and workers that talk to it, and readers of its public views."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from covey.io.deposit import deposit
from covey.rl.cheater import rollout_validator, rollout_worker
from covey.rl.trainer import KEY_FILE
from covey.rl.validator import RolloutValidator
from covey.rl.worker import RolloutWorker
from covey.trust.identity import Identity

ROOT = Path(__file__).resolve().parents[1]
# a run small enough for a CPU: one accepted batch (2 prompts x G=4) makes a trainer step
SPEC = """
group_size = 4
samples_per_step = 8
audit_rate = 1.0
verify_timeout_s = 5
eval_prompts = 4
eval_every = 1000
heartbeat_s = 1
dead_after_s = 3
max_batch_bytes = 200000
canary_rate = 0.0
"""


# trainer URL -> its data directory: the run's owner is the trainer's key (trainer.key),
# which funds the keys the tests stake (a key bonds only credits it holds)
OWNERS: dict[str, Path] = {}


def fund(url: str, public_key: str, amount: float) -> None:
    """Deposit `amount` credits to `public_key` in the run at `url` as its owner (the
    trainer's key), through POST /v1/ledger/deposit (covey.io.deposit)."""
    if amount <= 0:
        return
    owner = Identity.load_or_create(OWNERS[url] / KEY_FILE)
    run_id = httpx.get(f"{url}/v1/run", timeout=10).json()["run_id"]
    deposit(url, owner, public_key, float(amount), run_id)


def join_funded(url: str, peer: Any, role: str) -> Any:
    """Fund what an in-process peer stakes, then join it as `role`; the peer."""
    fund(url, peer.identity.public_key, peer.stake)
    peer.membership.join(role, peer.name, peer.stake)
    return peer


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_trainer(
    data_dir: Path,
    port: int,
    spec: str = SPEC,
    policy: str = "covey:nano",
    serve_timeout_s: float = 120,
) -> subprocess.Popen:
    """`covey rl trainer` on PORT with DATA_DIR, its spec and log beside DATA_DIR; returns
    once it serves its policy (the deadline is generous: torch imports are slow on a
    loaded 2-core machine). Fails with the log's path if the process exits first."""
    spec_path = data_dir.parent / f"{data_dir.name}.toml"
    spec_path.write_text(spec)
    log_path = data_dir.parent / f"{data_dir.name}.log"
    cmd = [sys.executable, "-m", "covey", "rl", "trainer", "--data-dir", str(data_dir)]
    cmd += ["--policy", policy, "--spec", str(spec_path), "--port", str(port)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    OWNERS[url] = data_dir

    def up() -> bool:
        assert proc.poll() is None, f"trainer exited {proc.returncode}: see {log_path}"
        try:
            return httpx.get(f"{url}/v1/rl/policy", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, serve_timeout_s, "the trainer to serve")
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM, then SIGKILL after GRACE_S."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def trainer_process(data_dir: Path, spec: str = SPEC, **kwargs: Any) -> Iterator[str]:
    """A trainer process on a free port for the block; yields its URL."""
    port = free_port()
    proc = start_trainer(data_dir, port, spec, **kwargs)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@contextlib.contextmanager
def validator(url: str, behavior: str = "honest") -> Iterator[RolloutValidator]:
    """An in-process validator polling URL for the block."""
    v = rollout_validator(url, Identity.generate(), name=f"v-{behavior}", behavior=behavior)
    fund(url, v.identity.public_key, v.stake)  # it joins in run_loop
    thread = threading.Thread(target=v.run_loop, kwargs={"poll_s": 0.1}, daemon=True)
    thread.start()
    try:
        yield v
    finally:
        v.stop.set()
        thread.join(10)


def joined_worker(url: str, behavior: str = "honest") -> RolloutWorker:
    w = rollout_worker(url, Identity.generate(), name=f"w-{behavior}", behavior=behavior)
    return join_funded(url, w, "worker")


def batch_status(url: str, worker_id: str) -> list[dict[str, Any]]:
    return [b for b in httpx.get(f"{url}/v1/rl/batches").json() if b["worker_id"] == worker_id]


def decided(url: str, worker_id: str) -> dict[str, Any] | None:
    rows = [b for b in batch_status(url, worker_id) if b["status"] not in ("pending", "claimed")]
    return rows[-1] if rows else None


def ledger(url: str, type_: str, peer_id: str) -> list[dict[str, Any]]:
    entries = httpx.get(f"{url}/v1/ledger", params={"limit": 5000}).json()
    return [e for e in entries if e["type"] == type_ and e["payload"].get("peer_id") == peer_id]


def policy(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/rl/policy").json()
