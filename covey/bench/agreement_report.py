"""`covey bench agreement`'s rows, table and plot: the simulator's and the network's
validation loss at each of the simulator's evaluations, and the verdict on the tail mean
(the mean of the last `tail` evaluations, as `covey bench comms --long` judges a method).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from covey.bench.comms_report import tail_mean
from covey.sim.report import pyplot

GOAL = 0.01  # |network tail - sim tail| / sim tail: agreement within 1%


def eval_points(records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> list[dict]:
    """The simulator's evaluations: round 0 (the warm start, its initial_val_loss), then
    every record with a val_loss. -> [{"round", "step", "val_loss"}], step being inner steps
    per worker since the warm start."""
    points = [{"round": 0, "step": 0, "val_loss": summary["initial_val_loss"]}]
    points += [
        {"round": r["round"], "step": r["inner_steps"], "val_loss": r["val_loss"]}
        for r in records
        if r.get("val_loss") is not None
    ]
    return points


def agreement_rows(
    method: str, points: Sequence[dict[str, Any]], network: dict[int, float], tail: int
) -> list[dict[str, Any]]:
    """One row per evaluation and source ("sim", "network"), then a summary row (source
    "summary"): the tail means (the last `tail` evaluations after round 0, as `covey bench
    comms` judges), the relative gap network vs sim, and whether it is within GOAL. Also
    whether round 0 evaluated identically (`same_batches`). KeyError for a round the
    network was not evaluated at."""
    rows: list[dict[str, Any]] = []
    for p in points:
        for source, loss in (("sim", p["val_loss"]), ("network", network[p["round"]])):
            rows.append({"method": method, "source": source, "round": p["round"],
                         "step": p["step"], "val_loss": loss})  # fmt: skip
    later = [p for p in points if p["round"] > 0]
    sim_tail = tail_mean(later, tail)
    net_tail = tail_mean([{"val_loss": network[p["round"]]} for p in later], tail)
    gap = (net_tail - sim_tail) / sim_tail
    rows.append(
        {
            "method": method,
            "source": "summary",
            "step": later[-1]["step"],
            "tail_evals": tail,
            "tail_steps": [p["step"] for p in later[-max(1, tail) :]],
            "sim_val_loss_tail": sim_tail,
            "network_val_loss_tail": net_tail,
            "gap": gap,
            "goal": GOAL,
            "agree": abs(gap) <= GOAL,
            "same_batches": points[0]["val_loss"] == network[0],
        }
    )
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Sim and network val loss at each evaluation, the tail means and the verdict."""
    sim = {r["round"]: r for r in rows if r["source"] == "sim"}
    net = {r["round"]: r["val_loss"] for r in rows if r["source"] == "network"}
    s = next(r for r in rows if r["source"] == "summary")
    head = f"{'round':>6}{'step':>7}{'sim':>10}{'network':>10}{'gap':>9}"
    lines = [head, "-" * len(head)]
    for n, r in sim.items():
        gap = (net[n] - r["val_loss"]) / r["val_loss"]
        lines.append(f"{n:>6}{r['step']:>7}{r['val_loss']:>10.4f}{net[n]:>10.4f}{gap:>+9.2%}")
    lines.append("-" * len(head))
    lines.append(
        f"{'tail':>13}{s['sim_val_loss_tail']:>10.4f}{s['network_val_loss_tail']:>10.4f}"
        f"{s['gap']:>+9.2%}   (mean of the last {s['tail_evals']} evaluations)"
    )
    verdict = "AGREE" if s["agree"] else "DISAGREE"
    lines.append(f"{verdict}: |gap| {abs(s['gap']):.2%} vs the goal {s['goal']:.0%}")
    if not s.get("valid", s["same_batches"]):
        lines.append("NOT A VALID COMPARISON: " + "; ".join(invalid_because(s)))
    return "\n".join(lines)


def plot_agreement(path: Path, rows: Sequence[dict[str, Any]], title: str) -> bool:
    """Validation loss against inner steps per worker, the simulator's and the network's;
    False (nothing written) without matplotlib."""
    if (plt := pyplot()) is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for source, style in (("sim", "-"), ("network", "--")):
        points = [r for r in rows if r["source"] == source]
        ax.plot([r["step"] for r in points], [r["val_loss"] for r in points], style,
                marker=".", label=source)  # fmt: skip
    ax.set_xlabel("inner steps per worker after the warm start")
    ax.set_ylabel("validation loss (the simulator's batches)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def invalid_because(summary: dict[str, Any]) -> list[str]:
    """Why the summary row's comparison does not measure training alone (empty: it does):
    the checks `covey bench agreement` records, each False when it failed."""
    why = {
        "same_batches": "the warm start evaluates differently here than in the simulator",
        "sim_final_reevaluated": "the simulator's final state re-evaluates to another loss",
        "every_round_full": "some round lacked a worker or cut inner steps",
    }
    return [text for key, text in why.items() if summary.get(key) is False]
