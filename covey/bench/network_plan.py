"""The pure half of `covey bench network` (covey.bench.network runs the processes): the
methods compared, each run's spec, and the summary of a finished run (cycle breakdown,
worker utilization, time to a target loss) with the tables the bench prints."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from covey.config import RunConfig, TrustConfig

# A new peer's first contributions are all drawn for verification; after them only a
# sample_rate share is. Drawn or not, no round waits for evidence (its validators fetch it
# from the worker after the round): "steady" figures count the rounds from this one on.
STEADY_FROM = TrustConfig().new_peer_contributions


@dataclass(frozen=True)
class NetMethod:
    key: str  # what `methods=` selects: "ddp", "diloco", "diloco-int4-ef"
    name: str  # what the table shows, e.g. "diloco-h50-int4-ef"
    algorithm: dict[str, Any]
    # DDP commits a round per inner step; evaluating each one (0.3 s of one core for
    # micro) would take a large share of the 2 cores from the workers at 100 Mbit/s, where
    # a DDP round lasts ~1.6 s. Every 5 steps still gives several points at 10 Mbit/s.
    eval_every: int = 1


METHOD_KEYS = (
    "ddp", "diloco", "diloco-int4-ef", "streaming-int4", "streaming-int4-no-overlap"
)  # fmt: skip
STREAMING_FRAGMENTS = 2


def network_methods(inner_steps: int = 50) -> list[NetMethod]:
    """The methods at H = inner_steps. Streaming DiLoCo is among them only when H is a
    multiple of STREAMING_FRAGMENTS with at least 2 steps per round (`streaming_fits`)."""
    outer = {"outer_lr": 0.7, "outer_momentum": 0.5}  # as `covey bench comms`
    diloco = {"method": "diloco", "inner_steps": inner_steps, **outer}
    p = STREAMING_FRAGMENTS
    # tau: all but the last step of a round hide the previous round's transfer
    streaming = {"method": "streaming", "inner_steps": inner_steps, "fragments": p,
                 "codec": "int4", **outer}  # fmt: skip
    tau = inner_steps // p - 1
    methods = [
        NetMethod("ddp", "ddp", {"method": "ddp", "codec": "fp32"}, eval_every=5),
        NetMethod("diloco", f"diloco-h{inner_steps}", {**diloco, "codec": "fp32"}),
        NetMethod(
            "diloco-int4-ef",
            f"diloco-h{inner_steps}-int4-ef",
            {**diloco, "codec": "int4", "error_feedback": True},
        ),
        NetMethod(
            "streaming-int4",
            f"streaming-h{inner_steps}-p{p}-tau{tau}-int4",
            {**streaming, "overlap_steps": tau},
        ),
        NetMethod(
            "streaming-int4-no-overlap",
            f"streaming-h{inner_steps}-p{p}-tau0-int4",
            {**streaming, "overlap_steps": 0},
        ),
    ]
    return [m for m in methods if streaming_fits(inner_steps) or m.key in METHOD_KEYS[:3]]


def streaming_fits(inner_steps: int) -> bool:
    p = STREAMING_FRAGMENTS
    return inner_steps % p == 0 and inner_steps // p >= 2


def run_spec(
    method: NetMethod,
    *,
    model: str,
    workers: int,
    batch_size: int = 8,
    max_rounds: int | None = None,
    eval_batches: int = 4,
    verify_rate: float | None = None,
) -> dict[str, Any]:
    """The run spec of one bench run, as the TOML tables `covey coordinator` reads.
    `verify_rate`: the share of contributions drawn for verification, new peers' too
    (default: the run's defaults); a drawn one's evidence goes from its worker to its
    validators after the round (none run in this bench), never through the coordinator's
    link, and no round waits for it (covey.coordinator.intake)."""
    rounds: dict[str, Any] = {
        # Round 0 opens only once every worker has joined: clock zero is the same moment
        # for every method.
        "min_peers": workers,
        # Every peer does the full H: the bench measures the method, not the straggler
        # policy (which would cut a peer's steps to fit target_compute_s).
        "target_compute_s": 600.0,
        # Rounds here close when every live member has submitted. The deadline only has
        # to outlast the slowest honest round, round 0 at 10 Mbit/s included (every worker
        # downloading the initial weights through the coordinator's one capped link).
        "deadline_min_s": 120.0,
        "deadline_max_s": 300.0,
        "eval_every": method.eval_every,
        "eval_batches": eval_batches,
    }
    if max_rounds is not None:
        rounds["max_rounds"] = max_rounds
    spec = {
        "name": f"bench-network-{method.name}",
        "seed": 0,
        "model": {"size": model},
        "data": {"batch_size": batch_size},
        "algorithm": dict(method.algorithm),
        "rounds": rounds,
    }
    if verify_rate is not None:
        spec["trust"] = {"sample_rate": verify_rate, "new_peer_rate": verify_rate}
    RunConfig.model_validate(spec)  # a bad spec fails here, not in a child process
    return spec


def summarize_run(
    *,
    method: NetMethod,
    mbit: float,
    status: dict[str, Any],
    opened: dict[int, float],
    closed: dict[int, float],
    contributions: dict[int, list[dict[str, float]]],
    budget_s: float,
) -> dict[str, Any]:
    """One record from the final /v1/status and the coordinator's timestamps.

    ``opened`` / ``closed``: round -> opened_at / closed_at of its committed attempt;
    ``contributions``: round -> the accepted contributions' compute_s, wall_s and
    submitted_at. ``breakdown_s`` splits the mean cycle of rounds >= 1 exactly:

    - compute: mean compute seconds of the round's peers;
    - worker_other: the rest of a peer's time from seeing the round to the end of its
      training (state sync, batch sampling);
    - start_and_publish: round open until the worker saw it (finishing the previous
      round: fetching the others' contributions, applying them, the poll interval) plus
      publishing (the coordinator fetching the payload over the links, validating it);
    - straggler: how much later the last peer submitted than the mean peer;
    - close: last submission to commit (the outer step, serializing and storing weights);
    - coordinator: commit to the next round's opening (storing the commit, the round
      driver's next tick; evaluation too, where the coordinator does it inline).
    """
    rounds = [r for r in status["rounds"] if r["round"] in closed]
    if not rounds:
        raise RuntimeError(f"{method.name} at {mbit:g} Mbit/s committed no round in the budget")
    t0 = opened[rounds[0]["round"]]
    later = [r["round"] for r in rounds if r["round"] >= 1 and r["round"] - 1 in closed]
    parts: dict[str, list[float]] = {
        k: []
        for k in (
            "compute",
            "worker_other",
            "start_and_publish",
            "straggler",
            "close",
            "coordinator",
            "cycle",
        )
    }
    for n in later:
        cs = contributions.get(n) or []
        if not cs:
            continue
        since_open = [c["submitted_at"] - opened[n] for c in cs]
        parts["compute"].append(fmean(c["compute_s"] for c in cs))
        parts["worker_other"].append(fmean(c["wall_s"] - c["compute_s"] for c in cs))
        parts["start_and_publish"].append(
            fmean(s - c["wall_s"] for s, c in zip(since_open, cs, strict=True))
        )
        parts["straggler"].append(max(since_open) - fmean(since_open))
        parts["close"].append(closed[n] - opened[n] - max(since_open))
        parts["coordinator"].append(opened[n] - closed[n - 1])
        parts["cycle"].append(closed[n] - closed[n - 1])
    utils = [r["utilization"] for r in rounds if r["round"] >= 1 and r["utilization"] is not None]
    losses = [r["val_loss"] for r in rounds if r["val_loss"] is not None]
    window_s = closed[rounds[-1]["round"]] - t0
    tokens = sum(r["tokens"] or 0 for r in rounds)
    return {
        "mbit": mbit,
        "method": method.name,
        "method_key": method.key,
        "model": status.get("model"),
        "parameters": status.get("parameters"),
        "workers": sum(1 for p in status.get("peers", []) if p.get("contributions")),
        "algorithm": method.algorithm,
        "budget_s": budget_s,
        "rounds": len(rounds),
        "window_s": window_s,
        "final_val_loss": losses[-1] if losses else None,
        "best_val_loss": min(losses) if losses else None,
        "utilization": fmean(utils) if utils else None,
        "utilization_round0": rounds[0]["utilization"],
        "bytes_per_round": fmean(r["bytes"] or 0 for r in rounds),
        "tokens": tokens,
        "tokens_per_s": tokens / window_s if window_s > 0 else None,
        "breakdown_s": {k: fmean(v) for k, v in parts.items() if v},
        "curve": [
            {
                "round": r["round"],
                "t_s": closed[r["round"]] - t0,
                "val_loss": r["val_loss"],
                "utilization": r["utilization"],
            }
            for r in rounds
        ],
        "target_loss": None,
        "time_to_target_s": None,
        # measured by the coordinator (covey.coordinator.costs): peer seconds per second of
        # a centralized run, and what each part adds to it
        "multiplier": (status.get("costs") or {}).get("multiplier"),
        "multiplier_adds": (status.get("costs") or {}).get("adds"),
    }


def worker_utilization(store_dirs: Sequence[Path], since_round: int = 0) -> dict[str, Any]:
    """Each worker's own utilization from its ``rounds.jsonl`` (covey.peer.worker): compute
    seconds of its rounds after the first (of those numbered ``since_round`` or later) over
    the wall seconds from the end of the first one's training to the end of the last.
    -> {"mean", "each", "waited_s"} (None where a worker finished fewer than two rounds)."""
    each: list[float | None] = []
    waited: list[float] = []
    for d in store_dirs:
        path = d / "rounds.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        rows = sorted((r for r in rows if r["round"] >= since_round), key=lambda r: r["ended_at"])
        if len(rows) < 2 or rows[-1]["ended_at"] <= rows[0]["ended_at"]:
            each.append(None)
            continue
        wall = rows[-1]["ended_at"] - rows[0]["ended_at"]
        each.append(sum(r["compute_s"] for r in rows[1:]) / wall)
        waited.extend(r.get("waited_s", 0.0) for r in rows[1:])
    known = [u for u in each if u is not None]
    return {
        "mean": fmean(known) if known else None,
        "each": each,
        "waited_s": fmean(waited) if waited else None,
    }


def default_target(records: Sequence[dict[str, Any]]) -> float | None:
    """The best loss every run reached: the highest of the runs' best validation losses."""
    best = [r["best_val_loss"] for r in records if r["best_val_loss"] is not None]
    return max(best) if len(best) == len(records) and best else None


def apply_target(records: list[dict[str, Any]], target: float | None) -> None:
    """Set each record's target_loss and time_to_target_s (None: never reached)."""
    for r in records:
        r["target_loss"] = target
        hits = [p["t_s"] for p in r["curve"] if target is not None and p["val_loss"] is not None
                and p["val_loss"] <= target]  # fmt: skip
        r["time_to_target_s"] = hits[0] if hits else None


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """A markdown table: one row per (bandwidth, method)."""

    def num(v: Any, fmt: str, missing: str = "—") -> str:
        return missing if v is None else format(v, fmt)

    target = records[0]["target_loss"] if records else None
    lines = [
        f"| link | method | rounds | final val loss | time to {num(target, '.3f', 'target')} "
        f"| utilization | worker util. (from round {STEADY_FROM}) | bytes / round | tokens / s "
        "| mean cycle "
        "| compute | multiplier |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        b = r["breakdown_s"]
        lines.append(
            f"| {r['mbit']:g} Mbit/s | {r['method']} | {r['rounds']} "
            f"| {num(r['final_val_loss'], '.4f')} "
            f"| {num(r['time_to_target_s'], '.1f', 'not reached')}"
            f"{'' if r['time_to_target_s'] is None else ' s'} "
            f"| {num(r['utilization'], '.1%')} | {num(r.get('worker_utilization'), '.1%')} "
            f"({num(r.get('worker_utilization_steady'), '.1%')}) "
            f"| {r['bytes_per_round']:,.0f} "
            f"| {num(r['tokens_per_s'], ',.0f')} | {num(b.get('cycle'), '.2f')} s "
            f"| {num(b.get('compute'), '.2f')} s | {num(r.get('multiplier'), '.2f')}x |"
        )
    return "\n".join(lines)


def format_breakdown(records: Sequence[dict[str, Any]]) -> str:
    """Where each run's mean cycle (rounds >= 1) went, in seconds (see `summarize_run`),
    and the machine's load while it ran."""
    keys = ("compute", "worker_other", "start_and_publish", "straggler", "close", "coordinator")
    lines = [
        "| link | method | " + " | ".join(keys) + " | cycle | load (1 min, mean) |",
        "|---|---|" + "---:|" * (len(keys) + 2),
    ]
    for r in records:
        b = r["breakdown_s"]
        cells = " | ".join("—" if k not in b else f"{b[k]:.2f}" for k in (*keys, "cycle"))
        load = r.get("load_1m_mean")
        load_cell = "—" if load is None else f"{load:.1f}"
        lines.append(f"| {r['mbit']:g} Mbit/s | {r['method']} | {cells} | {load_cell} |")
    return "\n".join(lines)
