"""`covey bench comms`: bytes sent against loss reached, every method on the same tokens.

Every method trains the reference GPT on the stdlib corpus with the same workers, batch
size and inner steps per worker, so the total tokens are equal; only what crosses the
network differs. Simulated time assumes 100 Mbit/s links.

Presets:
- --quick: 480 steps from scratch (CPU, ~6-10 min): every DiLoCo variant ends 17-22% behind
  DDP, too short for DiLoCo's claim.
- --long: the regime the DiLoCo paper reports (arXiv 2311.08105 warm-starts from a
  pretrained model): a shared DDP warm-up, then every method for the same
  tokens from it (data.round_offset past the warm-up's batches), judged on the mean of the
  last evaluations over a 4x larger validation set; a warmup + cosine variant; DDP and the
  headline DiLoCo again on a second data seed.
- default: the mini GPT for 3000 steps, meant for a GPU.

With --resume a method whose summary in the output folder is of the same config is kept,
and a method cut off mid-run goes on from its last snapshot (covey.sim.resume).

With jobs > 1 the methods after the warm-up run side by side, one process each (every
method is one torch thread, so a 2-core machine runs two), the longest first; each run is
the same computation as alone, so its numbers are the same bytes.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from covey.bench.comms_report import MethodRun, format_table, summarize
from covey.config import SimConfig
from covey.data.corpus import Corpus, load_corpus
from covey.sim.report import plot_runs, save_run, write_json


@dataclass(frozen=True)
class BenchMethod:
    name: str
    algorithm: dict[str, Any]
    seed: int = 0
    baseline: str = "ddp"  # the DDP run this one is judged against


@dataclass(frozen=True)
class BenchSize:
    model: str
    steps: int  # inner steps per worker
    batch_size: int
    h_short: int
    h_long: int
    workers: int = 8
    outer_lr: float = 0.7
    # The papers' 0.9 pays off over many rounds; a quick run has 4-16 rounds, where 0.5 was
    # best of {0, 0.5, 0.9} (BENCHMARKS.md). After a warm start 0.9 wins.
    outer_momentum: float = 0.5
    pretrain_steps: int = 0  # > 0: a shared DDP warm-up, every method continues from it
    eval_batches: int = 16  # held-out batches of 16 sequences
    evals: int = 24  # evaluations per run
    tail: int = 1  # judged on the mean of the last `tail` evaluations
    seeds: tuple[int, ...] = (0,)  # data seeds; the first runs every method
    # One torch thread: the nano GPT gains little from a second, and on a shared 2-core
    # machine two threads per process ran 25x slower than one (0.62 vs 14.9 s per DDP step).
    threads: int | None = 1


QUICK = BenchSize(model="nano", steps=480, batch_size=8, h_short=30, h_long=120)
FULL = BenchSize(model="mini", steps=3000, batch_size=16, h_short=50, h_long=250)
LONG = BenchSize(
    model="nano",
    steps=2000,
    batch_size=8,
    h_short=100,
    h_long=100,
    outer_momentum=0.9,
    pretrain_steps=1000,
    eval_batches=64,
    evals=20,
    tail=5,
    seeds=(0, 1),
)


def preset(quick: bool = False, long: bool = False, **overrides: Any) -> BenchSize:
    """The preset the flags name, with the overrides that are not None. ValueError for
    --quick with --long."""
    if quick and long:
        raise ValueError("--quick and --long are two presets: choose one")
    size = LONG if long else QUICK if quick else FULL
    given = {k: v for k, v in overrides.items() if v is not None}
    for flag, low in (("workers", 1), ("batch_size", 1), ("inner_steps", 1), ("steps", 1)):
        if flag in given and given[flag] < low:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {low}, got {given[flag]}")
    if "pretrain_steps" in given and given["pretrain_steps"] < 0:
        raise ValueError(f"--pretrain-steps must be >= 0, got {given['pretrain_steps']}")
    if "outer_lr" in given and given["outer_lr"] <= 0:
        raise ValueError(f"--outer-lr must be positive, got {given['outer_lr']}")
    if "outer_momentum" in given and not 0 <= given["outer_momentum"] < 1:
        raise ValueError(f"--outer-momentum must be in [0, 1), got {given['outer_momentum']}")
    if (h := given.pop("inner_steps", None)) is not None:
        given.update(h_short=h, h_long=h)
    return replace(size, **given)


def _fragments(h: int) -> int:
    """Streaming DiLoCo's P: 4 (the paper's choice here) when it divides H with rounds of
    more than one step, else the largest of 2 and 1 that does."""
    return next(p for p in (4, 2, 1) if (h % p == 0 and h // p > 1) or p == 1)


def comms_methods(size: BenchSize) -> list[BenchMethod]:
    """The methods a preset compares, in order; names are unique (equal H values merge)."""
    hs, hl = size.h_short, size.h_long
    outer = {"outer_lr": size.outer_lr, "outer_momentum": size.outer_momentum}

    def diloco(h: int, **kw: Any) -> dict[str, Any]:
        return {"method": "diloco", "inner_steps": h, **outer, **kw}

    def dct_ef(h: int) -> dict[str, Any]:
        return diloco(h, codec="dct:64:4:int8", error_feedback=True)

    streaming = {**diloco(hl, codec="int4"), "method": "streaming", "fragments": _fragments(hl)}
    int4_ef = diloco(hl, codec="int4", error_feedback=True)
    if size.pretrain_steps:  # --long: the regime after a warm start
        cosine = {"schedule": "cosine", "warmup_steps": size.steps // 20, "decay_steps": size.steps}
        methods = [
            BenchMethod("ddp", {"method": "ddp"}),
            BenchMethod(f"diloco-h{hl}-int4-ef", int4_ef),
            # the inner AdamW reset every round: its moments are then no private state a
            # drawn contribution's validators must fetch (only the residual is)
            BenchMethod(f"diloco-h{hl}-int4-ef-reset", {**int4_ef, "inner_state": "reset"}),
            # no private state at all (inner optimizer reset, no error feedback): a drawn
            # contribution's validators need nothing but public bytes
            BenchMethod(f"diloco-h{hl}-int4-reset", diloco(hl, codec="int4", inner_state="reset")),
            BenchMethod(f"diloco-h{hl}", diloco(hl)),
            BenchMethod(f"diloco-h{hl}-dct-ef", dct_ef(hl)),
            BenchMethod(f"streaming-h{hl}-int4", streaming),
            BenchMethod("demo-1d", {"method": "demo"}),
            BenchMethod("demo-2d", {"method": "demo", "dims": 2}),
            BenchMethod("ddp-cosine", {"method": "ddp", "optim": cosine}, baseline="ddp-cosine"),
            BenchMethod(
                f"diloco-h{hl}-int4-ef-cosine", {**int4_ef, "optim": cosine}, baseline="ddp-cosine"
            ),
            # the configuration with no private state (no verification evidence), on the
            # same schedule as its DDP baseline
            BenchMethod(
                f"diloco-h{hl}-int4-reset-cosine",
                {**diloco(hl, codec="int4", inner_state="reset"), "optim": cosine},
                baseline="ddp-cosine",
            ),
        ]
        for seed in size.seeds[1:]:
            ddp_s = f"ddp-seed{seed}"
            methods += [
                BenchMethod(ddp_s, {"method": "ddp"}, seed=seed, baseline=ddp_s),
                BenchMethod(f"diloco-h{hl}-int4-ef-seed{seed}", int4_ef, seed=seed, baseline=ddp_s),
            ]
    else:
        methods = [
            BenchMethod("ddp", {"method": "ddp"}),
            BenchMethod(f"diloco-h{hs}", diloco(hs)),
            BenchMethod(f"diloco-h{hl}", diloco(hl)),
            BenchMethod(f"diloco-h{hs}-int8", diloco(hs, codec="int8")),
            BenchMethod(f"streaming-h{hl}-int4", streaming),
            BenchMethod("demo-1d", {"method": "demo"}),  # 64-wide 1-D chunks
            BenchMethod("demo-2d", {"method": "demo", "dims": 2}),  # DeMo's own 64x64 blocks
            # covey's combination: DiLoCo pseudo-gradients, DCT top-k with error feedback.
            BenchMethod(f"diloco-h{hs}-dct-ef", dct_ef(hs)),
            BenchMethod(f"diloco-h{hl}-int4-ef", int4_ef),
        ]
    unique: dict[str, BenchMethod] = {}
    for m in methods:
        unique.setdefault(m.name, m)
    return list(unique.values())


def bench_config(
    method: BenchMethod,
    size: BenchSize,
    workers: int | None = None,
    init: str | None = None,
    round_offset: int = 0,
) -> SimConfig:
    """The simulator config of one method at one size (init: a warm start's checkpoint)."""
    model: dict[str, Any] = {"size": size.model}
    data: dict[str, Any] = {"batch_size": size.batch_size}
    if init is not None:
        model["init"] = init
        data["round_offset"] = round_offset
    cfg = SimConfig.model_validate(
        {
            "seed": method.seed,
            "workers": workers or size.workers,
            "steps": size.steps,
            "eval_batches": size.eval_batches,
            "threads": size.threads,
            "model": model,
            "data": data,
            "algorithm": method.algorithm,
            "network": {"uplink_mbps": 100.0, "downlink_mbps": 100.0, "latency_ms": 50.0},
        }
    )
    return cfg.model_copy(update={"eval_every": max(1, cfg.rounds // size.evals)})


def pretrain_config(size: BenchSize) -> SimConfig:
    """The shared DDP warm-up of a preset with pretrain_steps > 0 (--long): every method
    continues from its final weights, with data.round_offset = its rounds."""
    warm = replace(size, steps=size.pretrain_steps, eval_batches=16, evals=10)
    return bench_config(BenchMethod("pretrain", {"method": "ddp"}), warm)


def run_sim(
    cfg: SimConfig, corpus: Corpus, out: Path, label: str, resume: bool, progress: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One simulation into `out` -> (records, summary); with `resume`, a finished run of the
    same config is read back and a cut-off one goes on from its snapshot."""
    from covey.io.export import save_sim_run
    from covey.sim.resume import SnapshotError, load_snapshot, save_snapshot
    from covey.sim.simulator import simulate

    h = cfg.config_hash()
    if resume and (out / "summary.json").is_file():
        summary = json.loads((out / "summary.json").read_text())
        if summary.get("config_hash") == h and (out / "metrics.jsonl").is_file():
            lines = (out / "metrics.jsonl").read_text().splitlines()
            print(f"   kept: finished earlier ({out}/summary.json)")
            return [json.loads(line) for line in lines if line], summary
    snapshot = None
    if resume:
        try:
            snapshot = load_snapshot(out / "checkpoint", h)
            print(f"   resuming after round {snapshot.round}")
        except SnapshotError:
            snapshot = None
    every = max(1, cfg.rounds // 10)

    def keep(snap: Any) -> None:
        if snap.round % every == 0 and snap.round < cfg.rounds:
            save_snapshot(out / "checkpoint", snap)

    result = simulate(cfg, corpus, progress=progress, on_snapshot=keep, resume=snapshot)
    save_run(out, label, result.records, result.summary)
    save_sim_run(out, cfg, result.state)  # checkpoints/: a warm start for what follows
    shutil.rmtree(out / "checkpoint", ignore_errors=True)  # finished: the summary is kept
    return result.records, result.summary


# Relative cost of a method per inner step on CPU (DeMo's per-step DCT: demo-1d and demo-2d
# took 1.9x a DiLoCo run's wall time in the --long run of
# docs/bench-comms-long/session8.json, 3.1x and 2.4x before the faster decode): the longest
# go first so the last to start is a short one.
_COST = {"demo": 2.0}


def _run_side_by_side(
    todo: list[BenchMethod],
    configs: dict[str, SimConfig],
    corpus: Corpus,
    out_dir: Path,
    resume: bool,
    jobs: int,
) -> dict[str, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Every method in its own process, `jobs` at a time, longest first -> name ->
    (records, summary). A method that fails stops the bench with its error once the
    running ones finish (the finished ones are on disk for --resume)."""
    order = sorted(todo, key=lambda m: -_COST.get(m.algorithm["method"], 1.0))
    started = time.perf_counter()
    done: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
    # spawn, not fork: a forked child would inherit the parent's torch thread pool state
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        running = {}
        for m in order:
            cfg = configs[m.name]
            args = (cfg, corpus, out_dir / m.name, m.name, resume, False)
            running[pool.submit(run_sim, *args)] = m.name
        print(f"== {len(order)} methods, {jobs} at a time: {', '.join(m.name for m in order)}")
        for future in as_completed(running):
            name = running[future]
            try:
                done[name] = future.result()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # the queued ones never start
                raise
            summary = done[name][1]
            print(
                f"== {name} done ({len(done)}/{len(order)}, {time.perf_counter() - started:.0f}"
                f" s in): final val loss {summary['final_val_loss']:.4f},"
                f" {summary.get('real_time_s', 0.0):.0f} s of its own"
            )
    return done


def run_comms_bench(
    *,
    size: BenchSize,
    out_dir: Path,
    only: list[str] | None = None,
    resume: bool = False,
    progress: bool = True,
    corpus: Corpus | None = None,
    jobs: int = 1,
    sample_rate: float | None = None,
) -> list[dict[str, Any]]:
    """Run the preset's methods (those in `only`, if given) into `out_dir`; print the table
    and write records.json and comms.png. Returns the rows (covey.bench.comms_report).
    `corpus`: default the stdlib corpus. `jobs`: methods run at once after the warm-up.
    `sample_rate`: the rate the evidence is counted at (default: the run's, trust's
    default)."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    corpus = corpus or load_corpus()
    print(f"corpus: {corpus.describe()} (fingerprint {corpus.fingerprint})")
    init, offset = None, 0
    if size.pretrain_steps:
        cfg = pretrain_config(size)
        print(f"== pretrain: DDP for {cfg.rounds} steps per worker (shared warm start)")
        run_sim(cfg, corpus, out_dir / "pretrain", "pretrain", resume, progress)
        init, offset = str(out_dir / "pretrain"), cfg.rounds
    todo = [m for m in comms_methods(size) if not only or m.name in only]
    configs = {m.name: bench_config(m, size, init=init, round_offset=offset) for m in todo}
    done: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
    if jobs > 1 and len(todo) > 1:
        done = _run_side_by_side(todo, configs, corpus, out_dir, resume, jobs)
    else:
        for method in todo:
            cfg = configs[method.name]
            print(f"== {method.name}: {cfg.rounds} rounds of {cfg.steps // cfg.rounds} inner steps")
            done[method.name] = run_sim(
                cfg, corpus, out_dir / method.name, method.name, resume, progress
            )
    runs = {  # the preset's order, whatever order they finished in
        m.name: MethodRun(m.name, m.baseline, m.seed, *done[m.name]) for m in todo
    }
    rows = summarize(runs, size.tail)
    count_evidence(rows, size, corpus, init, offset, sample_rate=sample_rate)
    print(format_table(rows))
    if size.tail > 1:
        print(f"(val loss: the mean of the last {size.tail} evaluations of each run)")
    start = f", from a {size.pretrain_steps}-step DDP warm start" if size.pretrain_steps else ""
    plot_runs(
        out_dir / "comms.png",
        {name: run.records for name, run in runs.items()},
        f"covey bench comms ({size.model}, {size.workers} workers, {size.steps} steps/worker"
        f"{start}, 100 Mbit/s)",
    )
    write_json(out_dir / "records.json", rows)
    print(f"wrote {out_dir}/records.json and {out_dir}/comms.png")
    return rows


def count_evidence(
    rows: list[dict[str, Any]],
    size: BenchSize,
    corpus: Corpus,
    init: str | None = None,
    offset: int = 0,
    *,
    sample_rate: float | None = None,
) -> None:
    """Add the verification evidence each row's worker sends at the run's default sampling
    rate (`sample_rate`, when given, instead: a run that lowers it with a higher stake,
    docs/trust.md), and the reduction against DDP with it (covey.bench.comms_evidence), in
    place. Rows of methods the preset does not name (an older run's) get none."""
    from covey.bench.comms_evidence import (
        add_evidence,
        add_multiplier,
        checked_share,
        evidence_per_worker,
        evidence_state_bytes,
    )

    methods = {m.name: m for m in comms_methods(size)}
    evidence: dict[str, float] = {}
    state_bytes: dict[str, int] = {}
    rate, uplink = 0.0, 100.0
    checked: dict[str, float] = {}
    for r in rows:
        method = methods.get(r["method"])
        if method is None:
            continue
        cfg = bench_config(method, size, init=init, round_offset=offset)
        if sample_rate is not None:
            trust = cfg.trust.model_copy(update={"sample_rate": sample_rate})
            cfg = cfg.model_copy(update={"trust": trust})
        rate = cfg.trust.sample_rate
        key = json.dumps(method.algorithm, sort_keys=True)
        if key not in state_bytes:
            state_bytes[key] = evidence_state_bytes(cfg, corpus.vocab_size)
        evidence[r["method"]] = evidence_per_worker(cfg, r["rounds"], state_bytes[key])
        checked[r["method"]] = checked_share(cfg, r["rounds"])
        uplink = cfg.network.uplink_mbps
    add_evidence(rows, evidence, rate)
    add_multiplier(rows, checked, uplink)


def recount_rows(
    path: Path, size: BenchSize, sample_rate: float | None = None
) -> list[dict[str, Any]]:
    """An earlier run's rows (its records.json) with the evidence counted (at
    `sample_rate`, default the run's): nothing is trained (the bytes of a method's evidence
    follow from its config and rounds)."""
    rows = json.loads(path.read_text())
    count_evidence(rows, size, load_corpus(), sample_rate=sample_rate)
    print(format_table(rows))
    return rows


def run_demo(*, workers: int, steps: int, out_dir: Path) -> None:
    """DDP, DiLoCo and DiLoCo + DCT top-k side by side on the nano GPT."""
    from covey.sim.simulator import simulate

    demo_size = replace(QUICK, steps=steps, workers=workers)
    picks = {"ddp", f"diloco-h{demo_size.h_short}", f"diloco-h{demo_size.h_short}-dct-ef"}
    corpus = load_corpus()
    print(f"corpus: {corpus.describe()}")
    runs = {}
    for method in comms_methods(demo_size):
        if method.name not in picks:
            continue
        cfg = bench_config(method, demo_size)
        print(f"== {method.name}")
        result = simulate(cfg, corpus)
        save_run(out_dir / method.name, method.name, result.records, result.summary)
        runs[method.name] = MethodRun(method.name, "ddp", 0, result.records, result.summary)
    print(format_table(summarize(runs)))
    plot_runs(out_dir / "demo.png", {n: r.records for n, r in runs.items()}, "covey demo")
    print(f"run directory: {out_dir} (plot: {out_dir / 'demo.png'})")
