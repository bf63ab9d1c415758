"""Peak memory of a validator's re-execution of one DiLoCo round (docs/memory.md).

Builds a model (default: configs/gpt2-124m, 124M parameters), trains one round to make a
worker's previous end state (weights + AdamW moments), then re-executes the next round as
`covey validator` does (covey.peer.validator: every commitment's state kept for a
dispute's evidence, the previous end state handed over), and prints the process's RSS
before it and its peak during it (/proc/self/clear_refs resets the peak counter).

    .venv/bin/python scripts/mem_validator.py                 # as the validator runs it now
    .venv/bin/python scripts/mem_validator.py --in-memory     # states kept in memory

Linux only. No network, no data files (random byte tokens).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from covey.algorithms import TrainState, build_strategy
from covey.algorithms.aggregation import build_aggregator
from covey.config import RunConfig
from covey.memory import bound_heap, reset_peak, rss_mib
from covey.models.source import build_run_model
from covey.trust import verify

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=f"hf:{ROOT / 'configs' / 'gpt2-124m'}")
    ap.add_argument("--steps", type=int, default=2, help="inner steps (commit every step)")
    ap.add_argument("--in-memory", action="store_true", help="keep the states in memory")
    args = ap.parse_args()
    bound_heap()
    torch.set_num_threads(2)
    cfg = RunConfig.model_validate(
        {
            "name": "mem",
            "model": {"source": args.model},
            "data": {"batch_size": 2, "seq_len": 64},
            "algorithm": {"method": "diloco", "inner_steps": args.steps, "codec": "int4"},
        }
    )
    model, loss, _, _ = build_run_model(cfg.model, 0, tokenizer_vocab=256, seq_len=64)
    strategy = build_strategy(cfg.algorithm, model, loss, build_aggregator("mean", 0.1, 2.0))
    start = TrainState({n: p.detach().clone() for n, p in model.named_parameters()})
    n = sum(t.numel() for t in start.params.values())
    print(f"model {args.model}: {n / 1e6:.1f}M parameters ({n * 4 / 2**20:.0f} MiB fp32)")

    def batch(step: int) -> torch.Tensor:
        return torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(step))

    strategy.begin_round(start)  # the worker's previous round, for its end state
    for s in range(args.steps):
        strategy.inner_step(batch(s))
    strategy.make_contribution()
    held = {"previous_end": strategy.local_state()}
    print(f"before the re-execution: RSS {rss_mib()['VmRSS']:,.0f} MiB")
    points = range(len(verify.commitment_steps(args.steps, 1)))
    reset_peak()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        kept = {} if args.in_memory else {"spill_dir": Path(scratch), "consume_previous_end": True}
        mine = verify.reexecute(
            strategy, start, batch, args.steps, 1, points, held.pop("previous_end"), **kept
        )
        peak = rss_mib()["VmHWM"]
        print(
            f"re-execution ({len(mine.states)} states kept "
            f"{'in memory' if args.in_memory else 'on disk'}): {time.perf_counter() - t0:.0f} s, "
            f"peak RSS {peak:,.0f} MiB, RSS after {rss_mib()['VmRSS']:,.0f} MiB"
        )


if __name__ == "__main__":
    main()
