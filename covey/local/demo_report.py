"""The end of a `covey demo` run: metrics.jsonl, loss.png and summary.json in the run
directory, and the summary printed in the terminal (covey.local.demo runs the cluster)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from covey.local.cluster import LocalCluster
from covey.local.demo_house import canary_counts
from covey.models.naming import model_title
from covey.sim.report import human_bytes, pyplot, write_json, write_jsonl


def write_demo_outputs(
    out_dir: Path,
    cluster: LocalCluster,
    status: dict[str, Any],
    kills: list[dict[str, Any]],
    interrupted: bool,
    minutes_trained: float,
    say: Callable[[str], None],
    house: Collection[str] = (),
) -> dict[str, Any]:
    """Write metrics.jsonl, loss.png and summary.json into `out_dir` from the final
    `status` and the chaos `kills` (Chaos.events), print the summary with `say`, and
    return it. `minutes_trained` counts from the first worker's join; `house`: the names
    of the house workers (covey.local.demo_house), whose canaries are counted apart."""
    rounds = status["rounds"]
    write_jsonl(out_dir / "metrics.jsonl", rounds)
    kill_rounds = [k["committed_rounds"] for k in kills]
    plotted = plot_demo(out_dir / "loss.png", rounds, kill_rounds, status)
    losses = [r["val_loss"] for r in rounds if r["val_loss"] is not None]
    coordinator_dir = out_dir / "coordinator"
    procs = {"coordinator": cluster.coordinator, **cluster.workers}
    summary: dict[str, Any] = {
        "run_id": status["run_id"],
        "algorithm": status["method"],
        "model": status["model"],
        "model_name": status["model_name"],  # covey.models.naming
        "model_source": status["model_source"],
        "parameters": status["parameters"],
        "minutes": round(minutes_trained, 2),  # from the first join to the end
        "interrupted": interrupted,
        "status_url": f"{cluster.url}/",
        "rounds_committed": status["committed_rounds"],
        "first_val_loss": losses[0] if losses else None,
        "last_val_loss": losses[-1] if losses else None,
        "bytes_total": status["bytes_total"],
        "tokens_total": sum(r["tokens"] for r in rounds),
        "peers_seen": [p.get("name") or p["peer_id"] for p in status["peers"]],
        "house_workers": sorted(house),
        "trust": _trust(coordinator_dir, status, house),
        # peer seconds per second of a centralized run (covey.protocol.multiplier)
        "decentralization": status.get("costs"),
        "kills": len(kills),
        "kill_events": kills,
        "rounds_after_first_kill": (
            status["committed_rounds"] - kills[0]["committed_rounds"] if kills else None
        ),
        "processes": {
            name: {
                "pid": p.pid,
                "exit_code": p.returncode,
                "peak_rss_mb": round(cluster.peak_rss[name] / 2**20, 1)
                if name in cluster.peak_rss
                else None,
            }
            for name, p in procs.items()
            if p is not None
        },
        "paths": {
            "run_dir": str(out_dir),
            "spec": str(out_dir / "run.toml"),
            "coordinator_db": str(coordinator_dir / "coordinator.db"),
            "checkpoints": sorted(
                str(p) for p in (coordinator_dir / "checkpoints").glob("*.safetensors")
            ),
            "logs": str(cluster.logs),
            "metrics": str(out_dir / "metrics.jsonl"),
            "plot": str(out_dir / "loss.png") if plotted else None,
        },
    }
    write_json(out_dir / "summary.json", summary)
    for line in _summary_lines(summary):
        say(line)
    return summary


def _trust(coordinator_dir: Path, status: dict[str, Any], house: Collection[str]) -> dict:
    """The ledger checked from the run directory (`covey ledger verify`), who was caught
    (a house worker banned at its canary's reveal is no cheat caught), and the canaries:
    "disputes" leaves out the checks of canaries, which are counted in "canaries"."""
    from covey.io import audit
    from covey.trust.ledger import LedgerError

    try:
        report = audit.verify(coordinator_dir)
        verdict = (
            f"OK: {report.entries} entries, chain, signatures and balances check out "
            f"(covey ledger verify {coordinator_dir})"
        )
    except (LedgerError, OSError) as e:
        verdict = f"INVALID: {e}"
    trust = status.get("trust") or {}
    counts = trust.get("verifications") or {}
    disputes = sum(counts.get(k, 0) for k in ("fraud", "validator wrong", "inconclusive"))
    try:
        canaries: dict[str, Any] | None = canary_counts(coordinator_dir)
        disputes = canaries.pop("disputes")
    except (LedgerError, OSError, sqlite3.Error):  # no ledger to read: no canaries counted
        canaries = None
    banned = [p.get("name") or p["peer_id"] for p in status["peers"] if p.get("banned")]
    return {
        "ledger": verdict,
        "banned": [name for name in banned if name not in house],
        "agreed": counts.get("agree", 0),
        "disputes": disputes,
        "canaries": canaries,
        "accounts": trust.get("accounts", {}),
    }


def _summary_lines(s: dict[str, Any]) -> list[str]:
    val = (
        f"{s['first_val_loss']:.4f} -> {s['last_val_loss']:.4f}"
        if s["first_val_loss"] is not None
        else "no evaluation yet"
    )
    lines = [
        "",
        f"{s['rounds_committed']} rounds committed in {s['minutes']:.1f} min "
        f"({s['algorithm']}, {model_title(s['model_name'], s['model_source'], s['parameters'])})"
        + (", interrupted" if s["interrupted"] else ""),
        f"val loss         {val}",
        f"sent             {human_bytes(s['bytes_total'])} in contributions, "
        f"{s['tokens_total']:,} tokens trained",
        f"peers seen       {len(s['peers_seen'])}: {', '.join(s['peers_seen'])}",
    ]
    peaks = [f"{n} {p['peak_rss_mb']:.0f}" for n, p in s["processes"].items() if p["peak_rss_mb"]]
    if peaks:
        lines.append(f"peak RSS (MiB)   {', '.join(peaks)}")
    trust = s["trust"]
    lines.append(f"ledger           {trust['ledger']}")
    if trust["banned"]:
        lines.append(f"caught           {', '.join(trust['banned'])}: slashed and excluded")
    lines.append(
        f"verified         {trust['agreed']} re-executions agreed, {trust['disputes']} disputes"
        + (" (canaries aside)" if s.get("house_workers") else "")
    )
    if s.get("house_workers") and (c := trust.get("canaries")) is not None:
        lines.append(
            f"canaries         {c['drawn']} drawn from house workers "
            f"({', '.join(s['house_workers'])}): {c['caught']} caught by a validator, "
            f"{c['passed']} passed (the referee convicted them at the reveal), "
            f"{c['unchecked']} not checked, {c['pending']} still out at the end"
        )
    if (costs := s.get("decentralization")) and costs.get("multiplier") is not None:
        adds = ", ".join(f"{k} +{v:.2f}" for k, v in costs["adds"].items() if v)
        lines.append(f"multiplier       {costs['multiplier']:.2f}x a centralized run ({adds})")
    if s["kills"]:
        lines.append(
            f"chaos            {s['kills']} worker(s) SIGKILLed; "
            f"{s['rounds_after_first_kill']} rounds committed after the first kill"
        )
    paths = s["paths"]
    lines += [
        f"run directory    {paths['run_dir']}",
        f"  run.toml                    the run spec (run id {s['run_id']})",
        "  coordinator/coordinator.db  rounds, certificates, peers, events (SQLite)",
        f"  coordinator/checkpoints/    {len(paths['checkpoints'])} checkpoint(s)",
        "  logs/                       one log per process",
        "  metrics.jsonl, summary.json" + (", loss.png" if paths["plot"] else ""),
    ]
    return lines


def plot_demo(
    path: Path, rounds: Sequence[dict[str, Any]], kill_rounds: Sequence[int], status: dict
) -> bool:
    """Two panels: validation and mean training loss against round, and bytes of
    contributions per round. Dotted lines mark chaos kills. False (nothing written, a
    one-line note) without matplotlib."""
    if (plt := pyplot()) is None:
        return False

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label, alpha in (
        ("val_loss", "validation loss (canonical weights)", 1.0),
        ("train_loss", "train loss (mean of the workers')", 0.7),
    ):
        points = [r for r in rounds if r[key] is not None]
        xs, ys = [r["round"] for r in points], [r[key] for r in points]
        ax_loss.plot(xs, ys, marker=".", alpha=alpha, label=label)
    ax_bytes.bar([r["round"] for r in rounds], [r["bytes"] for r in rounds], color="tab:green")
    for k in kill_rounds:
        for ax in (ax_loss, ax_bytes):
            ax.axvline(k, color="tab:red", linestyle=":", alpha=0.7)
    ax_loss.set_ylabel("loss")
    ax_bytes.set_ylabel("bytes of contributions")
    for ax in (ax_loss, ax_bytes):
        ax.set_xlabel("round")
        ax.grid(True, alpha=0.3)
    ax_loss.legend(fontsize=8)
    fig.suptitle(
        f"covey demo: {status['method']}, {status['model_name']}, "
        f"run {status['run_id']}" + (f", {len(kill_rounds)} kills" if kill_rounds else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
