"""Writing a run's results: metrics JSONL, summary JSON and the loss plots (PNG).

Plots need matplotlib, an optional extra (``pip install 'covey[plots]'``) so that a worker
installs only what it needs; without it a plot is skipped with a one-line note and every
other output is written as usual."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLOTS_EXTRA = "pip install 'covey[plots]'"
_noted = False


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None (after a one-line note on stderr, once
    per process) when matplotlib is not installed."""
    global _noted
    try:
        import matplotlib
    except ImportError:
        if not _noted:
            note = f"note: plots skipped, matplotlib is not installed ({PLOTS_EXTRA})"
            print(note, file=sys.stderr)
            _noted = True
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec, sort_keys=True) + "\n")


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def plot_runs(path: Path, runs: dict[str, Sequence[dict[str, Any]]], title: str) -> bool:
    """Two panels: validation loss against bytes sent per worker (log scale) and against
    simulated wall-clock time. `runs` maps a label to its per-round records. False (and
    nothing written) without matplotlib."""
    if (plt := pyplot()) is None:
        return False

    fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, all_records in runs.items():
        records = [r for r in all_records if r["val_loss"] is not None]
        xs_b = [r["bytes_sent_per_worker"] for r in records]
        xs_t = [r["sim_time_s"] for r in records]
        ys = [r["val_loss"] for r in records]
        ax_bytes.plot(xs_b, ys, label=label, marker=".", markersize=3)
        ax_time.plot(xs_t, ys, label=label, marker=".", markersize=3)
    ax_bytes.set_xscale("log")
    ax_bytes.set_xlabel("bytes sent per worker (cumulative)")
    ax_time.set_xlabel("simulated wall-clock (s)")
    for ax in (ax_bytes, ax_time):
        ax.set_ylabel("validation loss")
        ax.grid(True, alpha=0.3)
    ax_bytes.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def save_run(out_dir: Path, label: str, records: Sequence[dict[str, Any]], summary: dict) -> bool:
    """metrics.jsonl, summary.json and plot.png in out_dir (created if missing); returns
    whether the plot was written (not without matplotlib)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "metrics.jsonl", records)
    write_json(out_dir / "summary.json", summary)
    return plot_runs(out_dir / "plot.png", {label: records}, f"covey sim: {label}")


def human_bytes(n: float) -> str:
    """1234567 -> "1.2 MB" (decimal units, as bandwidth is quoted)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
