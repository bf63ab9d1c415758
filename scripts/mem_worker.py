"""Peak memory of a real worker's DiLoCo round, phase by phase (docs/memory.md).

Runs `covey.peer.worker.Worker`'s own round code in this process, without a network:
`_begin_round`, the side committer, `_train_and_finish` (its `_train`, `_end_round`,
`_finish`, `_round_result`, `_serve_state`, `_settle`), on a plain MLP of about --mparams
million float32 parameters, DiLoCo with outer momentum, the demo's trimmed mean + norm
clip, 2 contributions (this worker's and a copy under another id). Only the network is
replaced: publishing puts the payload in the worker's blob store, and the certificate is
the one the same round computed in a dry run (same seed, so the same weights hash; a
mismatch is reported).

The measured round is round 1 (its start state carries the outer momentum). Each phase's
peak is the kernel's VmHWM from the end of the previous phase to its own end (so nothing
between phases is missed), above the process's RSS with the model built and no state;
figures are in model sizes (M = the fp32 parameter bytes).

    .venv/bin/python scripts/mem_worker.py --mparams 30

Linux only (reads /proc/self/status). Exit 2 with `error: ...` on bad input; 1 when the
worker's weights did not match the dry run's.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from covey.algorithms import Contribution, TrainState, build_strategy
from covey.algorithms.aggregation import NormClip, TrimmedMean
from covey.blobs import BlobStore
from covey.config import DiLoCoConfig
from covey.memory import bound_heap, reset_peak, rss_mib, shapes_only
from covey.peer.overlap import SideCommitter
from covey.peer.worker import Worker, WorkerOptions
from covey.protocol import schemas
from covey.protocol.checkpoint import state_to_file
from covey.protocol.content import content_id

WIDTH = 1024


def _model(mparams: float) -> nn.Module:
    layers = max(1, round(mparams * 1e6 / (WIDTH * WIDTH)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _batch(round_: int, _key: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * round_ + step)
    return torch.randn(8, WIDTH, generator=g)


def _strategy(model: nn.Module, steps: int, inner_state: str) -> Any:
    cfg = DiLoCoConfig(method="diloco", inner_steps=steps, inner_state=inner_state)
    s = build_strategy(cfg, model, lambda m, b: m(b).pow(2).mean())
    s.aggregator = NormClip(2.0, TrimmedMean(0.2))  # the run's default robust rule
    return s


def _worker(strategy: Any, store_dir: Path, steps: int) -> Worker:
    """A Worker with what `_setup` would give it, minus the network."""
    w = Worker.__new__(Worker)
    w.opts = WorkerOptions(coordinator="http://127.0.0.1:9")
    w.name, w.peer_id = "mem", "p" * 64
    w.strategy, w.leader = strategy, None
    w.cfg = SimpleNamespace(
        trust=SimpleNamespace(sharded_above_peers=0, commit_every=10),
        data=SimpleNamespace(batch_size=8),
        limits=SimpleNamespace(request_timeout_s=30.0),
    )
    w.store_dir = store_dir
    w.store = BlobStore(store_dir / "blobs", 1 << 40)
    w.server = object()  # serves: keeps the state it computed in its store
    w.blob_url, w.blobs = None, None
    w.template = shapes_only(strategy.init_state())
    w._published, w._served_state = [], None
    w._chain = w._local = None
    w._transfer, w._trained_since_adopt, w.rounds_done = None, False, 0
    w._pending = None  # the round's hash check, run behind it (covey.peer.pending_check)
    w._waited_s, w._train_ended = 0.0, None
    w._batch = _batch  # type: ignore[method-assign]
    w._step_seed = lambda round, key, step: 1000 * round + step  # type: ignore[method-assign]
    w._check_standing = lambda: None  # type: ignore[method-assign]
    w.state, w.state_hash = None, None
    return w


def _info(round_: int, start_hash: str, steps: int) -> schemas.RoundInfo:
    return schemas.RoundInfo.model_validate(
        {
            "run_id": "r",
            "round": round_,
            "attempt": 0,
            "phase": "open",
            "member": True,
            "start_hash": start_hash,
            "start_cid": "c" * 64,
            "start_size": 1,
            "deadline_in_s": 1e6,
            "assignment": {"inner_steps": steps, "data_key": "k"},
        }
    )


def _cert(info: schemas.RoundInfo, cid: str, size: int, tokens: int, steps: int,
          new_hash: str, new_cid: str) -> schemas.Certificate:  # fmt: skip
    accepted = [
        schemas.AcceptedContribution(
            peer_id=p,
            cid=cid,
            size=size,
            tokens=tokens,
            inner_steps=steps,
            fragment=None,
            weight=1.0,
            providers=[],
        )
        for p in ("q" * 64, "r" * 64)
    ]
    return schemas.Certificate(run_id="r", round=info.round, attempt=0,
        start_hash=info.start_hash or "", new_hash=new_hash, new_cid=new_cid, new_size=1,
        accepted=accepted, rejected=[], closed_at=0.0, reason="")  # fmt: skip


def _trained(strategy: Any, state: TrainState, steps: int) -> Contribution:
    """Round state.round's contribution, trained from `state` as a fresh worker would."""
    strategy.begin_round(state)
    for i in range(steps):
        strategy.inner_step(_batch(state.round, "k", i))
    return strategy.make_contribution()


