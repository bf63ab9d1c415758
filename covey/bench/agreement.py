"""`covey bench agreement`: the simulator and the network agree.

One method of `covey bench comms --long` (default the headline DiLoCo, H = 100, int4 with
error feedback) is trained twice from the same DDP warm start, for the same tokens:

- in the simulator (covey.sim.simulator), as `covey bench comms` runs it: read from a
  `covey bench comms --long --out DIR` directory given with --from, or run here;
- over the network: a coordinator and one `covey worker` process per simulated worker on
  127.0.0.1 (covey.local.cluster), with a run spec made from the simulator's config
  (`network_spec`): the same model, warm start, data.round_offset, algorithm, aggregation
  and seed; max_rounds = the simulator's rounds; every worker doing exactly H inner steps
  every round (a compute target and deadlines far beyond a round's length, so the
  straggler policy never cuts steps; checked afterwards in the coordinator's database).

The network run's canonical states are then evaluated here, from the coordinator's
checkpoints (one per round) and its initial state, with the simulator's own evaluation
(covey.algorithms.evaluate on covey.data.batches.validation_batches with the simulator's
eval_batches, batch size and sequence length, one torch thread), at the simulator's
evaluation points. So both curves are measured on the very same held-out batches, and
the comparison measures training, not a different validation sample. Two checks say so:
the network's round-0 state (the warm start as the coordinator served it) must evaluate to
the simulator's initial_val_loss bit for bit, and the simulator's final checkpoint must
evaluate to its last recorded val_loss bit for bit.

What differs between the two runs, by design of the network protocol: each network
worker's batches are keyed by a data key (a hash of run id, round and peer id;
covey.protocol.rounds.data_key) where the simulator keys them by worker index. Same
corpus, same distribution, same number of tokens; other windows. The contributions also
reach the aggregator in another order (by peer id), which changes only float rounding.
The goal: the mean val loss of the last `tail` evaluations within 1% (GOAL).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import fmean
from typing import Any

import httpx

from covey.bench.agreement_report import (
    agreement_rows,
    eval_points,
    format_table,
    invalid_because,
    plot_agreement,
)
from covey.bench.comms import (
    BenchMethod,
    BenchSize,
    bench_config,
    comms_methods,
    preset,
    pretrain_config,
    run_sim,
)
from covey.bench.comms_report import tail_mean
from covey.config import RunConfig, SimConfig, steps_per_round, to_toml
from covey.data.corpus import Corpus, load_corpus
from covey.sim.report import write_json

# --quick: a toy end-to-end run (2 workers, 2 rounds of 2 steps after a 2-step warm start)
QUICK_FLAGS: dict[str, int] = {
    "steps": 4, "workers": 2, "batch_size": 2, "inner_steps": 2, "pretrain_steps": 2
}  # fmt: skip
STARTUP_TIMEOUT_S = 180.0  # the coordinator serving, then every worker joined (round 0 open)
# A round closes once every member submitted; the deadline only bounds a stuck one. Far
# beyond a round at the --long size on a busy 2-core machine (~30 s), so it never decides.
ROUND_DEADLINE_S = 1800.0
# The straggler policy gives a peer min(H, target / its step time) steps: a day per round
# means every peer does the full H at any step time this bench can see.
TARGET_COMPUTE_S = 86400.0
POLL_S = 0.5  # status poll while the network run trains
PROGRESS_S = 30.0


@dataclass(frozen=True)
class SimSide:
    """The simulator's run of the method: its config, records and summary, its directory
    (holding checkpoints/ with the final state) and the warm start's state file."""

    cfg: SimConfig
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    run_dir: Path
    init_file: Path | None


@dataclass(frozen=True)
class NetworkRun:
    """A finished network run: the coordinator's data dir, its wall time from the first
    worker's start to the run seen finished, the 1-minute load averages from round 0's
    opening on, and per committed round (round, attempt, contributions, min and max
    inner steps)."""

    data_dir: Path
    wall_s: float
    loads: list[float]
    rounds: list[tuple[int, int, int, int, int]]


# ---------------------------------------------------------------- plan (pure functions)


def agreement_size(quick: bool = False, **overrides: Any) -> BenchSize:
    """The --long preset with the flags that are not None (checked as `covey bench comms`
    checks them); --quick: a toy size for tests, on 2 held-out batches, judged on the
    last evaluation. ValueError for a bad flag."""
    given = {k: v for k, v in overrides.items() if v is not None}
    size = preset(long=True, **({**QUICK_FLAGS, **given} if quick else given))
    return replace(size, eval_batches=2, evals=2, tail=1) if quick else size


