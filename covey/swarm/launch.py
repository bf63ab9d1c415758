"""Start a swarm coordinator and stage servers as processes on 127.0.0.1 (demo, bench,
tests). Every wait has a deadline; processes are ended by their own handle."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `cond` until it returns something truthy; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def status(url: str) -> dict[str, Any] | None:
    try:
        r = httpx.get(f"{url}/v1/swarm/status", timeout=5.0, trust_env=False)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


class Swarm:
    """A coordinator process and its server processes, logs under `workdir`."""

    def __init__(self, workdir: Path, settings: dict[str, Any], port: int | None = None) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = settings
        self.coordinator: subprocess.Popen | None = None
        self.servers: dict[str, subprocess.Popen] = {}

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.workdir / f"{log_name}.log", "ab")  # noqa: SIM115 -- the child's
        return subprocess.Popen(
            [sys.executable, "-m", "covey", "swarm", *args], stdout=log, stderr=log
        )

    def start_coordinator(self, timeout: float = 300.0, wait: bool = True) -> None:
        """Spawn the coordinator; wait until it answers unless `wait` is False (servers
        started meanwhile wait for it themselves; `ready` waits for both)."""
        sets = [f"--set={k}={json.dumps(v)}" for k, v in self.settings.items()]
        self.coordinator = self._spawn(
            ["coordinator", "--data-dir", str(self.workdir / "run"), "--port", str(self.port),
             *sets],
            "coordinator",
        )  # fmt: skip
        if wait:
            wait_for(lambda: status(self.url), timeout, f"the swarm coordinator at {self.url}")

    def start_server(self, name: str, *extra: str) -> subprocess.Popen:
        """`covey swarm server` called `name`. One that stakes (`--stake` above 0) gets its
        own key file, which the run's owner (the coordinator's key) funds with what it
        stakes first: a server bonds only credits it holds (covey.trust.treasury)."""
        stake = float(extra[extra.index("--stake") + 1]) if "--stake" in extra else 0.0
        if stake > 0 and "--identity" not in extra:
            from covey.io.deposit import fund_key

            key = self.workdir / "keys" / f"{name}.key"
            wait_for(lambda: status(self.url), 300, f"the swarm coordinator at {self.url}")
            fund_key(self.url, self.workdir / "run" / "coordinator.key", key, stake)
            extra = (*extra, "--identity", str(key))
        p = self._spawn(["server", "--coordinator", self.url, "--name", name, *extra], name)
        self.servers[name] = p
        return p

    def ready(self, names: list[str], timeout: float = 300.0) -> dict[str, Any]:
        """Wait until every named server is live with a state; the status."""

        def check() -> dict[str, Any] | None:
            s = status(self.url)
            if s is None:
                return None
            up = {x["name"] for x in s["servers"] if x["state"] and not x["moving"]}
            return s if set(names) <= up else None

        return wait_for(check, timeout, f"servers {names} to be live")

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (no goodbye, no flush): `start_coordinator` restarts it
        on the same directory and port."""
        assert self.coordinator is not None
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait(timeout=10)
        self.coordinator = None

    def start_trainer(self, name: str, *extra: str) -> subprocess.Popen:
        """A `covey swarm trainer` process (log: `<name>.log`), ended by its handle."""
        return self._spawn(["trainer", "--coordinator", self.url, "--name", name, *extra], name)

    def kill(self, name: str) -> None:
        """SIGKILL a server (no goodbye)."""
        p = self.servers.pop(name)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)

    def close(self) -> None:
        # servers first: they stop heartbeating to a coordinator that is still there
        for group in (list(self.servers.values()), [self.coordinator] if self.coordinator else []):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
        self.servers.clear()
