"""`covey bench network`: real coordinator and worker processes over an emulated WAN.

Where `covey bench comms` *models* the network, this bench runs it: one Linux network
namespace per host (covey.bench.netns), every link capped by tbf at ``mbit`` both ways,
the coordinator in host ``coord`` and each worker in ``w0``, ``w1``, ... serving its
contributions from its own blob server on its namespace address. Each (bandwidth, method)
pair is one fresh testbed and one fresh run, trained for a fixed wall-clock budget (or
until the spec's ``max_rounds``).

Methods (`network_methods`): every-step synchronization (DDP, fp32 gradients), DiLoCo with
H inner steps (fp32 pseudo-gradients) and the best compressed method of `covey bench
comms` (BENCHMARKS.md): the same DiLoCo with the int4 codec and error feedback; Streaming
DiLoCo (int4, 2 fragments) with its communication overlapped with the next round's first
tau = H/2 - 1 inner steps (covey/peer/overlap.py), and the same without overlap (tau = 0).
Outer optimizer as in `covey bench comms`: Nesterov lr 0.7, momentum 0.5.

How the numbers are read, and why:

- **Status from inside the testbed.** The root namespace has no route to the namespaces'
  addresses (netns.py builds nothing there), and adding one would put an unshaped path
  beside the shaped ones. So /v1/status is fetched by a tiny stdlib script run with
  ``ip netns exec`` in the coordinator's own namespace: the request goes over that
  namespace's local route, never through a tbf, and costs the benchmarked links nothing.
- **Timestamps from the coordinator's database.** /v1/status gives each committed round's
  losses, bytes, tokens and utilization, but not when it committed. After the coordinator
  has exited, its SQLite file (``<run>/coordinator/coordinator.db``, read-only) gives
  each round's ``opened_at`` / ``closed_at`` and each contribution's ``compute_s``,
  ``wall_s`` and ``submitted_at``: exact, from the coordinator's one clock, where polling
  would be as coarse as its interval.
- **Clock zero** is round 0's opening, i.e. the moment every worker had joined
  (``rounds.min_peers = workers``), so process start-up (importing torch, loading the
  corpus) is not charged to any method. Round 0 still includes every worker downloading
  the initial weights.
- **Utilization** is the coordinator's: per round, the mean over accepted peers of compute
  seconds / the round's cycle (commit to commit); this bench averages rounds >= 1
  (round 0 includes the initial download and warm-up). `breakdown_s` splits the mean cycle
  into parts that sum to it exactly (see `summarize_run`), to say what the rest was.
- **Worker utilization** is each worker's own: the seconds it spent in inner steps over
  the wall seconds between the ends of its rounds' training (``<store>/rounds.jsonl``,
  rounds after its first), averaged over workers. Where the coordinator's figure measures
  a round's compute against the commit-to-commit cycle, this one also sees a worker that
  trains ahead while the network works (Streaming DiLoCo's overlap) as busy.
- **Target loss.** Unless one is given, it is the highest of the runs' best validation
  losses: the best loss that *every* run reached within its budget, so each run has a
  time to target, and the slowest run's time is its time to its own best. One target for
  all bandwidths, so times compare across rows. A time is when that round committed
  (``closed_at``); its evaluation follows within a fraction of a second.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import fmean
from typing import IO, Any

from covey.bench.netns import Testbed, TestbedUnavailable, check_support
from covey.bench.network_plan import (
    METHOD_KEYS,
    STEADY_FROM,
    STREAMING_FRAGMENTS,
    NetMethod,
    apply_target,
    default_target,
    format_breakdown,
    format_table,
    network_methods,
    run_spec,
    streaming_fits,
    summarize_run,
    worker_utilization,
)
from covey.config import to_toml

PORT = 8470  # every testbed's namespaces are fresh: a fixed port cannot collide
POLL_S = 2.0  # status poll while a run trains: only to notice the end and print progress
PROGRESS_S = 30.0  # a progress line at most this often
STARTUP_TIMEOUT_S = 180.0  # coordinator serving + every worker joined, round 0 open
REQUEST_TIMEOUT_S = 10.0  # one /v1/status request
STOP_TIMEOUT_S = 20.0  # SIGTERM to exit, then SIGKILL
# Child processes reach only namespace addresses: a proxy from the environment would be
# unreachable from inside a namespace.
_PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}

# Runs in the coordinator's namespace; proxies are bypassed for the same reason.
_STATUS_SCRIPT = r"""
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open(sys.argv[1], timeout=float(sys.argv[2])) as reply:
    sys.stdout.write(reply.read().decode())