def _dry_round(strategy: Any, state: TrainState, steps: int) -> tuple[TrainState, str, int, int]:
    """Round state.round trained and applied without measuring, its contribution counted
    twice -> (new state, payload cid, payload size, tokens)."""
    c = _trained(strategy, state, steps)
    new = strategy.apply_round(state, [c, c])
    return new, content_id(c.payload), len(c.payload), c.tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mparams", type=float, default=30.0, help="model size, millions")
    ap.add_argument("--steps", type=int, default=2, help="inner steps")
    ap.add_argument(
        "--inner-state",
        choices=("reset", "keep"),
        default="reset",
        help="reset: the demo's; keep: DiLoCo's default (local state carried)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's default: 1)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = ap.parse_args(argv)
    if args.mparams <= 0 or args.steps < 1:
        print("error: --mparams must be > 0 and --steps >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    bound_heap()
    model = _model(args.mparams)
    mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    strategy = _strategy(model, args.steps, args.inner_state)
    with tempfile.TemporaryDirectory() as d:
        w = _worker(strategy, Path(d), args.steps)
        # round 0 makes round 1's start (with outer momentum); round 1 dry: its certificate
        start, _, _, _ = _dry_round(strategy, strategy.init_state(), args.steps)
        new, cid, size, tokens = _dry_round(strategy, start, args.steps)
        want_hash = new.digest()
        want_cid, _ = state_to_file(new, Path(d) / "expected")
        (Path(d) / "expected").unlink()
        del new
        for p in model.parameters():
            p.grad = None
        strategy.reset_inner_optimizer()
        hash1 = start.digest()
        # the worker applied round 0 itself and serves the result (its outer momentum is
        # then read from that file: `_serve_state`)
        start_cid, _ = state_to_file(start, Path(d) / "start")
        (Path(d) / "start").unlink()
        w._serve_state(start, start_cid)
        gc.collect()
        held = [
            *start.params.values(),
            *(start.outer.values() if type(start.outer) is dict else ()),
        ]
        base = rss_mib()["VmRSS"] - sum(t.nbytes for t in held) / 2**20  # model, no state
        del held
        w.state, w.state_hash = start, hash1
        del start
        rows: list[tuple[str, float, float]] = []
        clock = [time.perf_counter()]

        def mark(name: str) -> None:
            now = time.perf_counter()
            rows.append((name, (rss_mib()["VmHWM"] - base) / mb, now - clock[0]))
            clock[0] = now
            reset_peak()

        def wrap(obj: Any, attr: str, name: str) -> None:
            inner = getattr(obj, attr)

            def wrapped(*a: Any, **k: Any) -> Any:
                mark(f"(before {name})")
                out = inner(*a, **k)
                mark(name)
                return out

            setattr(obj, attr, wrapped)

        wrap(strategy, "inner_step", "inner_step")
        wrap(strategy, "make_contribution", "encode")
        # the worker's update: consuming its start state where the code has that
        consuming = hasattr(strategy, "apply_round_consuming")
        wrap(strategy, "apply_round_consuming" if consuming else "apply_round", "apply_round")
        wrap(w, "_serve_state", "serve_state")
        wrap(strategy, "adopt", "adopt")

        def publish(info: Any, c: Any, *rest: Any) -> bool:
            got = w.store.put(c.payload)
            w._published.append(got)
            return True

        info = _info(1, hash1, args.steps)
        w._publish = publish  # type: ignore[method-assign]
        wrap(w, "_publish", "publish")
        wrap(w, "_note_round", "note")
        wrap(w, "_end_round", "end_round")
        wrap(w, "_seal", "seal")
        wrap(strategy, "aggregate", "aggregate")
        w._await_certificate = lambda i: _cert(i, cid, size, tokens, args.steps, want_hash,
                                               want_cid)  # type: ignore[method-assign]  # fmt: skip
        reset_peak()
        mark("(start)")
        w._begin_round(info.round)
        mark("begin_round")
        committer = [SideCommitter(strategy, w.state, 10)]  # the worker's: a local
        mark("commit step 0")
        outcome = w._train_and_finish(
            info, time.monotonic() + 1e6, time.monotonic(), committer.pop()
        )
        mark("(settle)")
        refuted = w._settle_check()  # the hash check that ran behind the round
        mark("hash check")
        now = rss_mib()
        matched = not refuted and w.state_hash == want_hash
        if args.json:
            peaks = {name: round(over, 3) for name, over, _ in rows}
            print(json.dumps({"model_mib": mb, "matched": matched, "phases": peaks,
                              "weights_hash": w.state_hash,
                              "round_peak": max(r[1] for r in rows)}))  # fmt: skip
            return 0 if matched else 1
        print(f"model {mb:.0f} MiB (M); outcome {outcome}; weights match: {matched}")
        print(f"process VmRSS {now['VmRSS']:.0f} MiB, RssAnon {now['RssAnon']:.0f} MiB, "
              f"baseline (model, no state) {base:.0f} MiB")  # fmt: skip
        print(f"{'phase':<22} {'peak above baseline (M)':>24} {'seconds':>8}")
        for name, over, secs in rows:
            print(f"{name:<22} {over:>24.2f} {secs:>8.2f}")
        print(f"{'round peak':<22} {max(r[1] for r in rows):>24.2f}")
        return 0 if matched else 1


if __name__ == "__main__":
    sys.exit(main())