def pick_method(size: BenchSize, name: str | None) -> BenchMethod:
    """The `covey bench comms` method called `name` at this size (default: DiLoCo at H with
    int4 and error feedback). ValueError naming the choices."""
    name = name or f"diloco-h{size.h_long}-int4-ef"
    methods = {m.name: m for m in comms_methods(size)}
    if name not in methods:
        raise ValueError(f"unknown method {name!r}; choose from {list(methods)}")
    return methods[name]


def network_spec(cfg: SimConfig, *, init_file: Path | None, name: str) -> dict[str, Any]:
    """The run spec (as `covey coordinator` reads it) that trains what `cfg` simulates:
    the same seed, model, data (round_offset included), algorithm, aggregation and peer
    device; the warm start named by its state file; max_rounds = cfg.rounds. Rounds wait
    for every worker and never cut an inner step; validation is out of the picture
    (nothing is drawn for checks, nothing is sharded), and the coordinator checkpoints
    every round, keeping all, for `evaluate_states`."""
    model = cfg.model.model_dump(mode="json")
    model["init"] = None if init_file is None else str(init_file.resolve())
    data = cfg.data.model_dump(mode="json")
    data["paths"] = [str(Path(p).expanduser().resolve()) for p in cfg.data.paths]
    if cfg.data.tokenizer.startswith("hf:"):  # the processes run in their own directory
        data["tokenizer"] = "hf:" + str(Path(cfg.data.tokenizer[3:]).expanduser().resolve())
    t = cfg.trust
    spec = {
        "name": name,
        "seed": cfg.seed,
        "model": model,
        "data": data,
        "algorithm": cfg.algorithm.model_dump(mode="json"),
        "peer": cfg.peer.model_dump(mode="json"),
        "trust": {
            "aggregation": t.aggregation,
            "trim_fraction": t.trim_fraction,
            "clip_factor": t.clip_factor,
            # no validator runs: draw nothing for checks (the coordinator would otherwise
            # fetch end states it never uses) and plant no canaries
            "sample_rate": 0.0,
            "new_peer_rate": 0.0,
            "canary_rate": 0.0,
            "sharded_above_peers": 0,  # the coordinator aggregates, as the simulator does
        },
        "rounds": {
            "min_peers": cfg.workers,  # every simulated worker, from round 0 on
            "max_rounds": cfg.rounds,
            "target_compute_s": TARGET_COMPUTE_S,
            "deadline_min_s": ROUND_DEADLINE_S,
            "deadline_max_s": ROUND_DEADLINE_S,
            # 8 workers and a coordinator on 2 busy cores may miss heartbeats for a while
            # without being gone: a peer declared dead would leave a round short
            "dead_after_s": 60.0,
            "lease_s": 120.0,
            "checkpoint_every": 1,
            "keep_checkpoints": cfg.rounds,
            # the evaluation that counts is `evaluate_states`; the coordinator's own is
            # kept to one small one at the end
            "eval_every": cfg.rounds,
            "eval_batches": 1,
            "samples_every": 0,
        },
    }
    RunConfig.model_validate(spec)  # a bad spec fails here, not in a child process
    return spec


# ---------------------------------------------------------------- the simulator's side


def _comparable(cfg: SimConfig) -> str:
    """cfg's hash with a checkpoint warm start's path resolved: one run named two ways
    (a relative and an absolute --out) is the same run."""
    init = cfg.model.init
    if init is not None and not init.startswith("hf:"):
        init = str(Path(init).expanduser().resolve())
    return cfg.model_copy(
        update={"model": cfg.model.model_copy(update={"init": init})}
    ).config_hash()


def finished_run(run_dir: Path, cfg: SimConfig) -> tuple[list[dict], dict] | None:
    """(records, summary) of a finished simulation of `cfg` in run_dir, else None."""
    summary_path, metrics = run_dir / "summary.json", run_dir / "metrics.jsonl"
    if not (summary_path.is_file() and metrics.is_file()):
        return None
    summary = json.loads(summary_path.read_text())
    if _comparable(SimConfig.model_validate(summary["config"])) != _comparable(cfg):
        return None
    lines = metrics.read_text().splitlines()
    return [json.loads(line) for line in lines if line], summary


