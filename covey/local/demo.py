"""`covey demo`: a real run on one machine. A coordinator and N workers as separate
processes on 127.0.0.1 (covey.local.cluster), the status page's address, live progress
in the terminal, optional chaos (SIGKILL a random worker every so often and start a
replacement), and at the end metrics.jsonl, loss.png and summary.json in the run directory.

Nothing here imports torch: the processes do. Every child is stopped on the way out, also on
Ctrl-C, SIGTERM or an error (`run_local_demo`'s finally).
"""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from covey.config import load_run_config, merge, to_toml
from covey.local.cluster import KILL_WAIT_S, ClusterError, LocalCluster
from covey.local.demo_house import PEER_ARGS, HouseWorkers, fresh_worker_name, house_slots
from covey.local.demo_report import write_demo_outputs
from covey.local.demo_spec import METHODS, demo_spec
from covey.sim.report import human_bytes
from covey.spec import load_spec

__all__ = ["ADVERSARIES", "METHODS", "Chaos", "demo_spec", "run_local_demo"]

JOIN_TIMEOUT_S = 180.0
FINISH_GRACE_S = 600.0  # with --rounds: how long the workers may take to apply the last one
# the order in which `covey demo --adversaries N` hands out misbehaviors
ADVERSARIES = (
    "sign-flip",
    "lazy",
    "noise",
    "free-rider",
    "scaled",
    "wrong-data",
    "copycat",
    "stale",
    "replay",
    "nan",
)  # for the first worker to import torch, read the corpus and join

# --- chaos -------------------------------------------------------------------------------------


@dataclass
class Chaos:
    """Every uniform(*every_s) seconds, SIGKILL a random live worker (never the last one)
    and start a replacement under a fresh name. Seeded: the same seed picks the same
    victims at the same times, given the same set of live workers."""

    rng: random.Random
    every_s: tuple[float, float]
    due: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)

    def schedule(self, now: float) -> None:
        self.due = now + self.rng.uniform(*self.every_s)

    def pick(self, live: Sequence[str]) -> str | None:
        """The victim among `live` (sorted for determinism), or None if it is the last."""
        if len(live) < 2:
            return None
        return self.rng.choice(sorted(live))


# --- the demo ----------------------------------------------------------------------------------


class _Terminated(Exception):
    """SIGTERM reached the demo itself: stop the children like Ctrl-C does."""


class _CoordinatorStopped(Exception):
    """The coordinator exited cleanly or on SIGINT/SIGTERM: someone asked it to stop."""


@contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def handler(signum: int, _frame: Any) -> None:
        raise _Terminated(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_local_demo(
    *,
    workers: int = 4,
    minutes: float = 2.0,
    algorithm: str = "diloco",
    chaos: bool = False,
    out_dir: Path,
    model: str = "nano",
    seed: int = 0,
    progress: bool = True,
    chaos_every_s: tuple[float, float] = (15.0, 25.0),
    adversaries: int = 0,
    validators: int = 1,
    house_workers: int = 1,
    tokenizer: str = "bytes",
    data: tuple[str, ...] = (),
    rounds: int | None = None,
    inner_steps: int | None = None,
    batch_size: int = 8,
    seq_len: int | None = None,
    device: str | None = None,
    text_column: str | None = None,
    overrides: dict[str, Any] | None = None,
    json_lines: bool = False,
) -> dict[str, Any]:
    """Train for `minutes` (or until `rounds` rounds are committed, if sooner) with a
    coordinator and `workers` worker processes in `out_dir`, then write metrics.jsonl,
    loss.png and summary.json there (with each process's peak RSS) and return the summary.
    The minutes count from the first worker's join (start-up is not training); with `chaos`,
    a worker is SIGKILLed and replaced every uniform(*chaos_every_s) seconds, the first
    time only once a round has committed.

    Ctrl-C (or SIGTERM) ends the run early: the children are stopped and the outputs are
    written from what was committed so far (summary["interrupted"] is True). If the
    coordinator dies, every worker is stopped and ClusterError (with its log) is raised.

    `adversaries` of the workers misbehave, each in the next way of ADVERSARIES; the
    `validators` re-execute sampled contributions (see covey.peer.validator);
    `house_workers` of the honest workers' places go to the run owner's house workers
    (covey.local.demo_house), whose canaries test the validators: with validators, and
    leaving at least one plain honest worker.
    `overrides` (``--set``, nested) are laid over the demo's spec; a spec that does not
    validate raises UserError naming the key, before any process starts. With `json_lines`
    the demo's own lines are log records (covey.logs: JSON with --log-json), not prints."""
    if workers < 1:
        raise ValueError(f"workers ({workers}) must be at least 1")
    if not 0 <= adversaries <= workers:
        raise ValueError(f"adversaries ({adversaries}) must be between 0 and workers ({workers})")
    if house_workers < 0:
        raise ValueError(f"house_workers ({house_workers}) must be at least 0")
    if minutes <= 0:
        raise ValueError(f"minutes ({minutes}) must be positive")
    lo, hi = chaos_every_s
    if not 0 < lo <= hi:
        raise ValueError(f"chaos_every_s ({lo}, {hi}) must satisfy 0 < low <= high")
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "run.toml"
    houses = house_slots(workers, adversaries, validators, house_workers)
    spec = demo_spec(
        algorithm,
        model=model,
        seed=seed,
        workers=workers,
        adversaries=adversaries,
        house_workers=houses,
        tokenizer=tokenizer,
        data=data,
        rounds=rounds,
        inner_steps=inner_steps,
        batch_size=batch_size,
        seq_len=seq_len,
        text_column=text_column,
    )
    if device is not None:  # every peer on this device, validators included
        from covey.devices import device_class, resolve_device

        spec["peer"] = {"device": device, "verify_device": device_class(resolve_device(device))}
    spec = merge(spec, overrides or {})
    spec_path.write_text(to_toml(spec))
    load_spec(load_run_config, spec_path)  # fails here, with the field named, not in a child

    cluster = LocalCluster(spec_path, out_dir)
    say = _Printer(json_lines)
    seen: dict[str, Any] = {}  # "status": the last one read; survives an interrupted watch
    interrupted = False
    chaos_state = Chaos(random.Random(seed), (lo, hi)) if chaos else None
    house = HouseWorkers(cluster)
    with _sigterm_as_exception():  # also while stopping: a SIGTERM then kills the children
        try:
            say(f"covey demo: {algorithm} on the {model} GPT, {workers} workers, {minutes:g} min")
            # the run id covers the coordinator's key (made by the cluster)
            say(f"run {cluster.run_id} in {out_dir}; starting the coordinator ...")
            cluster.start_coordinator()
            say(f"status page: {cluster.url}/")
            for i in range(workers):
                cheat = i >= workers - adversaries
                behavior = ADVERSARIES[(i - (workers - adversaries)) % len(ADVERSARIES)]
                name = f"w{i}-{behavior}" if cheat else f"w{i}"
                if not cheat and i >= workers - adversaries - houses:
                    house.start(name)  # named like any worker: a name must not tell
                    say(f"{name} is the run owner's house worker: {HOUSE}")
                    continue
                extra = ["--behavior", behavior] if cheat else []
                cluster.start_worker(name, *PEER_ARGS, *extra)
                if cheat:
                    say(f"{name} will cheat: {behavior}")
            for i in range(validators):
                cluster.start_validator(f"v{i}", "--threads", "1")
            if validators and not houses:  # canaries come from house workers only
                say(f"warning: {UNCHECKED}")
            try:
                # the clock starts at the first join: starting N Pythons that each import
                # torch and read the corpus takes ~15 s on 2 busy cores, and is not training
                say("waiting for the workers to join (importing torch, reading the corpus) ...")
                t0 = time.monotonic()
                # a big model takes minutes to build and time on busy cores: up to half the run
                join_s = max(JOIN_TIMEOUT_S, minutes * 30.0)
                cluster.wait_for(_someone_alive, join_s, "the first worker to join")
                say(f"first worker joined after {time.monotonic() - t0:.0f} s; training")
                _watch(cluster, minutes * 60.0, chaos_state, say, progress, seen, rounds, house)
                if rounds is not None:  # the workers apply the last round, see the end, leave
                    _await_workers(cluster, FINISH_GRACE_S, say)
            except (KeyboardInterrupt, _Terminated, _CoordinatorStopped) as e:
                # Ctrl-C in a terminal reaches the children too (one process group): the
                # coordinator may be gone already, and the last status read stands in
                interrupted = True
                say(f"\ninterrupted ({e or type(e).__name__}): stopping the cluster ...")
            final = _stop_workers_then_status(cluster) or seen.get("status")
        finally:
            _stop_everything(cluster)
            say.close()

    if final is None:
        raise ClusterError(f"no status was ever read from the coordinator\n{cluster.tail()}")
    minutes_trained = seen.get("elapsed_s", 0.0) / 60
    kills = chaos_state.events if chaos_state else []
    return write_demo_outputs(
        out_dir, cluster, final, kills, interrupted, minutes_trained, say, set(house.index)
    )


# what a demo's validators lack with --house-workers 0: no house worker (`covey worker
# --house-of`), so no canary tests them; missed fraud and audits alone hold them to their checks
UNCHECKED = (
    "no house worker plays canaries in this demo: its validators are unchecked "
    "(covey worker --house-of, docs/trust.md)"
)
HOUSE = (
    "in the rounds the coordinator's secret draw picks, it trains on other data: canaries "
    "that test the validators (docs/trust.md)"
)


class _Printer:
    """print(), or tqdm.write() while a bar is on screen so lines do not tear it; with
    `json_lines`, a log line instead (covey.logs writes it as JSON)."""

    def __init__(self, json_lines: bool = False) -> None:
        self.bar: Any = None
        self.json_lines = json_lines

    def __call__(self, line: str) -> None:
        if self.json_lines:
            logging.getLogger("covey.demo").info(line)
        elif self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _watch(
    cluster: LocalCluster,
    duration_s: float,
    chaos: Chaos | None,
    say: _Printer,
    progress: bool,
    seen: dict[str, Any],
    rounds: int | None = None,
    house: HouseWorkers | None = None,
) -> None:
    """Poll /v1/status about once a second for duration_s (or until `rounds` rounds are
    committed), keeping the last answer in
    seen["status"]; run the chaos schedule; report workers that exit on their own, and
    replace a house worker excluded from the run (its canary revealed) by the next.
    ClusterError if the coordinator crashes, _CoordinatorStopped if it was stopped."""
    start = time.monotonic()
    if progress:
        from tqdm import tqdm

        say.bar = tqdm(
            total=round(duration_s),
            desc="demo",
            bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}",
            dynamic_ncols=True,
        )
    if chaos is not None:
        chaos.schedule(start)
    last: dict[str, Any] | None = None
    reported: set[str] = set()
    killed: set[str] = set()
    answering = True
    while (now := time.monotonic()) - start < duration_s:
        assert cluster.coordinator is not None
        if (code := cluster.coordinator.poll()) is not None:
            if code in (0, 130, -signal.SIGINT, -signal.SIGTERM):  # 130: typer's Ctrl-C
                raise _CoordinatorStopped(f"the coordinator exited (status {code})")
            raise ClusterError(f"the coordinator exited with status {code}\n{cluster.tail()}")
        seen["elapsed_s"] = now - start
        cluster.sample_rss()
        try:
            last = seen["status"] = cluster.status()
            answering = True
        except httpx.HTTPError as e:
            if answering:  # once per outage, not once a second
                say(f"coordinator not answering ({type(e).__name__}); retrying")
            answering = False
        for name, proc in list(cluster.workers.items()):
            if proc.poll() is not None and name not in reported and name not in killed:
                reported.add(name)
                if house is not None and name in house and proc.returncode == 1:
                    house.replace(name, say, "left: its canary was revealed, its key banned")
                    continue
                say(f"{name} exited with status {proc.returncode}; see logs/{name}.log")
        # the first kill waits for a committed round: chaos before training proves nothing
        if chaos is not None and now >= chaos.due and last and last["committed_rounds"] > 0:
            _chaos_strike(cluster, chaos, last, now - start, killed, say, house)
            chaos.schedule(now)
        if say.bar is not None:
            say.bar.n = min(round(now - start), say.bar.total)
            say.bar.set_postfix_str(_progress_line(last), refresh=True)
        if rounds is not None and last is not None and last["committed_rounds"] >= rounds:
            break
        time.sleep(max(0.0, 1.0 - (time.monotonic() - now)))
    seen["elapsed_s"] = time.monotonic() - start
    if say.bar is not None:
        say.bar.n = say.bar.total
        say.bar.refresh()


