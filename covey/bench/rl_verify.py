"""RL verification bench: false rejections, cheats caught, what checking costs.

`python -m covey.bench.rl_verify [--quick]` (and `covey bench rl`, which calls `run`):

* honest: batches generated on 1 and 2 torch threads, one sequence at a time and 4 or 8 at
  once, checked by `check_batch` on 1 and 2 threads with prefill batches of 1, 4 and 8, for
  an fp32 run and a bf16 run. Rows count rollouts and false rejections and keep the worst
  honest measurement (proof overlap and fp16-ulp error, sampling gap, logprob error): the
  numbers the tolerances in `covey.rl.batch.TOLERANCES` are calibrated from.
* cheats: every kind in `covey.rl.cheats.CHEATS`, `tries` times each (other step, worker
  and seed per try), checked as a validator checks: cheap checks on every sample, prefill
  checks on `verify_k` samples drawn by `verified_subset` from the batch digest and a beacon.
  Rows count tries and catches, the problems named, and the cheat's closest measurement.
* sweep: weights perturbed by 1e-5 ... 1e-3 relative: where "other weights" stop being
  told apart (informative; not one of `CHEATS`).
* cost: validator time per batch (all checks, `verify_k` prefills) as a share of the
  worker's generation time, per verified vs generated token; proof bytes per 32 tokens;
  rollouts/s per worker for each generation batch size.

The policy is a random-init covey GPT of `covey.rl.sft.RL_POLICY`'s shape (a trained one
has peakier logits, which only widens honest sampling gaps' margin); prompts are the
arithmetic task's. Everything runs in one process on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from covey.models.gpt import GPT, GPTConfig
from covey.rl import proofs
from covey.rl.batch import (
    TOLERANCES,
    RolloutBatch,
    RolloutSpec,
    SampleStats,
    batch_digest,
    check_batch,
    measure_samples,
    rollout,
    verified_subset,
)
from covey.rl.cheats import CHEATS, Setting, perturbed_weights
from covey.rl.tasks import ArithmeticTask

BENCH_POLICY = GPTConfig(block_size=48, vocab_size=256, n_layer=3, n_head=4, n_embd=96)
CID = "bench-policy"
VERIFY_K = 2  # prefilled samples per batch of 8, as RLSpec.verify_samples defaults


Progress = Callable[[str, dict[str, Any]], None]  # (message, the row just measured)
SECTIONS = ("honest", "bf16", "cheats", "sweep", "cost")


def _print(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_spec(precision: str = "fp32", max_new_tokens: int = 12) -> RolloutSpec:
    return RolloutSpec(
        run_id="bench-rl",
        prompts_per_step=2,
        group_size=4,
        temperature=1.0,
        max_new_tokens=max_new_tokens,
        vocab_size=256,
        eos_id=10,
        precision=precision,
    )


def bench_policy(seed: int = 0, precision: str = "fp32") -> nn.Module:
    torch.manual_seed(seed)
    model = GPT(BENCH_POLICY).eval()
    return model.to(torch.bfloat16) if precision == "bf16" else model


class _Worst:
    """The honest measurements furthest from 'identical' over many samples."""

    def __init__(self) -> None:
        self.overlap, self.ulp, self.gap, self.lp = 1.0, 0.0, 0.0, 0.0

    def add(self, s: SampleStats) -> None:
        self.overlap = min(self.overlap, s.overlap)
        self.ulp, self.gap = max(self.ulp, s.mean_ulp), max(self.gap, s.gap)
        self.lp = max(self.lp, s.logprob_err)

    def row(self) -> dict[str, float]:
        return {
            "min_overlap": self.overlap,
            "max_mean_ulp": self.ulp,
            "max_gap": self.gap,
            "max_logprob_err": self.lp,
        }


def _threads(n: int) -> None:
    torch.set_num_threads(n)


def honest_rows(
    precision: str, batches: tuple[int, int], progress: Progress
) -> list[dict[str, Any]]:
    """Generate honest batches per (gen threads, gen batch) -- `batches[0]` per condition on
    1 thread, `batches[1]` on 2 (slower on a shared 2-core machine) -- and check each on
    both thread counts with a prefill batch that cycles 1, 4, 8."""
    model, spec, task = bench_policy(0, precision), bench_spec(precision), ArithmeticTask()
    gen_batches = (1, 4, 8) if precision == "fp32" else (1, 4)
    rows = []
    for gen_threads in (1, 2):
        for gen_batch in gen_batches:
            worst, rollouts, rejected, problems = _Worst(), 0, 0, Counter()
            t_gen = 0.0
            for b in range(batches[gen_threads - 1]):
                _threads(gen_threads)
                t0 = time.perf_counter()
                batch = rollout(
                    model,
                    task,
                    spec,
                    step=b,
                    worker_id=f"w{gen_threads}{gen_batch}",
                    policy_version=0,
                    policy_cid=CID,
                    gen_batch=gen_batch,
                )
                t_gen += time.perf_counter() - t0
                for v_threads in (1, 2):
                    _threads(v_threads)
                    pb = (1, 4, 8)[(b + v_threads) % 3]
                    verdict = check_batch(
                        batch,
                        spec=spec,
                        submitter=batch.worker_id,
                        step=b,
                        policy_cid=CID,
                        model=model,
                        task=task,
                        prefill_batch=pb,
                    )
                    stats = measure_samples(
                        batch,
                        list(range(len(batch.samples))),
                        spec=spec,
                        model=model,
                        task=task,
                        prefill_batch=pb,
                    )
                    for s in stats.values():
                        worst.add(s)
                    if not verdict.ok:
                        rejected += 1
                        problems[verdict.problem.value if verdict.problem else "?"] += 1
                rollouts += len(batch.samples)
            rows.append(
                {
                    "section": "honest",
                    "precision": precision,
                    "gen_threads": gen_threads,
                    "gen_batch": gen_batch,
                    "verify_threads": "1,2",
                    "prefill_batch": "1,4,8",
                    "rollouts": rollouts,
                    "checks": 2 * batches[gen_threads - 1],
                    "rejected": rejected,
                    "problems": dict(problems),
                    "rollouts_per_s": rollouts / t_gen,
                    **worst.row(),
                }
            )
            progress(
                f"honest {precision} gen {gen_threads} thr batch {gen_batch}: "
                f"{rollouts} rollouts, {rejected} rejected",
                rows[-1],
            )
    return rows


def _validate(
    task: ArithmeticTask,
    batch: RolloutBatch,
    submitter: str,
    step: int,
    model: nn.Module,
    spec: RolloutSpec,
    beacon: str,
) -> tuple[Any, list[int]]:
    n = len(batch.samples)
    subset = verified_subset(batch_digest(batch), beacon, n, VERIFY_K)
    verdict = check_batch(
        batch,
        spec=spec,
        submitter=submitter,
        step=step,
        policy_cid=CID,
        model=model,
        task=task,
        verify_samples=subset,
    )
    return verdict, subset


def cheat_rows(tries: int, progress: Progress) -> list[dict[str, Any]]:
    """Every cheat kind `tries` times, checked with a beacon-drawn prefill subset."""
    _threads(1)
    model, spec, task = bench_policy(), bench_spec(), ArithmeticTask()
    rows = []
    for kind, cheat in CHEATS.items():
        caught, problems = 0, Counter()
        closest: dict[str, float] = {}
        for t in range(tries):
            step, worker = 1000 + t, f"cheat-{kind}-{t}"
            batch = cheat(Setting(model, task, spec, step, worker, 0, CID), t)
            verdict, subset = _validate(task, batch, worker, step, model, spec, f"beacon-{t}")
            caught += not verdict.ok
            problems[verdict.problem.value if verdict.problem else "accepted"] += 1
            if verdict.problem and verdict.problem.value in ("proof", "sampling", "logprobs"):
                stats = list(
                    measure_samples(batch, subset, spec=spec, model=model, task=task).values()
                )
                for name in ("mean_ulp", "gap", "logprob_err"):  # this try's strongest signal
                    strongest = max(getattr(s, name) for s in stats)
                    closest[name] = min(closest.get(name, math.inf), strongest)
        row = {
            "section": "cheat",
            "cheat": kind,
            "tries": tries,
            "caught": caught,
            "problems": dict(problems),
        }
        row.update({f"closest_{k}": v for k, v in closest.items()})
        rows.append(row)
        progress(f"cheat {kind}: caught {caught}/{tries} {dict(problems)}", row)
    return rows


def sweep_rows(tries: int, progress: Progress) -> list[dict[str, Any]]:
    """Weights perturbed by rel in 1e-5..1e-3: the share of batches rejected."""
    _threads(1)
    model, spec, task = bench_policy(), bench_spec(), ArithmeticTask()
    rows = []
    for rel in (1e-5, 3e-5, 1e-4, 3e-4, 1e-3):
        caught, ulps = 0, []
        for t in range(tries):
            step, worker = 2000 + t, f"sweep-{t}"
            batch = rollout(
                perturbed_weights(model, rel, t),
                task,
                spec,
                step=step,
                worker_id=worker,
                policy_version=0,
                policy_cid=CID,
            )
            verdict, subset = _validate(task, batch, worker, step, model, spec, f"beacon-{t}")
            caught += not verdict.ok
            stats = measure_samples(batch, subset, spec=spec, model=model, task=task)
            ulps += [s.mean_ulp for s in stats.values()]
        rows.append(
            {
                "section": "sweep",
                "perturbation_rel": rel,
                "tries": tries,
                "caught": caught,
                "median_mean_ulp": sorted(ulps)[len(ulps) // 2],
            }
        )
        progress(f"sweep rel {rel:g}: caught {caught}/{tries}", rows[-1])
    return rows


def cost_rows(batches: int, progress: Progress) -> list[dict[str, Any]]:
    """Worker generation vs validator checking (1 thread each), per batch and per token."""
    _threads(1)
    model, spec, task = bench_policy(), bench_spec(), ArithmeticTask()
    rows = []
    for gen_batch in (1, 8):
        t_gen = t_check = 0.0
        gen_tokens = verified_tokens = proof_bytes = rollouts = 0
        for b in range(batches):
            t0 = time.perf_counter()
            batch = rollout(
                model,
                task,
                spec,
                step=3000 + b,
                worker_id="cost",
                policy_version=0,
                policy_cid=CID,
                gen_batch=gen_batch,
            )
            t1 = time.perf_counter()
            verdict, subset = _validate(task, batch, "cost", 3000 + b, model, spec, f"beacon-{b}")
            t2 = time.perf_counter()
            if not verdict.ok:
                raise AssertionError(f"honest cost batch rejected: {verdict}")
            t_gen, t_check = t_gen + t1 - t0, t_check + t2 - t1
            gen_tokens += sum(len(s.tokens) for s in batch.samples)
            verified_tokens += sum(len(batch.samples[i].tokens) for i in subset)
            proof_bytes += sum(len(s.proof_bytes()) for s in batch.samples)
            rollouts += len(batch.samples)
        rows.append(
            {
                "section": "cost",
                "gen_batch": gen_batch,
                "batches": batches,
                "verify_rate": VERIFY_K / (spec.prompts_per_step * spec.group_size),
                "validator_share": t_check / t_gen,
                "validator_per_verified_token_share": (t_check / verified_tokens)
                / (t_gen / gen_tokens),
                "proof_bytes_per_32_tokens": 32 * proof_bytes / gen_tokens,
                "proof_bytes_per_full_chunk": proofs.proof_size(proofs.CHUNK, BENCH_POLICY.n_embd),
                "rollouts_per_s": rollouts / t_gen,
                "tokens_per_sample": gen_tokens / rollouts,
            }
        )
        progress(
            f"cost gen batch {gen_batch}: validator {100 * t_check / t_gen:.1f}% of "
            f"generation, {rollouts / t_gen:.1f} rollouts/s",
            rows[-1],
        )
    return rows


def run(
    quick: bool = False,
    *,
    honest_batches: int | None = None,
    tries: int | None = None,
    sections: tuple[str, ...] = SECTIONS,
    progress: Callable[[str], None] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """All sections' rows. `quick`: a few batches and tries each (seconds to a minute);
    otherwise 1008 honest fp32 rollouts (batches of 8: 30 per condition on 1 thread, 12 on
    2; generation batch 1, 4, 8), 256 bf16 ones and 50 tries per cheat. Restores torch's
    thread count. `sections` picks a subset of SECTIONS; `progress(message)` hears a line
    per row as it is measured (default: stderr), `on_row(row)` the row itself."""
    if unknown := set(sections) - set(SECTIONS):
        raise ValueError(f"unknown sections {sorted(unknown)}, expected some of {SECTIONS}")

    def say(msg: str, row: dict[str, Any]) -> None:
        (progress or _print)(msg)
        if on_row is not None:
            on_row(row)

    per = (honest_batches, honest_batches) if honest_batches else ((2, 1) if quick else (30, 12))
    n_tries = tries or (3 if quick else 50)
    before = torch.get_num_threads()
    try:
        rows: list[dict[str, Any]] = []
        if "honest" in sections:
            rows += honest_rows("fp32", per, say)
        if "bf16" in sections:
            rows += honest_rows("bf16", (1, 1) if quick else (12, 4), say)
        if "cheats" in sections:
            rows += cheat_rows(n_tries, say)
        if "sweep" in sections:
            rows += sweep_rows(2 if quick else 10, say)
        if "cost" in sections:
            rows += cost_rows(2 if quick else 10, say)
    finally:
        torch.set_num_threads(before)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers (false rejections, cheats caught, checking cost) from `run`'s
    rows."""
    honest = [r for r in rows if r["section"] == "honest"]
    cheats = [r for r in rows if r["section"] == "cheat"]
    cost = [r for r in rows if r["section"] == "cost"]
    return {
        "honest_rollouts": sum(r["rollouts"] for r in honest),
        "honest_rejected": sum(r["rejected"] for r in honest),
        "cheat_kinds": len(cheats),
        "cheats_missed": sum(r["tries"] - r["caught"] for r in cheats),
        "min_tries": min((r["tries"] for r in cheats), default=0),
        "validator_share": max((r["validator_share"] for r in cost), default=math.nan),
        "proof_bytes_per_full_chunk": proofs.proof_size(proofs.CHUNK, BENCH_POLICY.n_embd),
        "tolerances": {
            k: {
                "min_overlap": v.proof.min_overlap,
                "max_mean_ulp": v.proof.max_mean_ulp,
                "sampling_gap": v.sampling_gap,
                "logprob": v.logprob,
            }
            for k, v in TOLERANCES.items()
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m covey.bench.rl_verify",
        description="RL verification: honest false rejections, cheats caught, validator cost.",
    )
    parser.add_argument("--quick", action="store_true", help="a few batches/tries (~1 min)")
    parser.add_argument(
        "--honest-batches",
        type=int,
        default=None,
        help="honest fp32 batches of 8 per condition (6 conditions)",
    )
    parser.add_argument("--tries", type=int, default=None, help="tries per cheat kind")
    parser.add_argument("--out", default=None, help="write rows + summary as JSON here")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--jsonl", default=None, help="append each row to this file as soon as it is measured"
    )
    args = parser.parse_args(argv)
    sections = tuple(x for x in args.sections.split(",") if x)
    if not sections or set(sections) - set(SECTIONS):
        parser.error(f"--sections {args.sections!r}: pick from {','.join(SECTIONS)}")

    def on_row(row: dict[str, Any]) -> None:
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")

    for name in ("honest_batches", "tries"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    rows = run(
        args.quick,
        honest_batches=args.honest_batches,
        tries=args.tries,
        sections=sections,
        on_row=on_row,
    )
    doc = {"rows": rows, "summary": summary(rows)}
    text = json.dumps(doc, indent=2, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
