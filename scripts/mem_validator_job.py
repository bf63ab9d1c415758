"""Peak memory of a real validator's job, phase by phase (docs/memory.md).

Runs `covey.peer.validator.Validator.check` in this process on the demo's DiLoCo spec
(`demo_spec`: H = 2, fp32 payloads, inner state reset, outer momentum 0.5) with a GPT-2
shaped Hugging Face model of about --mparams million parameters: the start state and the
payload are fetched by its own `BlobClient` over HTTP from a blob server in a child
process (on 127.0.0.1; the server's memory is not this process's), the claim is the same
round's honest re-execution (a dry run before the measurement), and the report is kept
instead of posted. Two jobs run back to back, rounds 1 and 2 (each start carries the outer
momentum; the second fetches a new start while whatever the first left is held).
`--inner-state keep` also fetches the worker's previous end state and its claimed end
state (the local-state chain). `--inexact` perturbs the claimed payload within the tolerance, so the
comparison decodes both payloads (an honest worker on other hardware).

Each phase's peak is the kernel's VmHWM from the end of the previous phase to its own
end, above the process with the model built and no state, in model sizes (M = the fp32
parameter bytes). A phase ends when the call named returns.

    .venv/bin/python scripts/mem_validator_job.py --mparams 30 [--json]

Linux only (reads /proc/self/status). Exit 2 with `error: ...` on bad input; 1 when a
verdict is not an agreement.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from mem_coordinator import VOCAB, gpt2_dir  # this folder: python puts it on sys.path

from covey.algorithms import build_aggregator, build_strategy
from covey.algorithms.diloco import outer_step
from covey.blobs import BlobClient, BlobStore
from covey.config import RunConfig
from covey.local.demo import demo_spec
from covey.memory import bound_heap, reset_peak, rss_mib, shapes_only
from covey.models.source import build_run_model
from covey.peer.validator import Validator, ValidatorOptions
from covey.protocol import schemas
from covey.protocol.checkpoint import state_to_file
from covey.trust import verify
from covey.trust.evidence import evidence_of

SERVE = (
    "import sys; from pathlib import Path; from covey.blobs import BlobStore; "
    "from covey.blobs.server import BlobServer; "
    "s = BlobServer(BlobStore(Path(sys.argv[1]))); print(s.start(), flush=True); "
    "sys.stdin.read()"
)


def _batches(round_: int) -> Callable[[int], torch.Tensor]:
    def batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * round_ + step)
        return torch.randint(0, VOCAB, (2, 65), generator=g)

    return batch


class Phases:
    """Peaks above `base` MiB, in M, each from the previous mark to its own."""

    def __init__(self, base: float, mib: float) -> None:
        self.base, self.mib = base, mib
        self.rows: dict[str, float] = {}
        self.prefix = ""

    def mark(self, name: str) -> None:
        key = f"{self.prefix}{name}"
        peak = (rss_mib()["VmHWM"] - self.base) / self.mib
        self.rows[key] = max(peak, self.rows.get(key, -1e9))
        reset_peak()

    def held(self, name: str) -> float:
        gc.collect()
        held = (rss_mib()["VmRSS"] - self.base) / self.mib
        self.rows[name] = held
        reset_peak()
        return held

    def after(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self.mark(name)
            return out

        return wrapped


class Reports:
    """Stands in for the coordinator client: keeps what the validator reports."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def post(self, path: str, body: dict[str, Any], round: int | None = None) -> dict:
        self.bodies.append(body)
        return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mparams", type=float, default=30.0, help="model size, millions")
    ap.add_argument("--inner-state", choices=("reset", "keep"), default="reset")
    ap.add_argument("--inexact", action="store_true", help="a claim within the tolerance")
    ap.add_argument("--json", action="store_true", help="print a JSON line last")
    args = ap.parse_args(argv)
    if args.mparams <= 0:
        print("error: --mparams must be > 0", file=sys.stderr)
        return 2
    bound_heap()  # as Validator._setup does
    torch.set_num_threads(1)  # the demo's validator: --threads 1
    work = Path(tempfile.mkdtemp(prefix="covey-mem-validator-"))
    spec = demo_spec(
        "diloco", model=f"hf:{gpt2_dir(args.mparams, work / 'model')}", workers=2,
        inner_steps=2, batch_size=2, seq_len=64,
    )  # fmt: skip
    spec["algorithm"]["inner_state"] = args.inner_state
    cfg = RunConfig.model_validate(spec)
    model, loss, _, _ = build_run_model(cfg.model, 0, tokenizer_vocab=VOCAB, seq_len=64)
    trust = cfg.trust
    aggregator = build_aggregator(trust.aggregation, trust.trim_fraction, trust.clip_factor)
    strategy = build_strategy(cfg.algorithm, model, loss, aggregator)
    numel = sum(p.numel() for p in model.parameters())
    mib = numel * 4 / 2**20
    store = BlobStore(work / "served")
    steps, k = cfg.algorithm.inner_steps, trust.commit_every

    def put_file(write: Callable[[Path], Any]) -> tuple[str, int]:
        tmp = store.scratch()
        write(tmp)
        return store.adopt(tmp)

    # the canonical states of rounds 1 and 2 (outer momentum), and the honest claims
    states = [strategy.init_state()]
    for r in (1, 2):
        g = torch.Generator().manual_seed(r)
        grads = {n: torch.randn(t.shape, generator=g) * 1e-3 for n, t in states[-1].params.items()}
        states.append(outer_step(states[-1], grads, cfg.algorithm))
        del grads
    tasks, previous_end, prev_ref = [], None, (None, None)
    for r in (0, 1, 2):
        start = states[r]
        mine = verify.reexecute(strategy, start, _batches(r), steps, k, (), previous_end)
        end = strategy.local_state()
        published = evidence_of(strategy, end)  # what a worker publishes of it
        end_ref = put_file(lambda p, e=published: p.write_bytes(verify.local_state_to_bytes(e)))
        if r > 0:
            payload = mine.payload
            if args.inexact:
                v = strategy.codec.decode(payload, numel)
                payload = strategy.codec.encode(v * (1 + 1e-6))
                del v
            cid, size = put_file(lambda p, b=payload: p.write_bytes(b))
            start_cid, start_size = put_file(lambda p, s=start: state_to_file(s, p))
            keep = args.inner_state == "keep"
            tasks.append(schemas.VerifyTask(
                task_id=r, round=r, peer_id="p" * 64, cid=cid, size=size, tokens=128,
                inner_steps=steps, fragment=None, data_key="k", start_cid=start_cid,
                start_hash=start.digest(), start_size=start_size,
                commitments=[c.to_dict() for c in mine.commitments], providers=[],
                local_state_cid=prev_ref[0] if keep else None,
                local_state_size=prev_ref[1] if keep else None,
                end_state_cid=end_ref[0] if keep else None,
                end_state_size=end_ref[1] if keep else None,
            ))  # fmt: skip
            del payload
        previous_end = end if args.inner_state == "keep" else None
        prev_ref = end_ref
        del mine, end
    del states, previous_end, start
    strategy.free_round_memory(optimizer=True)  # the dry runs' moments and gradients
    strategy._start = strategy._start_params = None  # and their last start weights

    server = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(store.root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = server.stdout.readline().strip()  # type: ignore[union-attr]
        v = Validator.__new__(Validator)  # what _setup gives it, minus the coordinator
        v.opts = ValidatorOptions(coordinator=url)
        v.name, v.validator_id = "mem", "v" * 64
        v.cfg, v.strategy, v.run_id = cfg, strategy, "r"
        v.template = shapes_only(strategy.init_state())
        v.blobs = BlobClient(
            timeout_s=cfg.limits.request_timeout_s, retries=cfg.limits.retries,
            chunk_bytes=cfg.limits.chunk_bytes, max_bytes=cfg.limits.max_blob_bytes,
        )  # fmt: skip
        v.client, v._state, v.done, v.compute_s = Reports(), None, 0, 0.0
        v.stop, v._reexecuting = threading.Event(), None
        v._keep_head = lambda where: None  # type: ignore[method-assign]  # no ledger here
        v._batch_fn = lambda task: _batches(task.round)  # type: ignore[method-assign]
        gc.collect()
        phases = Phases(rss_mib()["VmRSS"], mib)
        # each phase ends when its call returns (the validator's own calls, wrapped)
        v._start_state = phases.after("fetch the start state", v._start_state)
        v._local_states = phases.after("fetch the payload and local states", v._local_states)
        strategy.begin_round = phases.after("begin_round", strategy.begin_round)
        strategy.inner_step = phases.after("inner steps", strategy.inner_step)
        strategy.make_contribution = phases.after("encode", strategy.make_contribution)
        reexecute, compare = verify.reexecute, verify.compare
        verify.reexecute = phases.after("end commitment", reexecute)  # type: ignore[assignment]
        verify.compare = phases.after("compare", compare)  # type: ignore[assignment]
        v.client.post = phases.after("report", v.client.post)  # type: ignore[method-assign]
        reset_peak()
        for task in tasks:
            phases.prefix = f"job {task.round}: "
            v.check(task)
            phases.mark("after the report")
            phases.prefix = ""
            phases.held(f"held after job {task.round}")
        verify.reexecute, verify.compare = reexecute, compare
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    verdicts = [
        {k: b[k] for k in ("round", "outcome", "exact", "distance")} for b in v.client.bodies
    ]
    jobs = {k: x for k, x in phases.rows.items() if k.startswith("job ")}
    print(f"model {numel / 1e6:.1f}M parameters, M = {mib:.0f} MiB; inner_state "
          f"{args.inner_state}{', inexact claim' if args.inexact else ''}")  # fmt: skip
    for name, over in phases.rows.items():
        print(f"{name:<52} {over:>6.2f}")
    for verdict in verdicts:
        print(f"verdict: {verdict}")
    agreed = len(verdicts) == len(tasks) and all(x["outcome"] == "agree" for x in verdicts)
    if args.json:
        print(json.dumps({
            "mib": mib, "phases": phases.rows, "job_peak": max(jobs.values()),
            "verdicts": verdicts, "agreed": agreed,
        }))  # fmt: skip
    return 0 if agreed else 1


if __name__ == "__main__":
    sys.exit(main())