def _await_workers(cluster: LocalCluster, grace_s: float, say: Callable[[str], None]) -> None:
    """Wait up to `grace_s` for every worker to exit on its own (the run is finished: each
    applies the last round first, which for a big model takes minutes), sampling RSS."""
    give_up = time.monotonic() + grace_s
    say("the last round is committed: waiting for the workers to apply it and leave ...")
    while time.monotonic() < give_up:
        cluster.sample_rss()
        if all(p.poll() is not None for n, p in cluster.workers.items() if n.startswith("w")):
            return
        time.sleep(1.0)
    say(f"workers still running {grace_s:.0f} s after the last round: stopping them")


def _someone_alive(status: dict[str, Any]) -> bool:
    return any(p["alive"] for p in status["peers"])


def _chaos_strike(
    cluster: LocalCluster,
    chaos: Chaos,
    status: dict[str, Any],
    elapsed_s: float,
    killed: set[str],
    say: Callable[[str], None],
    house: HouseWorkers | None = None,
) -> None:
    live = [
        name
        for name, p in cluster.workers.items()
        if p.poll() is None and not name.startswith("v")  # validators are not trainers
    ]
    victim = chaos.pick(live)
    if victim is None:
        say(f"chaos [{elapsed_s:5.1f} s]: only {live} alive, nobody killed")
        return
    cluster.signal(victim, signal.SIGKILL)
    cluster.wait_exit(victim, 10.0)
    killed.add(victim)
    if house is not None and victim in house:  # the owner starts its next house key
        replacement = house.replace(victim, say, "was SIGKILLed") or "nobody"
    else:
        replacement = fresh_worker_name(cluster)
        cluster.start_worker(replacement, *PEER_ARGS)
    chaos.events.append(
        {
            "at_s": round(elapsed_s, 1),
            "killed": victim,
            "replacement": replacement,
            "committed_rounds": status["committed_rounds"],
        }
    )
    say(
        f"chaos [{elapsed_s:5.1f} s]: SIGKILL {victim} after round {status['committed_rounds']} "
        f"(no deathrattle: the round drops it once it is silent), started {replacement}"
    )


