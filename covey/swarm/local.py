"""A swarm in one process on 127.0.0.1: the coordinator's app under uvicorn on a thread and
stage servers on threads, every request over real sockets (the same HTTP as separate
processes; only the process boundary is missing). For tests and measurements that must
not pay a process start per peer (transformers alone takes 15-90 s to import at load).
Every wait has a deadline; `close` stops everything it started.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from covey.swarm.config import SwarmConfig
from covey.swarm.launch import free_port, status, wait_for


class LocalSwarm:
    """`cfg`'s coordinator in `workdir`, plus servers added with `add_server`."""

    def __init__(self, cfg: SwarmConfig, workdir: Path) -> None:
        import uvicorn

        from covey.swarm.app import create_app
        from covey.swarm.service import SwarmCoordinator

        self.cfg = cfg
        self.coord = SwarmCoordinator(cfg, workdir / "run")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = uvicorn.Server(
            uvicorn.Config(
                create_app(self.coord),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                access_log=False,
            )
        )
        self.http.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.coord.start()
        threading.Thread(target=self.http.run, daemon=True, name="swarm-coordinator").start()
        wait_for(lambda: status(self.url), 60, f"the in-process coordinator at {self.url}")
        self.servers: list[Any] = []

    def add_server(self, name: str, stage: int, **kw: Any) -> Any:
        """Start a StageServer for `stage` on a thread; returns it once it serves."""
        from covey.swarm.server import StageServer

        s = StageServer(self.url, name=name, stage=stage, **kw)
        s.start()
        threading.Thread(target=s.run, daemon=True, name=f"swarm-{name}").start()
        self.servers.append(s)
        return s

    def ready(self, names: list[str], timeout: float = 120.0) -> dict[str, Any]:
        """Wait until every named server is live with a state; the status."""

        def check() -> dict[str, Any] | None:
            s = status(self.url)
            if s is None:
                return None
            up = {x["name"] for x in s["servers"] if x["state"] and not x["moving"]}
            return s if set(names) <= up else None

        return wait_for(check, timeout, f"servers {names} to be live")  # type: ignore[no-any-return]

    def close(self) -> None:
        for s in self.servers:
            s.close()
        self.http.should_exit = True
        self.coord.stop()
