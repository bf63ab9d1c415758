"""Peak memory of a DiLoCo peer's round, phase by phase (docs/memory.md).

Runs one worker round in this process on a plain MLP of about --mparams million float32
parameters (no network): load the canonical state, train, encode the contribution,
apply the round, hash, serialize and parse the state. Before each phase the kernel's
peak-RSS counter is reset (/proc/self/clear_refs), so each line's "peak" is that phase's
own high-water mark; figures are in model sizes (M = the fp32 parameter bytes).

    .venv/bin/python scripts/mem_phases.py --mparams 30

Linux only (reads /proc/self/status). Exit 2 with `error: ...` on bad input.
"""

from __future__ import annotations

import argparse
import mmap
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from covey.algorithms import Contribution, build_strategy
from covey.config import DiLoCoConfig
from covey.memory import bound_heap, reset_peak, rss_mib, shapes_only
from covey.protocol.checkpoint import state_from_file, state_to_file


def _model(mparams: float, width: int = 1024) -> nn.Module:
    layers = max(1, round(mparams * 1e6 / (width * width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mparams", type=float, default=30.0, help="model size, millions")
    ap.add_argument("--contributions", type=int, default=2, help="contributions applied")
    ap.add_argument("--steps", type=int, default=2, help="inner steps")
    ap.add_argument("--glibc-default", action="store_true", help="leave glibc's heap as it is")
    args = ap.parse_args(argv)
    if args.mparams <= 0 or args.contributions < 1 or args.steps < 1:
        print("error: --mparams must be > 0, --contributions and --steps >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    if not args.glibc_default:
        bound_heap()
    model = _model(args.mparams)
    mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    loss = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    strategy = build_strategy(DiLoCoConfig(method="diloco", inner_steps=args.steps), model, loss)
    state = strategy.init_state()
    template = shapes_only(state)
    rows: list[tuple[str, float, float]] = []

    def phase(name: str, fn):  # type: ignore[no-untyped-def]
        base = rss_mib()["VmRSS"]
        reset_peak()
        t = time.perf_counter()
        out = fn()
        peak = rss_mib()["VmHWM"]
        rows.append((name, (peak - base) / mb, time.perf_counter() - t))
        return out

    phase("load_state", lambda: strategy.load_state(state))
    batch = torch.randn(8, model[0].in_features)
    for _ in range(args.steps):
        phase("inner_step", lambda: strategy.inner_step(batch))
    payload = phase("encode", lambda: strategy.make_contribution().payload)
    with tempfile.TemporaryDirectory() as d:
        pay = Path(d) / "payload"
        pay.write_bytes(payload)
        del payload
        with open(pay, "rb") as f:  # mapped as BlobStore.view maps a stored payload
            view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        contribs = [Contribution(view, 100, args.steps, None)] * args.contributions
        new = phase("apply_round", lambda: strategy.apply_round(state, contribs))
        phase("digest", new.digest)
        path = Path(d) / "state"
        phase("state_to_file", partial(state_to_file, new, path))
        del new
        phase("state_from_file", lambda: state_from_file(path, template))
    now = rss_mib()
    print(f"model {mb:.0f} MiB (M); process VmRSS {now['VmRSS']:.0f} MiB, "
          f"RssAnon {now['RssAnon']:.0f} MiB")  # fmt: skip
    print(f"{'phase':<16} {'peak above start (M)':>21} {'seconds':>8}")
    for name, over, secs in rows:
        print(f"{name:<16} {over:>21.2f} {secs:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