def sim_side(
    size: BenchSize,
    method: BenchMethod,
    *,
    out_dir: Path,
    from_dir: Path | None,
    corpus: Corpus,
    progress: bool,
) -> SimSide:
    """The warm start and the method's simulation, as `covey bench comms` makes them:
    taken from `from_dir` (a `covey bench comms --long --out` directory) where they are
    there for this size, else run into `out_dir` (kept there when finished earlier).
    ValueError when from_dir's warm start was made at other settings."""
    from covey.models.warmstart import checkpoint_file

    init: str | None = None
    offset = 0
    if size.pretrain_steps:
        pcfg = pretrain_config(size)
        pre = None if from_dir is None else from_dir / "pretrain"
        if pre is not None:
            if finished_run(pre, pcfg) is None:
                raise ValueError(
                    f"{pre} holds no finished warm start of this size ({pcfg.rounds} DDP "
                    f"steps, {pcfg.workers} workers, batch {pcfg.data.batch_size}): give the "
                    "flags its `covey bench comms` had"
                )
            print(f"== pretrain: kept ({pre})")
        else:
            pre = out_dir / "pretrain"
            print(f"== pretrain: DDP for {pcfg.rounds} steps per worker (shared warm start)")
            run_sim(pcfg, corpus, pre, "pretrain", True, progress)
        init, offset = str(pre), pcfg.rounds
    cfg = bench_config(method, size, init=init, round_offset=offset)
    run_dir = None if from_dir is None else from_dir / method.name
    found = None if run_dir is None else finished_run(run_dir, cfg)
    if found is not None and run_dir is not None:
        print(f"== {method.name} (simulator): kept ({run_dir})")
        records, summary = found
    else:
        run_dir = out_dir / method.name
        print(f"== {method.name} (simulator): {cfg.rounds} rounds of {cfg.steps // cfg.rounds}")
        records, summary = run_sim(cfg, corpus, run_dir, method.name, True, progress)
    init_file = None if init is None else checkpoint_file(init).resolve()
    return SimSide(cfg, records, summary, run_dir, init_file)


def other_seed_gaps(
    size: BenchSize, sim: SimSide, method: BenchMethod, dirs: Sequence[Path]
) -> dict[str, float]:
    """What another data order alone does in the simulator: for each finished simulation
    of the method on another data seed (`covey bench comms --long` runs `<method>-seed1`)
    found in `dirs`, its tail-mean gap against `sim`, by run name. Reads only."""
    ref = tail_mean(sim.records, size.tail)
    gaps: dict[str, float] = {}
    for m in comms_methods(size):
        if m.algorithm != method.algorithm or m.seed == method.seed:
            continue
        cfg = bench_config(m, size, init=sim.cfg.model.init, round_offset=sim.cfg.data.round_offset)
        for d in dirs:
            if (found := finished_run(d / m.name, cfg)) is not None:
                gaps[m.name] = (tail_mean(found[0], size.tail) - ref) / ref
                break
    return gaps


# ---------------------------------------------------------------- the network's side


