"""`covey bench comms`'s rows and table: each method against the DDP run it is judged by.

A row compares a method with its baseline (the DDP run of the same seed and lr schedule) on
the mean validation loss of its last `tail` evaluations: DDP at a constant lr wobbles about
±0.7% between evaluations, so one point decides nothing at the --long preset.
The row schema is the same for every preset; --quick judges on its last evaluation alone.
Each row also counts the verification evidence its worker sends at the run's default
sampling rate (covey.bench.comms_evidence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MethodRun:
    """One finished method: its name, baseline, seed, per-round records and summary."""

    name: str
    baseline: str
    seed: int
    records: list[dict[str, Any]]
    summary: dict[str, Any]


def tail_mean(records: Sequence[dict[str, Any]], tail: int) -> float:
    """The mean validation loss of the last `tail` evaluations (records with a val_loss).
    ValueError when the run has no evaluation."""
    losses = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    if not losses:
        raise ValueError("the run has no evaluation to judge")
    last = losses[-max(1, tail) :]
    return sum(last) / len(last)


def summarize(runs: dict[str, MethodRun], tail: int = 1) -> list[dict[str, Any]]:
    """One row per method. `val_loss` is the final evaluation, `val_loss_tail` the mean of
    the last `tail`; the gap and the byte reduction are against the method's baseline (None
    when that was not run)."""
    rows = []
    judged = {name: tail_mean(run.records, tail) for name, run in runs.items()}
    for name, run in runs.items():
        s = run.summary
        row: dict[str, Any] = {
            "method": name,
            "baseline": run.baseline,
            "seed": run.seed,
            "bytes_sent_per_worker": s["bytes_sent_per_worker"],
            "bytes_received_per_worker": s["bytes_received_per_worker"],
            "val_loss": s["final_val_loss"],
            "val_loss_tail": judged[name],
            "tail_evals": tail,
            "val_loss_gap_vs_ddp": None,
            "comm_reduction_vs_ddp": None,
            "sim_time_s": s["sim_time_s"],
            "utilization": s["utilization"],
            "rounds": s["rounds"],
            "tokens": s["tokens"],
            "parameters": s["parameters"],
            "initial_val_loss": s["initial_val_loss"],
            "real_time_s": s.get("real_time_s"),
        }
        base = runs.get(run.baseline)
        if base is not None:
            ref = judged[run.baseline]
            row["val_loss_gap_vs_ddp"] = (judged[name] - ref) / ref
            row["comm_reduction_vs_ddp"] = (
                base.summary["bytes_sent_per_worker"] / s["bytes_sent_per_worker"]
            )
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table (the loss column is the judged tail mean). The
    reduction against DDP is given with the verification evidence counted first ("all"),
    then for the payload alone ("payload"); a row without evidence counted shows neither
    evidence column."""
    head = (
        f"{'method':<30}{'sent/worker':>14}{'recv/worker':>15}{'evidence':>13}{'val loss':>10}"
        f"{'gap':>8}{'all':>9}{'payload':>9}{'sim time':>11}{'util':>7}{'mult':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        gap = "" if r["val_loss_gap_vs_ddp"] is None else f"{r['val_loss_gap_vs_ddp']:+.1%}"
        red = "" if r["comm_reduction_vs_ddp"] is None else f"{r['comm_reduction_vs_ddp']:,.0f}x"
        whole = r.get("comm_reduction_vs_ddp_with_evidence")
        whole_s = "" if whole is None else f"{whole:,.0f}x"
        evidence = r.get("evidence_bytes_per_worker")
        evidence_s = "" if evidence is None else f"{evidence:,.0f}"
        mult = r.get("multiplier")
        mult_s = "" if mult is None else f"{mult:.2f}x"
        lines.append(
            f"{r['method']:<30}{r['bytes_sent_per_worker']:>14,.0f}"
            f"{r['bytes_received_per_worker']:>15,.0f}{evidence_s:>13}{r['val_loss_tail']:>10.4f}"
            f"{gap:>8}{whole_s:>9}{red:>9}{r['sim_time_s']:>10.1f}s{r['utilization']:>7.1%}"
            f"{mult_s:>7}"
        )
    rates = {r["sample_rate"] for r in rows if r.get("sample_rate") is not None}
    if rates:
        lines.append(
            f"(evidence: bytes a worker sends its validators at sampling rate "
            f"{', '.join(f'{x:g}' for x in sorted(rates))}, its first contributions always "
            f"checked; 'all' is the reduction against DDP with it, 'payload' without; "
            f"'mult': peer seconds per second of a centralized run, modeled: network, "
            f"re-execution and evidence, docs/decentralization.md)"
        )
    return "\n".join(lines)
