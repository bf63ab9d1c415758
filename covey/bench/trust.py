"""`covey bench trust`: what trust costs and what it buys, measured on real runs.

* cost: a local run (coordinator, honest workers and one validator as processes on
  127.0.0.1) at the default sampling policy; validator seconds spent re-executing against
  worker seconds spent training, in the new-peer phase (every contribution sampled) and
  after it (sample_rate).
* detection: the probability that a cheater who cheats every round is sampled at least once
  within n rounds, against the sampling rate, drawn with the coordinator's real sampling
  (covey.trust.certify: an Ed25519 signature per contribution). A sampled cheat is caught
  with certainty at the calibrated tolerance (`covey.bench.trust_calibration`: every cheat
  lands far above it), so this is the detection probability.
* loss: final validation loss of an honest run against the same run with one of four
  workers cheating (robust aggregation bounds it until it is caught and excluded).
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from covey.config import to_toml
from covey.local.cluster import LocalCluster

RATES = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)
HORIZONS = (1, 3, 10)


def run_spec(
    rounds: int, peers: int, seed: int = 0, trust: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A re-executable DiLoCo run on the nano GPT with the default trust policy (`trust`:
    fields of the trust table that replace it, e.g. another sample_rate, whose minimum stake
    then follows it, docs/trust.md). Rounds
    wait for all but one of `peers`: a round made by whoever joined first would be one
    peer's alone, and no aggregation rule outvotes a cheater who is the only contributor;
    all but one, so that the run goes on once a cheater is excluded."""
    return {
        "name": "bench-trust",
        "seed": seed,
        "model": {"size": "nano"},
        "data": {"batch_size": 8},
        "algorithm": {
            "method": "diloco",
            "inner_steps": 30,
            "codec": "fp32",
            "inner_state": "reset",
            "outer_lr": 0.7,
            "outer_momentum": 0.5,
            "optim": {"lr": 3e-3},
        },
        "rounds": {
            "max_rounds": rounds,
            "min_peers": max(1, peers - 1),
            "deadline_min_s": 10,
            "eval_batches": 4,
        },
        "trust": dict(trust or {}),
    }


def local_run(
    out: Path,
    rounds: int,
    behaviors: list[str],
    *,
    validators: int = 1,
    slowdown: float = 1.0,
    timeout_s: float = 1200,
    trust: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run `rounds` rounds with one worker per behavior and `validators` validators (`trust`:
    as `run_spec`; each worker stakes the run's minimum, which the cluster deposits to its
    key); the final status, the ledger's counts and the compute seconds by role."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "run.toml"
    spec_dict = run_spec(rounds, len(behaviors), trust=trust)
    spec.write_text(to_toml(spec_dict))
    cluster = LocalCluster(spec, out)
    t0 = time.monotonic()
    with cluster:
        cluster.start_coordinator()
        for i, b in enumerate(behaviors):
            extra = ["--behavior", b] if b != "honest" else []
            cluster.start_worker(f"w{i}-{b}", "--slowdown", f"{slowdown:g}", *extra)
        for i in range(validators):
            cluster.start_validator(f"v{i}")
        status = cluster.wait_for(
            lambda s: s["committed_rounds"] >= rounds, timeout_s, f"{rounds} rounds"
        )
        # let the validators finish what was sampled before the run ended (bounded)
        give_up = time.monotonic() + 120
        while time.monotonic() < give_up:
            counts = cluster.status()["trust"]["verifications"]
            if not counts.get("pending") and not counts.get("claimed"):
                break
            time.sleep(1.0)
        status = cluster.status()
    wall = time.monotonic() - t0
    return {"status": status, "wall_s": wall, **_compute(out / "coordinator" / "coordinator.db")}


def _compute(db_path: Path) -> dict[str, Any]:
    """Worker training seconds and validator re-execution seconds, by phase."""
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    train = {
        (r["round"], r["peer_id"]): r["compute_s"]
        for r in db.execute(
            "SELECT c.round, c.peer_id, c.compute_s FROM contributions c "
            "JOIN rounds r ON r.round = c.round AND r.attempt = c.attempt "
            "WHERE r.status = 'committed'"
        )
    }
    checks = [
        (r["round"], r["peer_id"], json.loads(r["report"])["compute_s"])
        for r in db.execute("SELECT * FROM verifications WHERE report IS NOT NULL")
    ]
    rank: dict[str, list[int]] = {}
    for rnd, peer in sorted(train):
        rank.setdefault(peer, []).append(rnd)
    new = {(rnd, p) for p, rounds in rank.items() for rnd in rounds[:3]}  # new_peer_contributions
    phases: dict[str, dict[str, float]] = {}
    for name, keep in (("new peers", lambda k: k in new), ("steady", lambda k: k not in new)):
        worker = sum(s for k, s in train.items() if keep(k))
        validator = sum(s for rnd, p, s in checks if keep((rnd, p)))
        n = sum(1 for k in train if keep(k))
        sampled = sum(1 for rnd, p, _ in checks if keep((rnd, p)))
        phases[name] = {
            "contributions": n,
            "re-executed": sampled,
            "worker_s": round(worker, 2),
            "validator_s": round(validator, 2),
            "fraction": round(validator / worker, 4) if worker else 0.0,
        }
    db.close()
    return {"compute": phases}


def detection(rates: tuple[float, ...] = RATES, draws: int = 20_000) -> dict[str, Any]:
    """P(a cheater who cheats every round is sampled within n rounds), measured with the
    coordinator's real draw over `draws` simulated cheaters per rate, next to 1-(1-p)^n."""
    from covey.protocol.content import content_id
    from covey.trust.certify import sample
    from covey.trust.identity import Identity

    coordinator = Identity.generate()
    out: dict[str, Any] = {}
    for rate in rates:
        first_hit: list[int | None] = []
        for cheater in range(draws // max(len(rates), 1)):
            peer = f"{cheater:032x}"
            hit = None
            for rnd in range(max(HORIZONS)):
                cid = content_id(f"{peer}/{rnd}".encode())
                if sample(coordinator, "0" * 16, rnd, peer, cid, rate)[0]:
                    hit = rnd
                    break
            first_hit.append(hit)
        n = len(first_hit)
        out[str(rate)] = {
            f"within {h}": {
                "measured": round(sum(1 for x in first_hit if x is not None and x < h) / n, 4),
                "expected": round(1 - (1 - rate) ** h, 4),
            }
            for h in HORIZONS
        }
    return out


def loss_under_attack(out: Path, rounds: int, attack: str) -> dict[str, Any]:
    """Final validation loss: 4 honest workers vs 3 honest + 1 `attack`."""
    honest = local_run(out / "honest", rounds, ["honest"] * 4)
    attacked = local_run(out / attack, rounds, ["honest"] * 3 + [attack])
    h = _last_val(honest["status"])
    a = _last_val(attacked["status"])
    return {
        "rounds": rounds,
        "attack": attack,
        "honest_val_loss": h,
        "attacked_val_loss": a,
        "relative": round((a - h) / h, 4) if h and a else None,
        "caught": [p["name"] for p in attacked["status"]["peers"] if p.get("banned")],
    }


def _last_val(status: dict[str, Any]) -> float | None:
    losses = [r["val_loss"] for r in status["rounds"] if r["val_loss"] is not None]
    return losses[-1] if losses else None
