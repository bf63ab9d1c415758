"""In-process N-worker simulator driving the real strategies through their round interface.

Each virtual worker owns a model replica and a Strategy, trains on its deterministic
batches, and produces real contribution bytes; the canonical update is computed by the
same pure `apply_round` the networked peers run, with the aggregator the run spec's [trust]
table names (`build_aggregator`, as the coordinator and peers build it). Only the network is
modelled (covey.sim.network): bytes are the real payload sizes, times are measured compute
plus modelled transfers. Churn follows a seeded schedule; a joiner downloads the canonical state
(counted as received bytes) and starts fresh local state, as a real joiner would.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from covey.algorithms import Strategy, TrainState, build_aggregator, build_strategy
from covey.algorithms.evaluate import evaluate
from covey.algorithms.tensors import host_sum
from covey.config import SimConfig
from covey.data.batches import sample_batch, validation_batches
from covey.data.corpus import Corpus, load_corpus
from covey.devices import resolve_device, resolve_precision, synchronize
from covey.models.source import build_run_model
from covey.models.warmstart import apply_init
from covey.sim.network import Link, make_links, round_timing
from covey.sim.report import human_bytes
from covey.sim.resume import SimSnapshot

TOPOLOGY = (
    "gather through a relay: each worker uploads its contribution once and downloads every "
    "other live worker's; a joiner also downloads the canonical state"
)


@dataclass
class Worker:
    index: int
    link: Link
    slowdown: float
    strategy: Strategy | None = None  # None while departed
    pending: TrainState | None = None  # a round result still in flight (overlap)
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass
class SimResult:
    config: SimConfig
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    state: TrainState = field(repr=False)


def simulate(
    cfg: SimConfig,
    corpus: Corpus | None = None,
    *,
    progress: bool = True,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_snapshot: Callable[[SimSnapshot], None] | None = None,
    resume: SimSnapshot | None = None,
) -> SimResult:
    """Run `cfg` to completion; returns per-round records and a summary.

    Deterministic given cfg: model init, batches, churn and bytes depend only on cfg.seed.
    Times are measured unless cfg.compute.step_time_s models them, in which case the
    records are identical bit for bit across runs.
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = cfg.data
    corpus = corpus or load_corpus(list(d.paths), d.val_fraction, d.tokenizer, d.text_column)
    # the model its source names, checked against the tokenizer and context before training
    base, loss_fn, _, seq_len = build_run_model(
        cfg.model, cfg.seed, tokenizer_vocab=corpus.vocab_size, seq_len=d.seq_len
    )
    # every simulated peer, and the canonical state, on the [peer] device
    device = resolve_device(cfg.peer.device)
    precision = resolve_precision(cfg.peer.precision, device)
    base = base.to(device)
    warm_start = apply_init(base, cfg.model.init)  # a covey checkpoint: its parameters
    # the aggregator a coordinator and its peers build from the same spec (peer/runsetup.py)
    trust = cfg.trust
    aggregator = build_aggregator(trust.aggregation, trust.trim_fraction, trust.clip_factor)
    canonical = build_strategy(cfg.algorithm, copy.deepcopy(base), loss_fn, aggregator)
    canonical.set_compute(precision, cfg.peer.compile)
    state = canonical.init_state()
    val = validation_batches(corpus, n_batches=cfg.eval_batches, batch_size=16, seq_len=seq_len)

    def new_strategy() -> Strategy:
        s = build_strategy(cfg.algorithm, copy.deepcopy(base), loss_fn, aggregator)
        s.set_compute(precision, cfg.peer.compile)
        s.load_state(state)
        return s

    slowdowns = cfg.compute.slowdown or (1.0,)
    links = make_links(cfg.network, cfg.workers, cfg.seed)
    workers = [
        Worker(i, links[i], slowdowns[i % len(slowdowns)], new_strategy())
        for i in range(cfg.workers)
    ]
    churn = random.Random(f"covey-churn/{cfg.seed}")
    records: list[dict[str, Any]] = []
    sim_time = compute_total = wall_total = 0.0
    tokens = 0
    val_loss = initial_val_loss = evaluate(canonical.model, state, val, loss_fn)
    started = time.perf_counter()
    bar = _progress(cfg.rounds, progress)
    first = 0
    if resume is not None:  # covey sim --resume (covey.sim.resume): continue after its round
        state = resume.state  # before restore: new_strategy() loads it
        first, records, counters = resume.restore(workers, churn, new_strategy)
        sim_time, compute_total, wall_total, tokens, val_loss, initial_val_loss = counters
        tokens = int(tokens)
        bar.update(first)

    for r in range(first, cfg.rounds):
        ready = _apply_churn(workers, churn, cfg, r, new_strategy, state)
        live = [w for w in workers if w.strategy is not None]
        contributions, compute, step_s, losses = [], [], [], []
        for w in live:
            assert w.strategy is not None
            steps_done, seconds, loss_sum = _train_round(w, w.strategy, cfg, corpus, r, seq_len)
            contributions.append(w.strategy.make_contribution())
            compute.append(seconds)
            step_s.append(seconds / steps_done)
            losses.append(loss_sum / steps_done)
        t0 = time.perf_counter()
        new_state = canonical.apply_round(state, contributions)
        # every peer runs apply_round: measured, or free when compute is modelled
        apply_s = 0.0 if cfg.compute.step_time_s else time.perf_counter() - t0
        tokens += sum(c.tokens for c in contributions)
        sent = [c.nbytes for c in contributions]
        received = [sum(sent) - s for s in sent]
        for w, s, n in zip(live, sent, received, strict=True):
            w.bytes_sent += s
            w.bytes_received += n
        # the next round's first tau steps run while the bytes are in flight
        hidden = min(step_s) * canonical.overlap_steps
        timing = round_timing(
            [ready[w.index] for w in live],
            [c + apply_s for c in compute],
            sent,
            received,
            [w.link for w in live],
            hidden,
        )
        for w in live:
            assert w.strategy is not None
            if w.strategy.overlap_steps:
                w.pending = new_state  # merged after the next round's first tau steps
            else:
                w.strategy.adopt(new_state)
        state = new_state
        sim_time += timing.wall_s
        compute_total += timing.compute_s
        wall_total += timing.wall_s
        evaluated = (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds
        if evaluated:
            val_loss = evaluate(canonical.model, state, val, loss_fn)
        record = {
            "round": r + 1,
            "inner_steps": (r + 1) * canonical.steps_per_round,
            "live_workers": len(live),
            "tokens": tokens,
            "train_loss": sum(losses) / len(losses),
            "val_loss": val_loss if evaluated else None,  # null between evaluations
            "bytes_sent": sum(sent),
            "bytes_received": sum(received),
            "bytes_sent_per_worker": sum(w.bytes_sent for w in workers) / cfg.workers,
            "bytes_received_per_worker": sum(w.bytes_received for w in workers) / cfg.workers,
            "round_time_s": timing.wall_s,
            "comm_blocked_s": timing.comm_s,
            "sim_time_s": sim_time,
            "utilization": timing.utilization,
        }
        records.append(record)
        if on_round:
            on_round(record)
        if on_snapshot:
            counters = (sim_time, compute_total, wall_total, tokens, val_loss, initial_val_loss)
            h = cfg.config_hash()
            on_snapshot(SimSnapshot.take(h, state, records, workers, churn, counters))
        bar.set_postfix(
            loss=f"{val_loss:.3f}",
            sent=human_bytes(record["bytes_sent_per_worker"]),
            refresh=False,
        )
        bar.update(1)
    bar.close()

    last = records[-1]
    summary = {
        "method": cfg.algorithm.method,
        "config_hash": cfg.config_hash(),
        "config": cfg.model_dump(mode="json"),
        "corpus": corpus.describe(),
        "corpus_fingerprint": corpus.fingerprint,
        "parameters": sum(p.numel() for p in base.parameters()),
        "rounds": cfg.rounds,
        "init": None if warm_start is None else str(warm_start),
        "round_offset": cfg.data.round_offset,
        "inner_steps_per_worker": last["inner_steps"],
        "tokens": last["tokens"],
        "initial_val_loss": initial_val_loss,
        "final_val_loss": last["val_loss"],
        "final_train_loss": last["train_loss"],
        "bytes_sent_per_worker": last["bytes_sent_per_worker"],
        "bytes_received_per_worker": last["bytes_received_per_worker"],
        "sim_time_s": sim_time,
        "utilization": compute_total / wall_total if wall_total else 1.0,
        "topology": TOPOLOGY,
        "state_digest": state.digest(),
        "real_time_s": time.perf_counter() - started,
    }
    return SimResult(cfg, records, summary, state)


def _apply_churn(
    workers: list[Worker],
    rng: random.Random,
    cfg: SimConfig,
    r: int,
    new_strategy: Callable[[], Strategy],
    state: TrainState,
) -> dict[int, float]:
    """Seeded leaves and joins at round open. Returns each worker's start delay (a joiner
    first downloads the canonical state)."""
    ready = {w.index: 0.0 for w in workers}
    if r == 0 or (cfg.churn.leave_prob == 0 and cfg.churn.join_prob == 0):
        return ready
    live = sum(w.strategy is not None for w in workers)
    for w in workers:
        roll = rng.random()  # one draw per worker per round keeps the schedule stable
        if w.strategy is not None and roll < cfg.churn.leave_prob and live > cfg.churn.min_workers:
            w.strategy, w.pending, live = None, None, live - 1
        elif w.strategy is None and roll < cfg.churn.join_prob:
            w.strategy, live = new_strategy(), live + 1
            nbytes = state.nbytes()
            w.bytes_received += nbytes
            ready[w.index] = w.link.download_s(nbytes)
    return ready


def _train_round(
    w: Worker, s: Strategy, cfg: SimConfig, corpus: Corpus, r: int, seq_len: int
) -> tuple[int, float, float]:
    """One round of inner steps for worker w -> (steps, simulated seconds, loss sum)."""
    steps = s.steps_per_round
    if s.flexible_steps:
        steps = max(1, round(steps / w.slowdown))  # a slow worker does less, weighted by tokens
    seconds = 0.0
    losses = []  # on the device: read once, after the round's steps
    for step in range(steps):
        if step == s.overlap_steps and w.pending is not None:
            s.adopt(w.pending)
            w.pending = None
        batch = sim_batch(cfg, corpus, seq_len, r, w.index, step)
        t0 = time.perf_counter()
        losses.append(s.inner_step(batch))
        if not cfg.compute.step_time_s:  # a measured time counts the device's work
            synchronize(s.device)
        seconds += _step_time(cfg, time.perf_counter() - t0, w.slowdown)
    if w.pending is not None:  # the round was shorter than the overlap
        s.adopt(w.pending)
        w.pending = None
    return steps, seconds, host_sum(losses)


def sim_batch(
    cfg: SimConfig, corpus: Corpus, seq_len: int, r: int, worker: int, step: int
) -> torch.Tensor:
    """Worker `worker`'s batch for inner step `step` of round `r`: keyed by round +
    data.round_offset, so a continuation of an N-round warm-up (offset N) never draws the
    warm-up's batches (covey.data.batches.assignment_batches does the same over the network)."""
    return sample_batch(
        corpus.train,
        batch_size=cfg.data.batch_size,
        seq_len=seq_len,
        seed=cfg.seed,
        round=r + cfg.data.round_offset,
        worker=worker,
        step=step,
    )


def _step_time(cfg: SimConfig, measured: float, slowdown: float) -> float:
    return (cfg.compute.step_time_s or measured) * slowdown


class _NoBar:
    def set_postfix(self, **_: Any) -> None: ...
    def update(self, _: int) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="rounds", unit="round", dynamic_ncols=True)
