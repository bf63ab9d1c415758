"""`covey bench swarm`: SWARM against a fixed GPipe-style pipeline on the same servers.

Each run starts a swarm coordinator and 4 stage servers (2 stages) as processes on
127.0.0.1; this process is the trainer. Both modes keep the same number of microbatches in
flight: by default the SWARM trainer's own default, two per server (8; the fixed pipeline
splits them per pipeline, 4 each: GPipe wants several microbatches per stage). Server speed is
emulated: each request sleeps `emulate_s` x its slowdown (plus real compute x slowdown),
so the comparison does not hinge on the load of a shared machine. Modes: `swarm` routes
every hop by least expected finish time, reroutes on failure and lets the coordinator
rebalance; `fixed` wires pipelines once (pipeline j = the j-th server of every stage) and
never reroutes, so a dead server stalls its pipeline. Scenarios: `homogeneous` (all 1x, no
failures) and `heterogeneous-churn` (1x to 4x, every `kill_every` s one server whose stage
keeps another is SIGKILLed, and a fresh one started 5 s later). Victims are drawn up
front by name from a seeded generator, so both modes lose the same servers at the same
times; kills happen only during the training time. Rows: mode, scenario, samples_per_s
(samples over the whole wall time, a stalled pipeline's overrun included),
samples_per_s_until_end (samples by the nominal end over its length),
samples_per_s_before_first_kill, kills_at, final_loss, reroutes, rebalances, the fixed
wiring, the decentralization multiplier and what each part adds (covey.swarm.costs), and
bytes between stages per microbatch (int8 measured; plain and subspace computed from the
shapes; `covey bench swarm-codecs` measures every codec on the wire).
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCENARIOS = {
    "homogeneous": {"speeds": (1.0, 1.0, 1.0, 1.0), "kill": False},
    "heterogeneous-churn": {"speeds": (1.0, 2.0, 3.0, 4.0), "kill": True},
}
MODES = ("swarm", "fixed")
SETTINGS = {
    "n_layer": 4, "n_embd": 64, "n_head": 2, "seq_len": 32, "stages": 2, "microbatch": 4,
    "target_samples": 32, "verify_rate": 0.0, "request_timeout_s": 20.0, "rebalance_s": 10.0,
    "heartbeat_s": 1.0, "dead_after_s": 15.0,
    "hysteresis": 1.2,
}  # fmt: skip


def run_one(
    mode: str, scenario: str, *, seconds: float, kill_every: float, emulate_s: float,
    echo: Callable[[str], None], tokens: Any = None, service_time: bool = True,
    inflight: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    from covey.swarm.codecs import bytes_per_token
    from covey.swarm.launch import Swarm, status
    from covey.swarm.trainer import SwarmTrainer

    spec = SCENARIOS[scenario]
    inflight = inflight or 2 * len(spec["speeds"])  # the trainer's default, for both modes
    work = Path(tempfile.mkdtemp(prefix=f"covey-bench-swarm-{mode}-"))
    settings = dict(SETTINGS)
    if mode == "fixed":
        settings["rebalance_s"] = 1e6  # fixed wiring: nobody moves
    swarm = Swarm(work, settings)
    rng = random.Random(0)
    try:
        swarm.start_coordinator(wait=False)  # servers wait for it: the starts overlap
        names = []
        for i, speed in enumerate(spec["speeds"]):
            names.append(f"s{i}-x{speed:g}")
            stage = str(i % settings["stages"])  # s0, s2 on stage 0; s1, s3 on stage 1
            swarm.start_server(names[-1], "--slowdown", str(speed), "--emulate-s",
                               str(emulate_s), "--stage", stage)  # fmt: skip
        who = {x["peer_id"]: x["name"] for x in swarm.ready(names)["servers"]}
        t = SwarmTrainer(swarm.url, name="bench", inflight=inflight, fixed=mode == "fixed",
                         progress=lambda _: None, tokens=tokens)  # fmt: skip
        t.router.service_time = service_time
        run = threading.Thread(target=lambda: t.train(seconds=seconds), daemon=True)
        start = time.monotonic()
        run.start()
        kills, revive, last_kill = 0, [], start
        # victims drawn up front by name, the same sequence in both modes; a drawn server
        # that is down or alone on its stage now is passed over for the next one
        order = [rng.choice(sorted(names)) for _ in range(64)]
        marks: list[tuple[float, int]] = []  # (seconds since start, samples) at each kill
        at_end: int | None = None
        while run.is_alive():
            run.join(timeout=0.5)
            now = time.monotonic()
            if at_end is None and now - start >= seconds:
                at_end = t.stats.samples
            if spec["kill"] and now - last_kill >= kill_every and now - start < seconds:
                last_kill = now
                # a server whose stage keeps another one: churn, not a stage wiped out
                spare = set(_spare(status(swarm.url), set(swarm.servers)))
                victim = next((v for v in order if v in spare), None)
                if victim is None:
                    continue
                order.remove(victim)
                marks.append((now - start, t.stats.samples))
                swarm.kill(victim)
                kills += 1
                revive.append((now + 5.0, victim))
                echo(f"  [{mode} {scenario} {now - start:4.0f} s] SIGKILL {victim}")
            for when, name in [r for r in revive if r[0] <= now]:
                revive.remove((when, name))
                swarm.start_server(name, "--slowdown", name.split("-x")[-1], "--emulate-s",
                                   str(emulate_s))  # fmt: skip
        elapsed = time.monotonic() - start
        st = status(swarm.url) or {"rebalances": -1}
        t.close()
        cfg = t.cfg
        tokens = cfg.microbatch * cfg.seq_len
        per_token = bytes_per_token(cfg.n_embd, max(1, cfg.n_embd // 8))
        boundaries = 2 * (cfg.stages - 1)  # activations forward, gradients backward
        mbs = max(t.stats.microbatches, 1)
        costs = st.get("costs") or {"multiplier": None, "adds": None}  # the coordinator's
        return {
            "mode": mode, "scenario": scenario, "seconds": round(elapsed, 1),
            "samples": t.stats.samples, "samples_per_s": round(t.stats.samples / elapsed, 3),
            "final_loss": t.loss(), "reroutes": t.router.reroutes,
            "rebalances": st["rebalances"], "dropped": t.stats.dropped, "kills": kills,
            "samples_per_s_until_end": round((t.stats.samples if at_end is None else at_end)
                                             / seconds, 3),
            "samples_per_s_before_first_kill": round(marks[0][1] / marks[0][0], 3)
            if marks else None,
            "kills_at": [[round(a, 1), n] for a, n in marks],
            "wiring": {k: [who.get(p, p[:8]) for p in v] for k, v in t.pinned.items()} or None,
            "router": "service_time" if service_time else "latency", "inflight": inflight,
            "multiplier": costs["multiplier"], "multiplier_adds": costs["adds"],
            "bytes_per_microbatch": {
                "int8_measured": round(t.stats.bytes_between_stages / mbs),
                "plain": round(boundaries * tokens * per_token["fp32"]),
                "int8": round(boundaries * tokens * per_token["int8"]),
                "subspace_rank_n_embd_over_8": round(boundaries * tokens * per_token["subspace"]),
            },
        }  # fmt: skip
    finally:
        swarm.close()


def _spare(s: dict[str, Any] | None, ours: set[str]) -> list[str]:
    """Our live servers whose stage has another live server."""
    if s is None:
        return []
    return sorted(n for x in s["stages"] if len(x["servers"]) >= 2 for n in x["servers"]
                  if n in ours)  # fmt: skip


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    from covey.sim.report import pyplot

    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    scen = list(SCENARIOS)
    for j, mode in enumerate(MODES):
        vals = [next((r["samples_per_s"] for r in rows if r["mode"] == mode
                      and r["scenario"] == s), 0.0) for s in scen]  # fmt: skip
        ax.bar([i + 0.38 * j for i in range(len(scen))], vals, width=0.36, label=mode)
    ax.set_xticks([i + 0.19 for i in range(len(scen))], scen)
    ax.set_ylabel("samples/s")
    ax.set_title("SWARM vs fixed pipeline, same servers (emulated speeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_swarm_bench(
    *, quick: bool, seconds: float | None, kill_every: float, emulate_s: float,
    json_path: Path | None, plot_path: Path | None, echo: Callable[[str], None],
    inflight: int | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Both scenarios, both modes; rows as in the module docstring."""
    from covey.data.corpus import load_corpus

    secs = seconds or (60.0 if quick else 180.0)
    tokens = load_corpus().train  # the runs' data (stdlib), loaded once for all four
    rows = []
    for scenario in SCENARIOS:
        for mode in MODES:
            echo(f"{scenario} / {mode}: {secs:.0f} s ...")
            row = run_one(mode, scenario, seconds=secs, kill_every=kill_every,
                          emulate_s=emulate_s, echo=echo, tokens=tokens,
                          inflight=inflight)  # fmt: skip
            echo(f"  {json.dumps(row)}")
            rows.append(row)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rows, indent=1) + "\n")
    if plot_path is not None:
        plot(rows, plot_path)
    return rows
