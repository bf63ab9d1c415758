"""The run spec of `covey demo` (pure: a dict as its TOML holds it, nothing started).
covey.local.demo writes it to the run directory and starts the processes that read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

METHODS = ("ddp", "diloco", "streaming", "demo")
PER_STEP_METHODS = ("ddp", "demo")  # one inner step per round


def demo_spec(
    algorithm: str,
    *,
    model: str = "nano",
    seed: int = 0,
    workers: int = 1,
    adversaries: int = 0,
    house_workers: int = 0,
    tokenizer: str = "bytes",
    data: tuple[str, ...] = (),
    rounds: int | None = None,
    inner_steps: int | None = None,
    batch_size: int = 8,
    seq_len: int | None = None,
    text_column: str | None = None,
) -> dict[str, Any]:
    """The run spec for a demo of `algorithm`, as the dict its TOML holds. Rounds are sized
    to take a few seconds on a laptop CPU; the run is bounded by time, and by `rounds`
    committed rounds when given (max_rounds). `inner_steps` (H), `batch_size` and `seq_len`
    size a big model's rounds to this machine; with `inner_steps` a slow peer's H is not
    cut to fit the few seconds a nano round takes.

    With `adversaries` among the `workers`, a round waits for 3 workers, so that none is a
    cheater's alone (one x100 update certified as round 0 wrecks the model, and then
    nobody's work can be told from anybody's; README, "Trust"), but for no more than the
    honest ones, or the run would stop once the cheaters are excluded. Nor for the
    `house_workers` among the honest (covey.local.demo_house): one leaves at each reveal of
    its canary, and its replacement takes a while to start."""
    if algorithm not in METHODS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {', '.join(METHODS)}")
    algo: dict[str, Any] = {"method": algorithm}
    if algorithm in ("diloco", "streaming"):
        # outer momentum 0.5, not the papers' 0.9: a demo has tens of rounds, where 0.5
        # was the best of {0, 0.5, 0.9} (BENCHMARKS.md, quick comms bench)
        algo |= {"outer_lr": 0.7, "outer_momentum": 0.5, "optim": {"lr": 3e-3}}
    if algorithm == "diloco":
        # a fresh inner optimizer each round makes each round's work a function of its
        # start state alone, so validators can re-execute it (covey.trust.verify)
        algo |= {"inner_steps": 30, "codec": "fp32", "inner_state": "reset"}
    elif algorithm == "streaming":
        # a fragment syncs every inner_steps / fragments = 8 steps (arXiv 2501.18512)
        algo |= {"inner_steps": 32, "fragments": 4, "overlap_steps": 1, "codec": "int4"}
    elif algorithm == "demo":
        # sign updates (arXiv 2411.19870) at 1e-3 barely move in the ~100 steps of a demo
        algo |= {"lr": 3e-3, "chunk": 64, "topk": 32}
    if inner_steps is not None and algorithm not in PER_STEP_METHODS:
        algo["inner_steps"] = inner_steps
        if algorithm == "streaming":  # a fragment syncs every inner_steps / fragments steps
            algo["fragments"] = max(1, min(4, inner_steps // 2))
            algo["inner_steps"] = inner_steps - inner_steps % algo["fragments"]
    rounds_cfg: dict[str, Any] = {"max_rounds": rounds} if rounds is not None else {}
    limits: dict[str, Any] = {}
    if inner_steps is not None:
        # a big model's step takes seconds: let the H asked for fit the round; and a process
        # moving GBs on busy cores may miss heartbeats for a while without being gone
        rounds_cfg |= {
            # every honest worker in every round: starting one takes minutes, and a round
            # opened for the first to join would leave the others waiting it out
            "min_peers": max(1, workers - adversaries - house_workers),
            "target_compute_s": 600.0,
            # committing, encoding and moving a model-sized payload on busy cores takes
            # minutes the step-time estimate does not see; a round closes once all submit
            "deadline_min_s": 900.0,
            "deadline_max_s": 1800.0,
            "dead_after_s": 60.0,
            "lease_s": 120.0,
        }
        # a submission makes the coordinator pull a model-sized payload from the worker
        # before it answers: on busy cores that outlasts the default 30 s per request
        limits["request_timeout_s"] = 300.0
    return {
        "name": f"covey-demo-{algorithm}",
        "seed": seed,
        "model": {"size": model} if ":" not in model else {"source": _absolute(model)},
        # absolute: the peers run in the run directory (the stdlib corpus when no paths)
        "data": {
            "batch_size": batch_size,
            "tokenizer": _absolute(tokenizer),
            "paths": [str(Path(p).expanduser().resolve()) for p in data],
            **({"seq_len": seq_len} if seq_len is not None else {}),
            **({"text_column": text_column} if text_column is not None else {}),
        },
        "algorithm": algo,
        "rounds": {
            "min_peers": max(1, min(3, workers - adversaries - house_workers))
            if adversaries
            else 1,
            # caps a slow peer's inner steps; nano's 30 steps fit ~10x over on one core
            "target_compute_s": 3.0,
            "checkpoint_every": 5,
            "keep_checkpoints": 3,
            # per-step methods commit a round per step: evaluating every other one keeps
            # the coordinator's driver thread from becoming the bottleneck
            "eval_every": 2 if algorithm in PER_STEP_METHODS else 1,
            "eval_batches": 4,
            **rounds_cfg,
        },
        # a demo lasts minutes: one contribution in four is checked (the default, 0.03, would
        # show few checks), and the minimum stake follows that rate (RunConfig.min_stake:
        # 12 rounds of pay), which the cluster deposits to each worker's key
        "trust": {"sample_rate": 0.25, "commit_every": 10},
        **({"limits": limits} if limits else {}),
    }


def _absolute(source: str) -> str:
    """hf:<dir> with an absolute dir (the processes run elsewhere); others unchanged."""
    if source.startswith("hf:"):
        return f"hf:{Path(source[3:]).expanduser().resolve()}"
    return source
