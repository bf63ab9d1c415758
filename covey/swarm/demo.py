"""`covey swarm demo`: a swarm coordinator, stage servers of mixed speeds and a trainer as
processes on 127.0.0.1, optionally SIGKILLing a server every S seconds (a fresh one takes
its place a few seconds later, as a new identity). Prints a status line every 5 s; the
status page is the coordinator's `/`.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from covey.swarm.launch import Swarm, status

SPEEDS = (1.0, 1.0, 2.0, 3.0, 4.0, 1.5, 2.5, 1.0)
SETTINGS = {
    "n_layer": 4, "n_embd": 64, "n_head": 2, "seq_len": 32, "stages": 2, "microbatch": 4,
    "target_samples": 32, "rebalance_s": 15.0, "verify_rate": 0.05, "dead_after_s": 15.0,
    "request_timeout_s": 20.0,
}  # fmt: skip


def _line(s: dict) -> str:
    stages = " | ".join(
        f"stage {x['stage']}: {','.join(x['servers']) or '-'} {x['throughput']:.0f}/s"
        for x in s["stages"]
    )
    t = list(s["trainers"].values())
    loss = t[0].get("loss") if t else None
    samples = t[0].get("samples", 0) if t else 0
    return (
        f"{stages} || samples {samples}, loss {'-' if loss is None else f'{loss:.3f}'}, "
        f"reroutes {s['reroutes']}, rebalances {s['rebalances']}, banned {len(s['banned'])}"
    )


def _spare(s: dict | None, ours: set[str]) -> list[str]:
    """Our live servers whose stage has another live server."""
    if s is None:
        return []
    by_stage = {x["stage"]: x["servers"] for x in s["stages"]}
    return sorted(n for names in by_stage.values() if len(names) >= 2 for n in names if n in ours)


def run_demo(
    *,
    minutes: float,
    kill_every: float | None,
    n_servers: int,
    port: int,
    emulate_s: float = 0.02,
    device: str = "cpu",
) -> int:
    """0 when the trainer finished its time and trained; 1 otherwise (logs kept). The stage
    servers compute on `device` (`--device`)."""
    work = Path(tempfile.mkdtemp(prefix="covey-swarm-demo-"))
    swarm = Swarm(work, SETTINGS, port=port)
    rng = random.Random(0)
    print(f"swarm demo in {work}: {n_servers} servers, {minutes} min, kill every {kill_every} s")
    try:
        swarm.start_coordinator()
        print(f"coordinator up: status page {swarm.url}/")
        names = []
        for i in range(n_servers):
            name = f"s{i}-x{SPEEDS[i % len(SPEEDS)]:g}"
            swarm.start_server(name, "--slowdown", str(SPEEDS[i % len(SPEEDS)]),
                               "--emulate-s", str(emulate_s), "--device", device)  # fmt: skip
            names.append(name)
        swarm.ready(names)
        print("servers up; training")
        out = work / "trainer.json"
        log = open(work / "trainer.log", "ab")  # noqa: SIM115 -- the child's
        trainer = subprocess.Popen(
            [sys.executable, "-m", "covey", "swarm", "trainer", "--coordinator", swarm.url,
             "--seconds", str(minutes * 60), "--json", str(out)],
            stdout=log, stderr=log,
        )  # fmt: skip
        start = last_kill = last_print = time.monotonic()
        deadline = start + minutes * 60 + 120
        revive: list[tuple[float, str]] = []
        while trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            now = time.monotonic()
            # a victim whose stage keeps another server: churn, not a stage wiped out
            spare = _spare(status(swarm.url), set(swarm.servers))
            if kill_every and now - last_kill >= kill_every and spare:
                last_kill = now
                victim = rng.choice(spare)
                swarm.kill(victim)
                print(f"[{now - start:5.0f} s] SIGKILL {victim}")
                revive.append((now + 5.0, victim))
            for when, name in [r for r in revive if r[0] <= now]:
                revive.remove((when, name))
                speed = name.split("-x")[-1]
                swarm.start_server(
                    name, "--slowdown", speed, "--emulate-s", str(emulate_s), "--device", device
                )
                print(f"[{now - start:5.0f} s] {name} restarted")
            if now - last_print >= 5 and (s := status(swarm.url)):
                last_print = now
                print(f"[{now - start:5.0f} s] {_line(s)}", flush=True)
        if trainer.poll() is None:
            trainer.kill()
            print("error: the trainer did not finish in time", file=sys.stderr)
            return 1
        summary = json.loads(out.read_text()) if out.exists() else {}
        print("trainer:", json.dumps(summary))
        return 0 if summary.get("samples", 0) > 0 else 1
    finally:
        swarm.close()
        print(f"logs in {work}")
