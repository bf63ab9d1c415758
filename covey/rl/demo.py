"""`covey rl demo`: a whole RL run on one machine, every role its own process on 127.0.0.1.

SFT first (unless --policy is given), then a trainer, 3 honest rollout workers, a
validator and `adversaries` cheating workers (covey.rl.cheats.CHEATS, one kind each, in order) run
for `minutes`. The last `house_workers` (default 1) of the honest workers are the run owner's
house rollout workers (`covey rl worker --house-of`, covey.rl.house), named like the others:
their canary batches test the validator, and the summary counts them (the ledger's "house
canary" entries) apart from the honest workers' rejections. Progress is printed from the
trainer's status page, which stays browsable at its URL while the demo runs. At the end
every process is stopped, pass@1 on held-out prompts is measured for the first and the last
policy, and OUT/summary.json is written next to the run's ledger (OUT is the trainer's data
directory, so `covey ledger verify OUT` audits it).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from covey.config import FundsConfig
from covey.devices import device_class
from covey.rl.runspec import RLSpec
from covey.trust.house import HOUSE_KEYS
from covey.trust.identity import Identity

HONEST_WORKERS = 3
VALIDATOR_STAKE = 10.0  # credits the validator stakes (`covey rl validator`'s default)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml(values: dict[str, Any], table: str = "") -> str:
    lines, tables = [], []
    for k, v in values.items():
        if isinstance(v, dict):
            name = f"{table}.{k}" if table else k
            tables.append(f"[{name}]\n" + _toml(v, name))
        elif v is not None:
            lines.append(f"{json.dumps(k) if table.endswith('funds') else k} = {json.dumps(v)}")
    return "\n".join(lines + tables) + "\n"


def demo_spec(samples_per_step: int = 96) -> RLSpec:
    """The demo's rules: the learning settings of covey.bench.rl, 3 workers' batches a step."""
    return RLSpec(
        name="rl-demo",
        prompts_per_step=4,
        group_size=8,
        samples_per_step=samples_per_step,
        verify_samples=2,
        audit_rate=0.1,
        eval_prompts=100,
        eval_every=5,
        verify_timeout_s=60,
    )


def run_demo(
    out: Path,
    *,
    adversaries: int = 0,
    minutes: float = 5.0,
    policy: str | None = None,
    sft_steps: int = 450,
    seed: int = 0,
    echo: Callable[[str], None] = print,
    device: str = "cpu",
    house_workers: int = 1,
) -> dict[str, Any]:
    """Run the demo into `out` (created; must not hold another run) and return the summary
    written to out/summary.json. ValueError for an unknown adversary count, a
    `house_workers` that leaves no plain honest worker, or bad paths. `device` is passed to
    the trainer, validator and workers (`--device`)."""
    from covey.rl.cheats import CHEATS
    from covey.rl.sft import sft
    from covey.rl.trainer import KEY_FILE

    kinds = sorted(CHEATS)
    if not 0 <= adversaries <= len(kinds):
        raise ValueError(f"--adversaries must be in [0, {len(kinds)}], got {adversaries}")
    if not 0 <= house_workers < HONEST_WORKERS:
        raise ValueError(
            f"--house-workers must be in [0, {HONEST_WORKERS - 1}], got {house_workers}"
        )
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    from covey.rl.policy import spec_defaults

    spec = demo_spec().model_copy(update=spec_defaults(policy))  # hf: its newline eos
    # every role runs on `device`, so the run verifies on its class (a CUDA demo checks on
    # CUDA; a cpu-verified run's validators on CUDA would refuse every check)
    spec = spec.model_copy(update={"verify_device": device_class(device)})
    task = spec.task.build()
    if policy is None:
        echo(f"sft: {sft_steps} steps teaching the answer format (covey rl sft) ...")
        t0 = time.monotonic()
        policy = str(sft(task, out / "sft", steps=sft_steps, seed=seed, hf=False, progress=True))
        echo(f"sft: done in {time.monotonic() - t0:.0f} s -> {policy}")
    # every peer's key, made here: the run's spec grants each what it stakes (its
    # treasury, [trust.funds]: a key bonds only credits it holds)
    names = ["validator", *(f"worker{i}" for i in range(HONEST_WORKERS))]
    names += [f"adv-{kind}".replace("_", "-") for kind in kinds[:adversaries]]
    keys = {n: out / "keys" / f"{n}.key" for n in names}
    funds = {
        Identity.load_or_create(path).public_key: VALIDATOR_STAKE if n == "validator" else 1.0
        for n, path in keys.items()
    }
    spec = spec.model_copy(update={"trust": FundsConfig(funds=funds)})
    (out / "spec.toml").write_text(_toml(spec.model_dump(mode="json")))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    procs: dict[str, subprocess.Popen] = {}
    cheaters: dict[str, str] = {}  # name -> cheat kind

    def spawn(name: str, *args: str) -> None:
        log = (logs / f"{name}.log").open("ab")
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "covey", "rl", *args, "--device", device],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    spawn(
        "trainer",
        "trainer",
        "--data-dir",
        str(out),
        "--policy",
        policy,
        "--spec",
        str(out / "spec.toml"),
        "--port",
        str(port),
    )
    try:
        _wait_up(url, procs["trainer"], 120)
        echo(f"trainer: {url} (status page)")
        spawn("validator", "validator", "--trainer", url, "--name", "validator",
              "--identity", str(keys["validator"]), "--stake", str(VALIDATOR_STAKE))  # fmt: skip
        house: list[str] = []  # house rollout workers, named like any: a name must not tell
        for i in range(HONEST_WORKERS):
            name = f"worker{i}"
            extra = ["--identity", str(keys[name])]
            if (k := i - (HONEST_WORKERS - house_workers)) >= 0:  # its first of 64 house keys
                first = k * (HOUSE_KEYS // house_workers)  # it funds its house keys itself
                extra = ["--house-of", str(out / KEY_FILE), "--house-index", str(first)]
                house.append(name)
                echo(f"{name} is the run owner's house worker: its canary batches test the "
                     "validator (docs/rl.md)")  # fmt: skip
            spawn(name, "worker", "--trainer", url, "--name", name, *extra)
        for kind in kinds[:adversaries]:
            name = f"adv-{kind}".replace("_", "-")
            cheaters[name] = kind
            spawn(name, "worker", "--trainer", url, "--name", name, "--behavior", kind,
                  "--identity", str(keys[name]))  # fmt: skip
        deadline = time.monotonic() + 60 * minutes
        while time.monotonic() < deadline:
            time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
            if procs["trainer"].poll() is not None:
                raise RuntimeError(
                    f"the trainer exited ({procs['trainer'].returncode}); "
                    f"see {logs / 'trainer.log'}"
                )
            s = httpx.get(f"{url}/v1/rl/status", timeout=10).json()
            reward = s["reward"][-1][1] if s["reward"] else float("nan")
            p1 = s["pass_at_1"][-1][1] if s["pass_at_1"] else float("nan")
            left = (deadline - time.monotonic()) / 60
            echo(
                f"v{s['version']:>3}  reward {reward:.3f}  pass@1 {p1:.3f}  batches accepted "
                f"{s['accepted']} rejected {s['rejected']} {s['rejected_by_reason']}  "
                f"({left:.1f} min left)"
            )
        batches = httpx.get(f"{url}/v1/rl/batches", timeout=10).json()
        status = httpx.get(f"{url}/v1/rl/status", timeout=10).json()
        names = {pid: a["name"] for pid, a in status["accounts"].items()}
        final = httpx.get(f"{url}/v1/rl/policy", timeout=10).json()
    finally:
        _stop([p for name, p in procs.items() if name != "trainer"])  # peers leave first
        _stop([procs["trainer"]])
    return _summarize(out, spec, task, policy, final, batches, names, cheaters, echo, house)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _wait_up(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the trainer exited ({proc.returncode}) before serving")
        try:
            if httpx.get(f"{url}/v1/rl/policy", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the trainer did not serve {url} within {timeout:.0f} s")


def _summarize(
    out: Path,
    spec: RLSpec,
    task: Any,
    policy: str,
    final: dict[str, Any],
    batches: list[dict[str, Any]],
    names: dict[str, str],
    cheaters: dict[str, str],
    echo: Callable[[str], None],
    house: list[str],
) -> dict[str, Any]:
    from covey.blobs import BlobStore
    from covey.rl import policy as pol
    from covey.rl.learn import pass_at_1

    def score(model: Any) -> float:
        return float(
            pass_at_1(
                model,
                task,
                spec.eval_prompts,
                max_new_tokens=spec.max_new_tokens,
                eos_id=spec.eos_id,
                **pol.codec_kwargs(cfg),  # the policy's tokenizer (bytes for covey GPT)
            )
        )

    cfg, start = pol.load_policy_dir(policy)
    end = pol.load_weights(pol.build_policy(cfg), BlobStore(out / "blobs").get(final["cid"]))
    accepted = ("accepted", "consumed", "dropped")
    # a house worker's batches are neither an honest worker's nor a cheater's: its canaries
    honest = [b for b in batches if names.get(b["worker_id"], "") not in (*cheaters, *house)]
    cheats = [b for b in batches if names.get(b["worker_id"], "") in cheaters]
    by_kind: dict[str, dict[str, int]] = {}
    for b in cheats:
        kind = cheaters[names[b["worker_id"]]]
        row = by_kind.setdefault(kind, {"caught": 0, "missed": 0})
        row["caught" if b["status"] == "rejected" else "missed"] += b["status"] != "pending"
    summary = {
        "pass_at_1_start": score(start),
        "pass_at_1_end": score(end),
        "eval_prompts": spec.eval_prompts,
        "policy_versions": final["version"],
        "rollouts_accepted": sum(b["status"] in accepted for b in batches),
        "rollouts_rejected": sum(b["status"] == "rejected" for b in batches),
        "samples_accepted": sum(b["samples"] for b in batches if b["status"] in accepted),
        "honest_rejected": sum(b["status"] == "rejected" for b in honest),
        "cheats_caught": sum(b["status"] == "rejected" for b in cheats),
        "cheats_missed": sum(b["status"] in accepted for b in cheats),
        "cheats_by_kind": by_kind,
        "rejected_by_reason": _count(b["problem"] for b in batches if b["status"] == "rejected"),
        "house_workers": house,
        "canaries": _canaries(out),
        "ledger": str(out / "coordinator.db"),
        "decentralization": rl_costs_of(out / "coordinator.db"),  # the multiplier
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    echo(
        f"pass@1 {summary['pass_at_1_start']:.3f} -> {summary['pass_at_1_end']:.3f}; batches "
        f"accepted {summary['rollouts_accepted']}, rejected {summary['rollouts_rejected']} "
        f"(honest {summary['honest_rejected']}); cheats caught {summary['cheats_caught']}, "
        f"missed {summary['cheats_missed']}; "
        + (_canary_line(summary["canaries"]) if house else "validator unchecked (no canaries)")
        + f"; multiplier "
        f"{summary['decentralization']['multiplier']}; wrote {out / 'summary.json'}; audit "
        f"the ledger with: covey ledger verify {out}"
    )
    return summary


def _canaries(out: Path) -> dict[str, int]:
    """The run's canaries as its ledger's "house canary" entries tell: revealed ("drawn"),
    "caught" by the validator that checked it, or "passed" (the validator agreed; the
    trainer's recomputation convicted it). A canary batch not yet decided is not counted."""
    from covey.io import audit

    entries, _, _ = audit.load(out)
    outcomes = [e.payload["outcome"] for e in entries if e.type == "house canary"]
    return {
        "drawn": len(outcomes),
        "caught": outcomes.count("caught"),
        "passed": outcomes.count("convicted"),
    }


def _canary_line(c: dict[str, int]) -> str:
    return f"canaries {c['drawn']}: caught {c['caught']}, passed {c['passed']}"


def rl_costs_of(path: Path) -> dict[str, Any]:
    """The decentralization multiplier of the RL run whose database is `path`
    (covey.rl.costs), read after its trainer stopped."""
    from covey.coordinator.db import Database
    from covey.rl.costs import run_costs

    db = Database(path)
    try:
        return run_costs(db).as_dict()
    finally:
        db.close()


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return out
