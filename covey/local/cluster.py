"""A coordinator and workers as real processes on 127.0.0.1: for `covey demo` and the
multi-process tests. Every process is started with `python -m covey`, logs to its own
file, and is stopped with real signals; every wait here has a deadline.

The coordinator's key is made here before the coordinator starts, and the run's data is
tokenized here as the coordinator will, so the run id (which covers both: see
covey.config.run_id_of) is known without asking the coordinator, and every peer is started
with `--run-id`: as an operator would hand it out, with no trust on first use.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx

from covey.config import RunConfig, load_run_config, run_id_of
from covey.io.deposit import deposit, top_up
from covey.trust.house import house_identity
from covey.trust.identity import Identity

# (data config, files' sizes and mtimes) -> fingerprint: the stdlib corpus takes seconds to
# tokenize, and a test module may start several clusters on it
_FINGERPRINTS: dict[str, str] = {}


def data_fingerprint(cfg: RunConfig, cwd: Path) -> str:
    """The fingerprint of the corpus `cfg` names, as a process started in `cwd` (where the
    cluster starts its coordinator) loads it: relative data and tokenizer paths are taken
    from `cwd` (documents are named by file name, so resolving keeps the fingerprint).
    Raises what covey.data.corpus.load_corpus raises for missing or bad data."""
    from covey.data.corpus import load_corpus  # torch: only when a run id is needed

    d = cfg.data
    paths = [str(cwd / p) for p in d.paths]  # an absolute p stays itself
    tokenizer = d.tokenizer
    if tokenizer.startswith("hf:"):
        tokenizer = "hf:" + str(cwd / tokenizer[3:])
    stats = []
    for p in paths:
        path = Path(p)
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        stats += [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    key = repr((d.model_dump(mode="json"), paths, tokenizer, stats))
    if key not in _FINGERPRINTS:
        corpus = load_corpus(paths, d.val_fraction, tokenizer, d.text_column)
        _FINGERPRINTS[key] = corpus.fingerprint
    return _FINGERPRINTS[key]


KILL_WAIT_S = 60.0  # after SIGKILL: the kernel frees a big model's memory before the exit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ClusterError(RuntimeError):
    """A process did not come up or a condition was not reached in time; the message
    carries the tail of the relevant logs."""


class LocalCluster:
    def __init__(
        self,
        spec: Path,
        run_dir: Path,
        *,
        port: int | None = None,
        coordinator_threads: int = 1,
        env: dict[str, str] | None = None,
        coordinator_args: Sequence[str] = (),
        key: Path | None = None,
    ) -> None:
        """`coordinator_args`: more options for `covey coordinator` (--db, --blobs);
        `key`: the coordinator's key file outside its data dir (--key), so a coordinator
        restarted on another `data_dir` serves the same run."""
        self.spec = spec
        self.run_dir = run_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.coordinator_threads = coordinator_threads
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}  # validators too, by name
        self.ids: dict[str, str] = {}  # name -> peer id (the hash of its key)
        self.peak_rss: dict[str, int] = {}  # name -> peak resident bytes seen (sample_rss)
        self.data_dir = (run_dir / "coordinator").resolve()
        # the coordinator's key file, created here (the coordinator loads it): the run id
        self.coordinator_args = [*coordinator_args, *(["--key", str(key)] if key else [])]
        key_file = self.key_file = (key or self.data_dir / "coordinator.key").resolve()
        self.owner = Identity.load_or_create(key_file)  # the run's owner: its spec names none
        coordinator_key = self.owner.public_key
        self.config = load_run_config(spec).with_coordinator_key(coordinator_key)
        self._http = httpx.Client(base_url=self.url, timeout=5.0, trust_env=False)

    @cached_property
    def run_id(self) -> str:
        """The id peers are handed: spec (with the coordinator's key) and data fingerprint,
        computed here from the files, never asked of the coordinator."""
        return run_id_of(self.config, data_fingerprint(self.config, self.run_dir))

    # -- processes --------------------------------------------------------------------------

    def _spawn(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        return subprocess.Popen(
            [sys.executable, "-m", "covey", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.run_dir,
        )

    def start_coordinator(self, timeout_s: float = 90.0) -> None:
        self.coordinator = self._spawn(
            "coordinator",
            [
                "coordinator",
                str(self.spec.resolve()),
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                "--threads",
                str(self.coordinator_threads),
                *self.coordinator_args,
            ],
        )
        self.run_id  # noqa: B018 -- from the data as it is now, while the coordinator boots
        self.wait_for(lambda s: True, timeout_s, "the coordinator to serve /v1/status")

    def key(self, name: str) -> Path:
        """The identity file of the peer called `name` (created here, so its id is known
        before the process starts)."""
        path = (self.run_dir / "keys" / f"{name}.key").resolve()
        self.ids[name] = Identity.load_or_create(path).peer_id
        return path

    def fund(self, public_key: str, amount: float) -> float:
        """Deposit `amount` credits to a key as the run's owner (the coordinator's key:
        a cluster's spec names no other owner) through POST /v1/ledger/deposit; the key's
        held balance after it."""
        return float(deposit(self.url, self.owner, public_key, amount, self.run_id)["held"])

    def start_validator(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        return self._start_peer("validator", name, extra)

    def start_worker(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        store = str((self.run_dir / "peers" / name).resolve())
        return self._start_peer("worker", name, ("--store-dir", store, *extra))

    def start_house_worker(self, name: str, index: int, *extra: str) -> subprocess.Popen[bytes]:
        """House worker `index` of the run (`covey worker --house-of`: the run owner's own
        worker, whose contributions are the canaries, covey.trust.house), named `name` like
        any worker; `self.ids[name]` is its house key's peer id."""
        args = ("--house-of", str(self.key_file), "--house-index", str(index), *extra)
        proc = self.start_worker(name, *args)  # its --identity file goes unused
        self.ids[name] = house_identity(self.owner, self.run_id, index).peer_id
        return proc

    def _start_peer(self, kind: str, name: str, extra: Sequence[str]) -> subprocess.Popen[bytes]:
        """`covey worker|validator` with its own key, named `name` (see `self.ids`), told
        the run id (unless `extra` names one)."""
        if "--run-id" not in extra:
            extra = ("--run-id", self.run_id, *extra)
        key = self.key(name)
        # the owner funds what it stakes (a key bonds what it holds): its --stake, or for
        # a worker without one the run's minimum, which it then stakes
        if "--stake" in extra or kind == "worker":
            self._fund_peer(Identity.load_or_create(key), list(extra))
        proc = self._spawn(
            name,
            [
                kind,
                "--coordinator",
                self.url,
                "--identity",
                str(key),
                "--name",
                name,
                *extra,
            ],
        )
        self.workers[name] = proc
        return proc

    def _fund_peer(self, identity: Identity, args: list[str]) -> None:
        """Deposit what a peer started with `args` stakes (a worker without --stake: the
        run's minimum), less what its key holds and has bonded (`top_up`). A house worker
        (--house-of) stakes under its derived key."""
        if "--house-of" in args:
            coordinator = Identity.load_or_create(Path(args[args.index("--house-of") + 1]))
            index = int(args[args.index("--house-index") + 1]) if "--house-index" in args else 0
            identity = house_identity(coordinator, self.run_id, index)
        balances = self.get("/v1/ledger/balances")
        if "--stake" in args:
            stake = float(args[args.index("--stake") + 1])
        else:
            stake = float(balances["min_stake"]["worker"])
        top_up(self.url, self.owner, identity, stake, self.run_id, lambda: balances)

    def signal(self, name: str, sig: int) -> None:
        proc = self.coordinator if name == "coordinator" else self.workers[name]
        assert proc is not None
        proc.send_signal(sig)

    def wait_exit(self, name: str, timeout_s: float) -> int:
        proc = self.coordinator if name == "coordinator" else self.workers[name]
        assert proc is not None
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise ClusterError(
                f"{name} still running after {timeout_s} s\n{self.tail(name)}"
            ) from None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every worker (they send their deathrattle), then the coordinator;
        SIGKILL whatever outlives the timeout."""
        procs = [p for p in self.workers.values() if p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        _reap(procs, timeout_s)
        if self.coordinator and self.coordinator.poll() is None:
            self.coordinator.send_signal(signal.SIGTERM)
            _reap([self.coordinator], timeout_s)
        self._http.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observing --------------------------------------------------------------------------

    def sample_rss(self) -> dict[str, int]:
        """Update and return `peak_rss`: each live process's peak resident set (the
        kernel's VmHWM, so a peak between two samples is not missed) in bytes. Linux only;
        elsewhere, and for a process that has exited, nothing is recorded."""
        procs = {"coordinator": self.coordinator, **self.workers}
        for name, proc in procs.items():
            if proc is None or proc.poll() is not None:
                continue
            peak = _vm_hwm(proc.pid)
            if peak is not None:
                self.peak_rss[name] = max(peak, self.peak_rss.get(name, 0))
        return self.peak_rss

    def get(self, path: str, **params: Any) -> Any:
        resp = self._http.get(path, params=params or None)
        resp.raise_for_status()
        return resp.json()

    def status(self) -> dict[str, Any]:
        return self.get("/v1/status")

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str
    ) -> dict[str, Any]:
        """Poll /v1/status until predicate(status) holds; ClusterError after timeout_s."""
        give_up = time.monotonic() + timeout_s
        last: dict[str, Any] | str = "no answer yet"
        while time.monotonic() < give_up:
            if self.coordinator is not None and self.coordinator.poll() is not None:
                raise ClusterError(f"coordinator exited while waiting for {what}\n{self.tail()}")
            try:
                status = self.status()
                last = status
                if predicate(status):
                    return status
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.2)
        summary = last if isinstance(last, str) else _summary(last)
        logs = "\n".join(self.tail(n, 40) for n in ["coordinator", *self.workers])
        raise ClusterError(
            f"timed out after {timeout_s} s waiting for {what}; last: {summary}\n{logs}"
        )

    def tail(self, name: str = "coordinator", lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {name}.log ---\n" + "\n".join(text.splitlines()[-lines:])


def _vm_hwm(pid: int) -> int | None:
    """The peak resident set of process `pid` in bytes, from /proc (None if unreadable)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


def _reap(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, give_up - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            try:  # a process freeing GBs on busy cores can take a while to go
                p.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                print(f"process {p.pid} outlived SIGKILL by {KILL_WAIT_S} s", flush=True)


def _summary(status: dict[str, Any]) -> str:
    peers = {p.get("name") or p["peer_id"]: p["state"] for p in status.get("peers", [])}
    return (
        f"phase {status.get('phase')}, round {status.get('round')}, "
        f"committed {status.get('committed_rounds')}, peers {peers}"
    )