def run_network(spec: dict[str, Any], workers: int, run_dir: Path, timeout_s: float) -> NetworkRun:
    """A coordinator and `workers` worker processes on 127.0.0.1 (one torch thread each)
    train `spec` to its max_rounds in a fresh `run_dir`. ClusterError, with the logs'
    tails, when round 0 does not open within STARTUP_TIMEOUT_S, a process exits before
    the run is finished, or it does not finish within timeout_s."""
    from covey.local.cluster import ClusterError, LocalCluster

    run_dir = run_dir.resolve()
    if run_dir.exists():  # a coordinator given an old data dir would resume the old run
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    spec_path = run_dir / "run.toml"
    spec_path.write_text(to_toml(spec))
    names = [f"w{i}" for i in range(workers)]
    rounds = spec["rounds"]["max_rounds"]
    loads: list[float] = []
    with LocalCluster(spec_path, run_dir) as cluster:
        cluster.start_coordinator(STARTUP_TIMEOUT_S)
        started = time.monotonic()
        for name in names:
            cluster.start_worker(name, "--threads", "1")

        def fail(problem: str) -> ClusterError:
            tails = "\n".join(cluster.tail(n, 15) for n in ("coordinator", *names))
            return ClusterError(f"network run: {problem}\n{tails}")

        opened = False
        next_progress = started + PROGRESS_S
        while True:
            now = time.monotonic()
            try:
                status: dict[str, Any] | None = cluster.status()
            except httpx.HTTPError:
                status = None
            if status is not None and status["phase"] == "finished":
                break
            # a worker leaves by itself once the run is finished; before, it is a fault
            gone = {n: rc for n in names if (rc := cluster.workers[n].poll()) is not None}
            if gone:
                raise fail(f"worker(s) exited before the run finished: {gone}")
            if cluster.coordinator is not None and cluster.coordinator.poll() is not None:
                raise fail("the coordinator exited before the run finished")
            opened = opened or bool(status and (status["rounds"] or status["phase"] != "waiting"))
            if not opened and now - started > STARTUP_TIMEOUT_S:
                raise fail(f"round 0 did not open within {STARTUP_TIMEOUT_S:.0f} s")
            if now - started > timeout_s:
                raise fail(f"not finished within {timeout_s:.0f} s")
            if opened:
                loads.append(os.getloadavg()[0])
            if now >= next_progress and status is not None:
                print(f"  [network] {now - started:5.0f} s: {status['committed_rounds']}/"
                      f"{rounds} rounds, load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
                next_progress = now + PROGRESS_S
            time.sleep(POLL_S)  # pacing between polls; the conditions are checked above
        wall_s = time.monotonic() - started
    data_dir = run_dir / "coordinator"
    return NetworkRun(data_dir, wall_s, loads, _committed_rounds(data_dir / "coordinator.db"))


def _committed_rounds(db_path: Path) -> list[tuple[int, int, int, int, int]]:
    """(round, attempt, contributions, min inner steps, max inner steps) of each committed
    round, from the coordinator's database (read-only, after it exited). A contribution
    recorded and then refused (a drawn one whose local states did not arrive) does not
    count."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return conn.execute(
            "SELECT r.round, r.attempt, COUNT(c.peer_id), MIN(c.inner_steps), "
            "MAX(c.inner_steps) FROM rounds r JOIN contributions c "
            "ON c.round = r.round AND c.attempt = r.attempt WHERE r.status = 'committed' "
            "AND NOT EXISTS (SELECT 1 FROM rejections x WHERE x.round = c.round "
            "AND x.attempt = c.attempt AND x.peer_id = c.peer_id) "
            "GROUP BY r.round ORDER BY r.round"
        ).fetchall()
    finally:
        conn.close()


def _initial_state_file(data_dir: Path) -> Path:
    """The coordinator's round-0 state: the blob its database names initial_cid."""
    from covey.blobs import BlobStore

    conn = sqlite3.connect(f"file:{data_dir / 'coordinator.db'}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'initial_cid'").fetchone()
    finally:
        conn.close()
    if row is None:
        raise FileNotFoundError(f"{data_dir}: the database names no initial state")
    return BlobStore(data_dir / "blobs").path(row[0])


def evaluate_states(cfg: SimConfig, corpus: Corpus, files: dict[int, Path]) -> dict[int, float]:
    """Round -> validation loss of each state file, evaluated as the simulator evaluates
    (same model build, batches, evaluation function and thread count). CheckpointError
    for a file that is not a state of this model, or records another round."""
    import torch

    from covey.algorithms.evaluate import evaluate
    from covey.algorithms.state import TrainState
    from covey.algorithms.tensors import param_dict
    from covey.data.batches import validation_batches
    from covey.models.source import build_run_model
    from covey.protocol.checkpoint import CheckpointError, state_from_file

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = cfg.data
    model, loss_fn, _, seq_len = build_run_model(
        cfg.model, cfg.seed, tokenizer_vocab=corpus.vocab_size, seq_len=d.seq_len
    )
    val = validation_batches(corpus, n_batches=cfg.eval_batches, batch_size=16, seq_len=seq_len)
    template = TrainState(param_dict(model))
    losses = {}
    for n, path in sorted(files.items()):
        state = state_from_file(path, template)
        if state.round != n:
            raise CheckpointError(f"{path} holds the state of round {state.round}, not {n}")
        losses[n] = evaluate(model, state, val, loss_fn)
    return losses


# ---------------------------------------------------------------- the bench


def run_agreement_bench(
    *,
    size: BenchSize,
    method_name: str | None = None,
    out_dir: Path,
    from_dir: Path | None = None,
    timeout_s: float = 3600.0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """The method in the simulator (from `from_dir` or run into `out_dir`) and over the
    network (into out_dir/network), both evaluated on the simulator's batches; prints the
    table and writes out_dir/records.json and out_dir/agreement.png. Returns the rows
    (`agreement_rows`; the summary row also carries the run's facts). ValueError for a bad
    method or a from_dir of other settings; ClusterError when the network run fails."""
    method = pick_method(size, method_name)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus()
    print(f"corpus: {corpus.describe()} (fingerprint {corpus.fingerprint})")
    sim = sim_side(size, method, out_dir=out_dir, from_dir=from_dir, corpus=corpus,
                   progress=progress)  # fmt: skip
    cfg = sim.cfg
    spec = network_spec(cfg, init_file=sim.init_file, name=f"bench-agreement-{method.name}")
    print(f"== {method.name} (network): {cfg.workers} workers on 127.0.0.1, {cfg.rounds} rounds")
    net = run_network(spec, cfg.workers, out_dir / "network", timeout_s)
    points = eval_points(sim.records, sim.summary)
    files = {0: _initial_state_file(net.data_dir)}
    ckpts = net.data_dir / "checkpoints"
    files |= {p["round"]: ckpts / f"round-{p['round']:06d}.safetensors" for p in points[1:]}
    network_losses = evaluate_states(cfg, corpus, files)
    sim_final = sim.run_dir / "checkpoints" / f"round-{cfg.rounds:06d}.safetensors"
    replay = evaluate_states(cfg, corpus, {cfg.rounds: sim_final})[cfg.rounds]
    rows = agreement_rows(method.name, points, network_losses, size.tail)
    seeds = other_seed_gaps(size, sim, method, [d for d in (from_dir, out_dir) if d is not None])
    full = all(
        n == cfg.workers and lo == hi == steps_per_round(cfg.algorithm)
        for _, _, n, lo, hi in net.rounds
    )
    rows[-1] |= {
        "sim_final_reevaluated": replay == points[-1]["val_loss"],
        "every_round_full": full and len(net.rounds) == cfg.rounds,
        "rounds": cfg.rounds,
        "round_attempts": [a for _, a, *_ in net.rounds],
        "contributions_per_round": [n for _, _, n, *_ in net.rounds],
        "inner_steps_per_contribution": sorted({x for *_, lo, hi in net.rounds for x in (lo, hi)}),
        "workers": cfg.workers,
        "steps": cfg.steps,
        "batch_size": cfg.data.batch_size,
        "pretrain_steps": cfg.data.round_offset,
        "eval_batches": cfg.eval_batches,
        "algorithm": cfg.algorithm.model_dump(mode="json"),
        "sim_other_seed_gaps": seeds,
        "network_wall_s": net.wall_s,
        "load_1m_mean": fmean(net.loads) if net.loads else None,
        "load_1m_max": max(net.loads, default=None),
        "sim_dir": str(sim.run_dir),
        "network_dir": str(net.data_dir.parent),
        "data_order": "sim: batches keyed by worker index; network: by data key "
        "(hash of run id, round, peer id)",
    }
    rows[-1]["valid"] = not invalid_because(rows[-1])
    print(format_table(rows))
    s = rows[-1]
    print(
        f"checks: round 0 evaluates identically (same batches): {s['same_batches']}; the sim's "
        f"final checkpoint re-evaluates to its record: {s['sim_final_reevaluated']}; every "
        f"round had {cfg.workers} contributions of {steps_per_round(cfg.algorithm)} steps: "
        f"{s['every_round_full']}"
    )
    for name, gap in seeds.items():
        print(f"for scale: the simulator's own {name} ends {gap:+.2%} from it (another data order)")
    load = "" if s["load_1m_mean"] is None else f", load {s['load_1m_mean']:.1f} (1 min, mean)"
    print(f"network run: {net.wall_s:.0f} s wall{load}")
    plot_agreement(
        out_dir / "agreement.png",
        rows,
        f"covey bench agreement: {method.name}, {cfg.workers} workers\n{cfg.steps} steps/worker "
        f"after a {cfg.data.round_offset}-step warm start; tail-mean gap {s['gap']:+.2%}",
    )
    write_json(out_dir / "records.json", rows)
    print(f"wrote {out_dir}/records.json and {out_dir}/agreement.png")
    return rows
