"""`covey bench coordinator`: how a real coordinator process answers many peers.

Starts a coordinator (`python -m covey coordinator`, a nano-model run) and `procs` client
processes, each an asyncio loop holding its share of `peers` simulated peers: every peer
has its own Ed25519 key, joins, then heartbeats every `heartbeat_s` (random phases) and
watches the round as a worker does: a signed long-poll `/v1/round?after=TAG&wait=S`
(`round_wait_s`, covey.peer.worker_state.ROUND_WAIT_S), sent again as soon as it is
answered; with `round_wait_s` = 0, a plain poll every `poll_s` instead (the old workers'
way). All over real HTTP on 127.0.0.1. `submitters` of the
peers also train nothing but submit a real contribution to every round they are members
of: a random fp32 payload of the model's size, uploaded (signed PUT) and submitted through
the normal signed path, then the certificate long-poll. The others never submit, so after
two rounds as no-shows they sit out rounds (limits.no_show_backoff_s) and rounds close as
soon as the submitters are in. Latency is measured from the request's send to its reply,
over `duration_s` after every peer has joined and `warmup_s` more has passed (at the
start every peer's first heartbeat and round poll land within a second or two); any reply
but 200 (429 included) and any transport error is an error. A long-poll is not timed (it
lasts until there is news): op "round wake" is how late each woken peer learns of a round
it is in, from the first peer of its client process that learned of it (the spread of
delivering one change to its members: a reply naming a round the peer is a member of,
with a tag it had not seen).
The coordinator's CPU share comes from /proc/<pid>/stat over the same window (1.0 = one
core busy).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

from covey.bench.coordinator_clients import OPS, client_main
from covey.local.cluster import LocalCluster

SPEC = """
name = "bench-coordinator"
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 4
inner_state = "reset"
[rounds]
heartbeat_s = {heartbeat_s}
dead_after_s = {dead_after_s}
lease_s = {lease_s}
min_peers = {min_peers}  # the first round waits for every simulated peer
deadline_min_s = 5
deadline_max_s = 8
checkpoint_every = 1000
eval_every = 1000
eval_batches = 1
[limits]
# what this bench's legitimate traffic needs: every peer shares 127.0.0.1
address_rate = 100000.0
address_burst = 100000
join_rate = 100000.0
join_burst = 100000
max_connections = 8192
max_long_polls = 4096
keep_alive_s = 30.0
no_show_backoff_s = 3600.0
[trust]
min_stake = 0.0  # the simulated peers hold no credits: this bench measures serving them
"""
JOIN_TIMEOUT_S = 300.0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_coordinator_bench(
    out_dir: Path,
    *,
    peers: int = 1000,
    duration_s: float = 60.0,
    heartbeat_s: float = 2.0,
    poll_s: float = 2.0,
    round_wait_s: float = 5.0,
    warmup_s: float = 5.0,
    submitters: int = 4,
    procs: int = 2,
    echo: Any = print,
    db: str | None = None,
) -> list[dict[str, Any]]:
    """Run the bench; rows {op, p50_ms, p99_ms, max_ms, requests, errors, ...} per
    operation, then one row op="coordinator" with its CPU share, memory and rounds. `db`:
    the coordinator's --db (an empty PostgreSQL database); None: SQLite in `out_dir`.
    ValueError for a bad count or an `out_dir` holding an earlier run (its coordinator would
    resume that run, and the seeded submissions would meet their own earlier ones);
    ClusterError if the coordinator does not come up; RuntimeError if the peers do not
    all join within JOIN_TIMEOUT_S or a client process fails."""
    if not 0 <= submitters <= peers or procs < 1 or peers < 1:
        raise ValueError(f"need 0 <= submitters ({submitters}) <= peers ({peers}), procs >= 1")
    if (out_dir / "coordinator").exists():  # its coordinator would resume that run
        raise ValueError(f"{out_dir} holds an earlier bench run: give a new --out directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "run.toml"
    spec.write_text(
        SPEC.format(
            heartbeat_s=heartbeat_s,
            dead_after_s=5 * heartbeat_s,
            lease_s=10 * heartbeat_s,
            min_peers=peers,
        )
    )
    ctx = mp.get_context("spawn")
    args = ["--db", db] if db else []
    with LocalCluster(spec, out_dir, coordinator_args=args) as cluster:
        cluster.start_coordinator()
        assert cluster.coordinator is not None
        pid = cluster.coordinator.pid
        go, results = ctx.Event(), ctx.Queue()
        shares = [list(range(i, peers, procs)) for i in range(procs)]
        workers = [
            ctx.Process(
                target=client_main,
                args=(
                    cluster.url,
                    cluster.run_id,
                    share,
                    submitters,
                    heartbeat_s,
                    poll_s,
                    round_wait_s,
                    warmup_s,
                    duration_s,
                    go,
                    results,
                ),
                daemon=True,
            )
            for share in shares
        ]
        for w in workers:
            w.start()
        joined, give_up = 0, time.monotonic() + JOIN_TIMEOUT_S
        while joined < len(workers):
            message = results.get(timeout=max(1.0, give_up - time.monotonic()))
            if message[0] != "joined":
                raise RuntimeError(f"a bench client failed while joining: {message}")
            joined += 1
        echo(f"{peers} peers joined; warm-up {warmup_s:.0f} s, then measuring {duration_s:.0f} s")
        go.set()
        time.sleep(warmup_s)  # the clients measure from the same moment
        cpu0, wall0, t0 = _cpu_seconds(pid), time.monotonic(), time.time()
        rounds0 = cluster.status()["committed_rounds"]
        samples: dict[str, list[float]] = {op: [] for op in OPS}
        sent: dict[str, list[float]] = {op: [] for op in OPS}  # when each sample was sent
        errors: dict[str, int] = dict.fromkeys(OPS, 0)
        reasons: dict[str, int] = {}
        late = long_polls = 0
        cpu1 = rss = None
        for _ in workers:
            message = results.get(timeout=warmup_s + duration_s + 120)
            if cpu1 is None:  # the first client is done: the window is over
                cpu1, wall1, rss = _cpu_seconds(pid), time.monotonic(), _rss_mib(pid)
            if message[0] != "done":
                raise RuntimeError(f"a bench client failed: {message}")
            for op, values in message[1].items():
                samples[op].extend(values)
            for op, n in message[2].items():
                errors[op] += n
            for reason, n in message[3].items():
                reasons[reason] = reasons.get(reason, 0) + n
            late += message[4]
            for op, values in message[5].items():
                sent[op].extend(values)
            long_polls += message[6]
        for w in workers:
            w.join(30)
        status = cluster.status()
    window = wall1 - wall0
    rows = []
    for op in OPS:
        values = samples[op]
        rows.append(
            {
                "op": op,
                "p50_ms": _ms(_percentile(values, 0.50)),
                "p99_ms": _ms(_percentile(values, 0.99)),
                "max_ms": _ms(max(values) if values else None),
                "requests": len(values) + errors[op],
                "errors": errors[op],
                "per_s": round((len(values) + errors[op]) / window, 1),
                "peers": submitters if op in ("upload", "submit") else peers,
                # [second of the window, requests sent in it, their max latency in ms]:
                # where a tail comes from (a burst at a round change, a stall)
                "timeline": _timeline(sent[op], values, t0),
            }
        )
    # every request the coordinator answered: the round wakes are long-polls, counted
    # in long_polls with those that ended at their `wait`
    answered = sum(len(samples[op]) + errors[op] for op in OPS if op != "round wake")
    answered += long_polls
    rows.append(
        {
            "op": "coordinator",
            "p50_ms": None,
            "p99_ms": None,
            "requests": answered,
            "errors": sum(r["errors"] for r in rows),
            "cpu_share": round((cpu1 - cpu0) / window, 3),
            # load-independent: the coordinator's CPU time per answered request
            "cpu_ms_per_request": round(1000 * (cpu1 - cpu0) / max(1, answered), 3),
            "rss_mib": round(rss, 1),
            "rounds": status["committed_rounds"] - rounds0,
            "window_s": round(window, 1),
            "late_ticks": late,
            "long_polls": long_polls,
            "error_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:5]),
            "peers": peers,
            "submitters": submitters,
            "heartbeat_s": heartbeat_s,
            "poll_s": poll_s,
            "round_wait_s": round_wait_s,
            "warmup_s": warmup_s,
            "load_avg": os.getloadavg()[0],
        }
    )
    return rows


def _timeline(sent: list[float], latency: list[float], t0: float) -> list[list[float]]:
    by_second: dict[int, list[float]] = {}
    for at, s in zip(sent, latency, strict=True):
        by_second.setdefault(int(at - t0), []).append(s)
    return [[k, len(v), round(1000 * max(v), 1)] for k, v in sorted(by_second.items())]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def rows_json(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, indent=2) + "\n"
