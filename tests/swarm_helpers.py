"""What the SWARM process tests share: a small run's settings and a running swarm of four
stage servers (a0, a1 on stage 0; b0, b1 on stage 1) over real processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from covey.swarm.launch import Swarm

SETTINGS: dict[str, Any] = {
    "n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "stages": 2, "microbatch": 4,
    "target_samples": 16, "verify_rate": 0.5, "rebalance_s": 3600, "request_timeout_s": 10,
    "payout_s": 1.0,
}  # fmt: skip


def corpus_text() -> str:
    """The run's training text: the documentation pages (docs/*.md) in name order, some
    170 KB of real English and code that every checkout has."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    return "".join(p.read_text() for p in sorted(docs.glob("*.md")))


def four_servers(work: Path, settings: dict[str, Any]) -> Iterator[Swarm]:
    """A coordinator and four fast stage servers, ready; closed when the caller is done."""
    data = work / "data.txt"
    data.write_text(corpus_text() * 2)
    s = Swarm(work, {**settings, "data_paths": [str(data)]})
    try:
        s.start_coordinator()
        for name in ("a0", "a1", "b0", "b1"):  # a: stage 0, b: stage 1
            s.start_server(name, "--emulate-s", "0.01", "--stage", str(int(name[0] == "b")))
        s.ready(["a0", "a1", "b0", "b1"])
        yield s
    finally:
        s.close()