def _progress_line(status: dict[str, Any] | None) -> str:
    if status is None:
        return "waiting for the coordinator"
    losses = [r["val_loss"] for r in status["rounds"] if r["val_loss"] is not None]
    live = sum(1 for p in status["peers"] if p["alive"])
    val = f"{losses[-1]:.3f}" if losses else "-"
    return (
        f"round {status['committed_rounds']} | val {val} | peers {live} | "
        f"{human_bytes(status['bytes_total'])}"
    )


def _stop_workers_then_status(cluster: LocalCluster) -> dict[str, Any] | None:
    """SIGTERM the live workers (each sends its deathrattle), wait, then read the final
    status while the coordinator still serves it. None if it does not answer."""
    cluster.sample_rss()  # the last look at every peak before the processes exit
    live = [(n, p) for n, p in cluster.workers.items() if p.poll() is None]
    for _, proc in live:
        proc.send_signal(signal.SIGTERM)
    for name, proc in live:
        try:
            proc.wait(20.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:  # a process freeing GBs on busy cores can take a while to go
                proc.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                print(f"{name} outlived SIGKILL by {KILL_WAIT_S} s", flush=True)
                continue
            print(f"{name} ignored SIGTERM for 20 s: killed", flush=True)
    try:
        return cluster.status()
    except httpx.HTTPError:
        return None


def _stop_everything(cluster: LocalCluster) -> None:
    """cluster.stop(); a second Ctrl-C (or a SIGTERM) during it SIGKILLs whatever is left
    rather than leaving orphans, then lets the interruption go on."""
    try:
        cluster.stop()
    except (KeyboardInterrupt, _Terminated):
        procs = [*cluster.workers.values(), cluster.coordinator]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
        for proc in procs:
            if proc is not None:
                proc.wait(5.0)
        raise