"""


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARS}
    return {**env, "PYTHONUNBUFFERED": "1"}


def _status(tb: Testbed, url: str) -> dict[str, Any] | None:
    """/v1/status fetched from inside the coordinator's namespace; None if no answer."""
    argv = [sys.executable, "-c", _STATUS_SCRIPT, url, str(REQUEST_TIMEOUT_S)]
    try:
        proc = tb.run("coord", argv, REQUEST_TIMEOUT_S + 5, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout)


def _read_timeline(
    db_path: Path,
) -> tuple[dict[int, float], dict[int, float], dict[int, list[dict[str, float]]]]:
    """opened_at, closed_at and accepted contributions of every committed round."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT round, attempt, opened_at, closed_at FROM rounds WHERE status = 'committed'"
        ).fetchall()
        contribs = conn.execute(
            "SELECT c.round, c.compute_s, c.wall_s, c.submitted_at FROM contributions c "
            "JOIN rounds r ON c.round = r.round AND c.attempt = r.attempt "
            "WHERE r.status = 'committed'"
        ).fetchall()
    finally:
        conn.close()
    opened = {n: o for n, _, o, _ in rows}
    closed = {n: c for n, _, _, c in rows}
    per_round: dict[int, list[dict[str, float]]] = {}
    for n, compute_s, wall_s, submitted_at in contribs:
        per_round.setdefault(n, []).append(
            {"compute_s": compute_s, "wall_s": wall_s, "submitted_at": submitted_at}
        )
    return opened, closed, per_round


class _Processes:
    """The run's coordinator and workers, each in its host's namespace and logging to
    ``<run>/logs/<host>.log``. Leaving stops them: workers first with SIGTERM (their
    deathrattle needs the coordinator), then the coordinator; SIGKILL for whatever
    outlives STOP_TIMEOUT_S."""

    def __init__(self, tb: Testbed, run_dir: Path) -> None:
        self.tb, self.run_dir = tb, run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[IO[bytes]] = []
        self._env = _child_env()

    def spawn(self, host: str, args: list[str]) -> None:
        log = open(self.logs / f"{host}.log", "wb")  # noqa: SIM115 - closed in __exit__
        self._files.append(log)
        self.procs[host] = self.tb.popen(
            host,
            [sys.executable, "-m", "covey", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._env,
            cwd=self.run_dir,
        )

    def exited(self) -> dict[str, int]:
        return {h: rc for h, p in self.procs.items() if (rc := p.poll()) is not None}

    def tails(self, lines: int = 25) -> str:
        out = []
        for host in self.procs:
            path = self.logs / f"{host}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            out.append(f"--- {path} ---\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(out)

    def __enter__(self) -> _Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        workers = [p for h, p in self.procs.items() if h != "coord"]
        coord = [self.procs["coord"]] if "coord" in self.procs else []
        for group in (workers, coord):
            for p in group:
                if p.poll() is None:
                    p.terminate()
            give_up = time.monotonic() + STOP_TIMEOUT_S
            for p in group:
                try:
                    p.wait(max(0.1, give_up - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(STOP_TIMEOUT_S)
        for f in self._files:
            f.close()


def run_one(
    method: NetMethod,
    *,
    mbit: float,
    model: str,
    workers: int,
    budget_s: float,
    run_dir: Path,
    max_rounds: int | None = None,
    batch_size: int = 8,
    verify_rate: float | None = None,
    validators: int = 0,
) -> dict[str, Any]:
    """One fresh testbed, one fresh run of `method`, trained for budget_s after round 0
    opens (or until max_rounds), with `validators` validator processes on hosts of their
    own (their evidence fetches cross the workers' capped links). RuntimeError, with the
    logs' tails, if a process exits early or the run does not start within
    STARTUP_TIMEOUT_S."""
    run_dir = run_dir.resolve()  # the children run with cwd=run_dir
    if run_dir.exists():  # a coordinator given an old data dir would resume the old run
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    spec_path = run_dir / "run.toml"
    spec = run_spec(
        method,
        model=model,
        workers=workers,
        batch_size=batch_size,
        max_rounds=max_rounds,
        verify_rate=verify_rate,
    )
    spec_path.write_text(to_toml(spec))
    worker_names = [f"w{i}" for i in range(workers)]
    names = ["coord", *worker_names] + [f"v{i}" for i in range(validators)]
    loads: list[float] = []
    with Testbed(names, mbit=mbit) as tb, _Processes(tb, run_dir) as procs:
        coord_ip = tb.hosts["coord"].ip
        url = f"http://{coord_ip}:{PORT}"
        procs.spawn("coord", [
            "coordinator", str(spec_path), "--host", coord_ip, "--port", str(PORT),
            "--data-dir", str(run_dir / "coordinator"), "--threads", "1",
        ])  # fmt: skip
        for name in worker_names:
            procs.spawn(name, [
                "worker", "--coordinator", url, "--name", name,
                "--identity", str(run_dir / "keys" / f"{name}.key"),
                "--store-dir", str(run_dir / "peers" / name), "--threads", "1",
                "--blob-host", tb.hosts[name].ip, "--bandwidth-mbps", f"{mbit:g}",
            ])  # fmt: skip
        for name in names[1 + workers :]:
            procs.spawn(name, [
                "validator", "--coordinator", url, "--name", name,
                "--identity", str(run_dir / "keys" / f"{name}.key"),
                "--store-dir", str(run_dir / "peers" / name), "--threads", "1",
            ])  # fmt: skip
        status = _train(tb, url, procs, budget_s, f"{mbit:g} Mbit/s {method.name}", loads)
    opened, closed, contributions = _read_timeline(run_dir / "coordinator" / "coordinator.db")
    record = summarize_run(
        method=method,
        mbit=mbit,
        status=status,
        opened=opened,
        closed=closed,
        contributions=contributions,
        budget_s=budget_s,
    )
    # This run's own processes make a load of about workers + 1 while they compute; more
    # means other work competed for the cores (it slows compute and inflates utilization).
    own = worker_utilization([run_dir / "peers" / n for n in worker_names])
    record["worker_utilization"] = own["mean"]
    record["worker_utilization_each"] = own["each"]
    record["worker_waited_s_mean"] = own["waited_s"]
    steady = worker_utilization([run_dir / "peers" / n for n in worker_names], STEADY_FROM)
    record["worker_utilization_steady"] = steady["mean"]
    record["worker_waited_s_steady"] = steady["waited_s"]
    # the checks' outcomes by then (agree, withheld, pending...): what the validators did
    record["verifications"] = (status.get("trust") or {}).get("verifications")
    record["load_1m_mean"] = fmean(loads) if loads else None
    record["load_1m_max"] = max(loads, default=None)
    return record


def _train(
    tb: Testbed, url: str, procs: _Processes, budget_s: float, label: str, loads: list[float]
) -> dict[str, Any]:
    """Wait for round 0 to open, then for the budget (or the run to finish); return the
    last /v1/status taken before anything is stopped. Appends the 1-minute load average
    to `loads` at every poll after round 0 opened."""
    started = time.monotonic()
    clock_zero: float | None = None
    last: dict[str, Any] | None = None
    next_progress = 0.0
    while True:
        status = _status(tb, f"{url}/v1/status")
        now = time.monotonic()
        if status is not None:
            last = status
            if status["phase"] == "finished":  # max_rounds reached; workers leave by themselves
                return status
            if clock_zero is None and (status["phase"] != "waiting" or status["rounds"]):
                clock_zero = now
        if exited := procs.exited():
            # a worker leaves by itself once the run is finished: look once more
            final = _status(tb, f"{url}/v1/status")
            if final is not None and final["phase"] == "finished":
                return final
            raise RuntimeError(f"{label}: exited early {exited}\n{procs.tails()}")
        if clock_zero is None and now - started > STARTUP_TIMEOUT_S:
            raise RuntimeError(
                f"{label}: round 0 did not open within {STARTUP_TIMEOUT_S:.0f} s\n{procs.tails()}"
            )
        if clock_zero is not None and last is not None:
            loads.append(os.getloadavg()[0])
            elapsed = now - clock_zero
            if elapsed >= budget_s:
                return last
            if now >= next_progress:
                losses = [r["val_loss"] for r in last["rounds"] if r["val_loss"] is not None]
                loss = f"{losses[-1]:.4f}" if losses else "—"
                print(
                    f"  [{label}] {elapsed:5.0f} s: {last['committed_rounds']} rounds, "
                    f"val loss {loss}",
                    flush=True,
                )
                next_progress = now + PROGRESS_S
        time.sleep(POLL_S)  # pacing between polls; the conditions are checked above


def run_network_bench(
    *,
    mbits: Sequence[float] = (10, 100),
    model: str = "micro",
    workers: int = 2,
    minutes_per_run: float = 3.0,
    target_loss: float | None = None,
    out_dir: Path,
    methods: Sequence[str] = METHOD_KEYS,
    inner_steps: int = 50,
    max_rounds: int | None = None,
    batch_size: int = 8,
    verify_rate: float | None = None,
    validators: int = 0,
) -> list[dict[str, Any]]:
    """Every method at every bandwidth, each a fresh testbed and run; returns the records
    (also written to ``out_dir/records.json`` after every run, so a failure later keeps
    the earlier ones). `TestbedUnavailable` up front if namespaces cannot be built here."""
    reason = check_support()
    if reason is not None:
        raise TestbedUnavailable(reason)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if minutes_per_run <= 0:
        raise ValueError(f"minutes_per_run must be positive, got {minutes_per_run}")
    known = {m.key: m for m in network_methods(inner_steps)}
    if unknown := sorted(set(methods) - set(known)):
        why = "" if streaming_fits(inner_steps) else (
            f" (Streaming DiLoCo needs H = {inner_steps} to be a multiple of "
            f"{STREAMING_FRAGMENTS}, at least {2 * STREAMING_FRAGMENTS})"
        )  # fmt: skip
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(known)}{why}")
    out_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    for mbit in mbits:
        for key in methods:
            method = known[key]
            print(f"== {mbit:g} Mbit/s, {method.name}, {workers} workers, {model}", flush=True)
            record = run_one(
                method,
                mbit=mbit,
                model=model,
                workers=workers,
                budget_s=minutes_per_run * 60,
                run_dir=out_dir / f"{mbit:g}mbit-{method.name}",
                max_rounds=max_rounds,
                batch_size=batch_size,
                verify_rate=verify_rate,
                validators=validators,
            )
            record["verify_rate"] = verify_rate
            record["validators"] = validators
            records.append(record)
            target = target_loss if target_loss is not None else default_target(records)
            apply_target(records, target)
            (out_dir / "records.json").write_text(json.dumps(records, indent=2) + "\n")
    print(format_table(records))
    print()
    print(format_breakdown(records))
    print(f"wrote {out_dir / 'records.json'}")
    return records
