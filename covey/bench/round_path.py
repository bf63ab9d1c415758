"""`covey bench roundpath`: what a worker's training thread waits for between a plain
DiLoCo round's certificate and the next round's first inner step, before and after its
hash check moved behind the next round (covey.peer.pending_check).

Timed on this machine's CPU, on a state of the chosen size (a preset's parameter count)
carrying DiLoCo's outer momentum, as every state after round 0 does: decoding and
aggregating `workers` payloads (the trust section's default rule, DiLoCo's codec) and
the outer step taking the start state's tensors as it goes, as the worker's
`apply_round_consuming` does; then the state's SHA-256 and its serialization into a blob
file whose content id the certificate names. Before, the training thread ran all of it;
now it runs the first two and starts a `PendingCheck` that runs the rest on its own
thread, which the next round settles before it publishes.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def preset_params(size: str) -> int:
    """A covey GPT preset's parameter count, from a model on the meta device (no memory)."""
    from covey.models.gpt import GPT, gpt_config

    with torch.device("meta"):
        return GPT(gpt_config(size)).num_parameters()


def time_round_path(numel: int, workers: int = 8, repeats: int = 1) -> dict[str, Any]:
    """Seconds on the training thread from a certificate to the next round's start, the
    fastest of `repeats`, before (apply, digest, serve) and after (apply, start the
    check); the check's own seconds on its thread; the parts per 1M parameters."""
    from covey.algorithms.aggregation import build_aggregator
    from covey.algorithms.codecs import get_codec
    from covey.algorithms.diloco import outer_step
    from covey.algorithms.lazy_aggregation import aggregate_lazily
    from covey.algorithms.state import TrainState
    from covey.config.networked import TrustConfig
    from covey.config.parts import DiLoCoConfig
    from covey.peer.pending_check import PendingCheck
    from covey.protocol.checkpoint import state_to_file

    trust, cfg = TrustConfig(), DiLoCoConfig()
    codec = get_codec(cfg.codec)
    rule = build_aggregator(trust.aggregation, trust.trim_fraction, trust.clip_factor)
    g = torch.Generator().manual_seed(0)
    params = torch.randn(numel, generator=g)
    momentum = torch.randn(numel, generator=g) * 1e-3
    payloads = [codec.encode(torch.randn(numel, generator=g) * 1e-3) for _ in range(workers)]

    def load(i: int) -> torch.Tensor:
        return codec.decode(payloads[i], numel)

    def apply() -> TrainState:  # each repeat from its own start: the step consumes it
        start = TrainState({"w": params}, {"momentum/w": momentum}, 1)
        flat = aggregate_lazily(rule, workers, load, [1.0] * workers, spill=True)
        return outer_step(start, {"w": flat}, cfg, consume=True)

    best: dict[str, float] = {}

    def keep(part: str, seconds: float) -> None:
        best[part] = min(best.get(part, float("inf")), seconds)

    with tempfile.TemporaryDirectory(prefix="covey-roundpath-") as d:
        blob = Path(d) / "state"
        for _ in range(repeats):
            # before: all of it on the training thread
            t0 = time.perf_counter()
            new = apply()
            t1 = time.perf_counter()
            want = new.digest()
            t2 = time.perf_counter()
            state_to_file(new, blob)
            t3 = time.perf_counter()
            keep("apply", t1 - t0)
            keep("digest", t2 - t1)
            keep("serve", t3 - t2)
            keep("before", t3 - t0)
            del new
            blob.unlink()
            # after: the check and the serving behind the next round
            t0 = time.perf_counter()
            new = apply()
            t1 = time.perf_counter()
            check = PendingCheck(1, new, want, lambda s, _d: state_to_file(s, blob)).start()
            t2 = time.perf_counter()
            outcome = check.result(3600.0)
            if not outcome.matched:
                raise RuntimeError("the repeated round result hashes otherwise")
            keep("after", t2 - t0)
            keep("start_check", t2 - t1)
            keep("behind", check.seconds)
            del new
            blob.unlink()
    per_m = 1e3 / (numel / 1e6)
    return {
        "parameters_m": round(numel / 1e6, 3),
        "workers": workers,
        "codec": cfg.codec,
        "aggregation": trust.aggregation,
        **{f"{part}_s": round(s, 4) for part, s in best.items()},
        **{f"{part}_ms_per_m": round(s * per_m, 3) for part, s in best.items()},
    }


def round_fraction(critical_s: float, inner_steps: int, step_s: float) -> float:
    """The share of a round's wall time the round result holds the training thread:
    critical / (H * step + critical)."""
    return critical_s / (inner_steps * step_s + critical_s)
