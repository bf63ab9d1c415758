"""`covey bench trust --only sparse`: cheaters that pick their moment, at sparse sampling.

Late cheaters (honest until round R, past the new-peer phase in which
every contribution is checked) and intermittent ones (cheating in a fraction of rounds),
at a sampling rate of 0.2 or less: rounds to detection per adversary kind, honest peers
slashed over >= 200 honest verifications on 1 and 2 torch threads, verification compute as
a share of training compute, and loss impact with 1 of 4 peers adversarial.

In process, on the real pieces: the coordinator's sampling draw (covey.trust.certify), the
validators' re-execution and comparison (covey.trust.verify), the run's aggregator
(build_aggregator from TrustConfig) and the adversaries' schedules and forgeries
(covey.peer.adversary). What is not here: processes and HTTP (covey.bench.trust's
`local_run` has them, at minutes per run on a shared 2-core machine).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch

#: the scheduled cheaters the table reports; R = 5 is past the new-peer phase (3 rounds)
SCHEDULED = (
    "late:sign-flip:5",
    "late:noise:5",
    "late:scaled:5",
    "late:free-rider:5",
    "late:lazy:5",
    "late:wrong-data:5",
    "intermittent:sign-flip:0.5",
    "intermittent:noise:0.25",
    "intermittent:scaled:0.1",
)
#: adversary kinds -> covey.bench.trust_calibration's cheat names
_CALIBRATION_CHEAT = {
    "noise": "noise",
    "sign-flip": "sign_flip",
    "scaled": "x100",
    "free-rider": "zeros",
    "lazy": "lazy",
    "wrong-data": "wrong_data",
}


def rounds_to_detection(
    specs: tuple[str, ...] = SCHEDULED,
    rate: float = 0.2,
    *,
    horizon: int = 60,
    cheaters: int = 400,
    new_peer_contributions: int = 3,
    new_peer_rate: float = 1.0,
) -> dict[str, dict[str, Any]]:
    """Per scheduled cheater: rounds from its first cheating round to the first round in
    which it cheated AND was sampled (then re-execution convicts it: see `sparse_report`'s
    "caught" column), over `cheaters` peers drawn with the coordinator's real draw (an
    Ed25519 signature per contribution). A peer's first `new_peer_contributions` are drawn
    at `new_peer_rate`, later ones at `rate`, as TrustConfig does. Undetected within
    `horizon` rounds counts as not caught."""
    from covey.peer.adversary import behavior_at
    from covey.protocol.content import content_id
    from covey.trust.certify import sample
    from covey.trust.identity import Identity

    coordinator = Identity.generate()
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        waits: list[int] = []
        cheats_in: list[int] = []  # cheating rounds aggregated before the catch
        missed = 0
        for n in range(cheaters):
            peer = hashlib.sha256(f"{spec}/{n}".encode()).hexdigest()[:32]
            first: int | None = None
            caught = False
            accepted = 0
            for rnd in range(horizon):
                p = new_peer_rate if rnd < new_peer_contributions else rate
                cheating = behavior_at(spec, rnd, peer) != "honest"
                if cheating and first is None:
                    first = rnd
                cid = content_id(f"{peer}/{rnd}".encode())
                accepted += cheating  # verification follows the round: this one counts too
                if cheating and sample(coordinator, "bench-trust", rnd, peer, cid, p)[0]:
                    assert first is not None
                    waits.append(rnd - first + 1)
                    cheats_in.append(accepted)
                    caught = True
                    break
            missed += not caught
        waits.sort()
        out[spec] = {
            "rate": rate,
            "cheaters": cheaters,
            "caught": round(1 - missed / cheaters, 4),
            "median_rounds": waits[len(waits) // 2] if waits else None,
            "p90_rounds": waits[int(0.9 * (len(waits) - 1))] if waits else None,
            "mean_cheats_aggregated": round(sum(cheats_in) / len(cheats_in), 2)
            if cheats_in
            else None,
        }
    return out


def _setup(model_size: str, steps: int, batch_size: int, seed: int) -> dict[str, Any]:
    """A re-executable DiLoCo run (inner_state reset, fp32) on the stdlib corpus, with
    the run's default aggregator; batches by (round, data key, step)."""
    from covey.algorithms import build_aggregator, build_strategy
    from covey.config import DiLoCoConfig, TrustConfig
    from covey.data.batches import sample_batch, validation_batches
    from covey.data.corpus import load_corpus
    from covey.models.gpt import GPT, gpt_config, lm_loss

    corpus = load_corpus([], 0.02)
    mcfg = gpt_config(model_size)
    cfg = DiLoCoConfig(inner_steps=steps, inner_state="reset", codec="fp32")
    trust = TrustConfig()

    def strategy() -> Any:
        torch.manual_seed(seed)
        agg = build_aggregator(trust.aggregation, trust.trim_fraction, trust.clip_factor)
        return build_strategy(cfg, GPT(mcfg), lm_loss, agg)

    def batches(rnd: int, key: str) -> Callable[[int], torch.Tensor]:
        def batch_fn(step: int) -> torch.Tensor:
            return sample_batch(
                corpus.train,
                batch_size=batch_size,
                seq_len=mcfg.block_size,
                seed=seed,
                round=rnd,
                worker=key,
                step=step,
            )

        return batch_fn

    val = validation_batches(corpus, n_batches=4, batch_size=16, seq_len=mcfg.block_size)
    return {"strategy": strategy, "batches": batches, "val": val, "trust": trust}


def honest_verifications(
    rounds: int = 100,
    threads: tuple[int, ...] = (1, 2),
    *,
    model_size: str = "nano",
    steps: int = 5,
    commit_every: int = 5,
    batch_size: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Honest claims against validators' re-executions: each round a worker (1 thread)
    trains and claims; a validator re-executes it on every thread count in `threads` and
    compares at the default tolerance. A disagreement would open a dispute against an
    honest peer (an upper bound on honest slashes: the referee may still clear it). Also
    times training against re-execution, and checks one claim of each cheat kind per
    round against the other thread count's re-execution ("caught")."""
    from covey.algorithms import Contribution
    from covey.bench.trust_calibration import cheat_claim, num_threads
    from covey.trust.verify import compare, reexecute

    s = _setup(model_size, steps, batch_size, seed)
    worker, validator = s["strategy"](), s["strategy"]()
    tolerance = s["trust"].tolerance
    state = worker.init_state()
    numel = sum(p.numel() for p in worker.model.parameters())
    checks = disagreements = 0
    worst = 0.0
    train_s = 0.0
    reexec_s = dict.fromkeys(threads, 0.0)
    caught: dict[str, list[float]] = {k: [] for k in _CALIBRATION_CHEAT}
    for rnd in range(rounds):
        batch_fn = s["batches"](rnd, f"peer-{rnd % 4}")
        with num_threads(threads[0]):
            t0 = time.perf_counter()
            claim = reexecute(worker, state, batch_fn, steps, commit_every)
            train_s += time.perf_counter() - t0
        for t in threads:
            with num_threads(t):
                t0 = time.perf_counter()
                mine = reexecute(validator, state, batch_fn, steps, commit_every)
                reexec_s[t] += time.perf_counter() - t0
            v = compare(claim.commitments, claim.payload, mine, worker.codec, numel, tolerance)
            checks += 1
            disagreements += not v.agree
            worst = max(worst, v.distance)
        if rnd < 2:  # every cheat kind, against the last thread count's re-execution
            for kind, name in _CALIBRATION_CHEAT.items():
                with num_threads(threads[0]):
                    commitments, payload = cheat_claim(
                        name,
                        worker,
                        state,
                        batch_fn,
                        steps,
                        commit_every,
                        honest=claim,
                        wrong_batch_fn=s["batches"](rnd, "elsewhere"),
                        seed=rnd,
                    )
                v = compare(commitments, payload, mine, worker.codec, numel, tolerance)
                caught[kind].append(v.distance)
        tokens = steps * int(batch_fn(0)[:, 1:].numel())
        state = worker.apply_round(state, [Contribution(claim.payload, tokens, steps)])
    return {
        "rounds": rounds,
        "threads": list(threads),
        "honest_checks": checks,
        "honest_disagreements": disagreements,
        "honest_max_distance": worst,
        "tolerance": tolerance,
        "train_s_per_round": train_s / rounds,
        "reexec_s_per_check": {str(t): v / rounds for t, v in reexec_s.items()},
        "cheat_min_distance": {k: min(d) for k, d in caught.items() if d},
    }


def verification_share(
    train_s: float, reexec_s: float, rate: float, new_peer_rounds: int = 3, rounds: int = 100
) -> float:
    """Validator compute over worker compute for one peer over `rounds` rounds: its first
    `new_peer_rounds` always re-executed, then a fraction `rate` (expected value)."""
    checked = min(new_peer_rounds, rounds) + rate * max(rounds - new_peer_rounds, 0)
    return checked * reexec_s / (rounds * train_s)


def loss_with_adversary(
    spec: str,
    rounds: int = 20,
    rate: float = 0.2,
    *,
    peers: int = 4,
    model_size: str = "nano",
    steps: int = 10,
    batch_size: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Final validation loss with `peers` honest workers against `peers - 1` honest ones and
    one cheater following `spec` (a payload cheat: noise, sign-flip, scaled, free-rider),
    both aggregated with the run's default rule. The cheater is sampled with the real
    draw (every round for its first 3 contributions, then at `rate`); a sampled cheating
    round convicts it, and it is excluded from the next round on (its convicted round is
    already in the model, as in a real run, where verification follows the round)."""
    from covey.algorithms import Contribution
    from covey.algorithms.evaluate import evaluate
    from covey.bench.trust_calibration import num_threads
    from covey.peer.adversary import behavior_at, forge_payload
    from covey.protocol.content import content_id
    from covey.trust.certify import sample
    from covey.trust.identity import Identity

    s = _setup(model_size, steps, batch_size, seed)
    coordinator = Identity.generate()
    results: dict[str, Any] = {}
    for run in ("honest", "attacked"):  # on 1 thread: workers' default, and fast on a busy box
        canonical = s["strategy"]()
        workers = [s["strategy"]() for _ in range(peers)]
        state = canonical.init_state()
        excluded_at: int | None = None
        cheats_in = 0
        for rnd in range(rounds):
            contributions = []
            for i, w in enumerate(workers):
                if run == "attacked" and i == peers - 1 and excluded_at is not None:
                    continue
                w.load_state(state)
                batch_fn = s["batches"](rnd, f"peer-{i}")
                with num_threads(1):
                    for step in range(steps):
                        w.inner_step(batch_fn(step))
                c = w.make_contribution()
                if run == "attacked" and i == peers - 1:
                    peer = f"cheater-{seed}"
                    kind = behavior_at(spec, rnd, peer)
                    if kind != "honest":
                        numel = sum(p.numel() for p in state.params.values())
                        payload = forge_payload(kind, c.payload, w.codec, numel, rnd)
                        c = Contribution(payload, c.tokens, c.inner_steps)
                        cheats_in += 1
                        p = 1.0 if rnd < 3 else rate
                        cid = content_id(c.payload)
                        if sample(coordinator, "bench-trust", rnd, peer, cid, p)[0]:
                            excluded_at = rnd + 1
                contributions.append(c)
            with num_threads(1):
                state = canonical.apply_round(state, contributions)
        results[run] = {
            "val_loss": evaluate(canonical.model, state, s["val"]),
            "excluded_from_round": excluded_at,
            "cheating_rounds_aggregated": cheats_in,
        }
    h, a = results["honest"]["val_loss"], results["attacked"]["val_loss"]
    return {
        "spec": spec,
        "rate": rate,
        "rounds": rounds,
        "honest_val_loss": round(h, 4),
        "attacked_val_loss": round(a, 4),
        "relative": round((a - h) / h, 4),
        **{k: v for k, v in results["attacked"].items() if k != "val_loss"},
    }


GOALS = {"honest slashed": 0, "verification share": 0.10, "loss impact": 0.03}


def sparse_report(
    rate: float = 0.2,
    *,
    honest_rounds: int = 100,
    honest_steps: int = 2,
    loss_rounds: int = 12,
    loss_steps: int = 5,
    loss_specs: tuple[str, ...] = ("late:sign-flip:5", "intermittent:noise:0.5"),
    batch_size: int = 4,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Cheaters that pick their moment, at one sparse sampling rate: rounds to detection per
    scheduled cheater, honest disagreements over 2 x `honest_rounds` verifications on 1 and 2
    threads, verification compute as a share of training, loss impact with 1 of 4 peers
    cheating. The defaults are a short version (nano GPT, few inner steps) that runs in
    minutes on a shared 2-core machine. Prints each row as it is measured (through
    `echo`); returns {"rate", "rows": [...], "details"}: one row per measure and
    adversary, with its goal and whether it was met."""
    if not 0 < rate <= 1:
        raise ValueError(f"sampling rate must be in (0, 1], got {rate}")
    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        if row["measure"] == "rounds to detection":
            echo(
                f"  {row['measure']:<20} {row['adversary']:<28} median {row['median_rounds']}, "
                f"p90 {row['p90_rounds']}, caught {row['caught']:.1%} within 60 rounds, "
                f"{row['mean_cheats_aggregated']} cheating rounds aggregated"
            )
        else:
            met = "met" if row["met"] else "MISSED"
            echo(
                f"  {row['measure']:<20} {row['adversary']:<28} {row['value']} "
                f"(goal <= {row['goal']}: {met})"
            )

    echo(f"sampling rate {rate}")
    for spec, d in rounds_to_detection(SCHEDULED, rate).items():
        add({"measure": "rounds to detection", "adversary": spec, **d})
    honest = honest_verifications(
        rounds=honest_rounds, steps=honest_steps, commit_every=honest_steps, batch_size=batch_size
    )
    echo(f"  (honest: {honest})")
    add(
        {
            "measure": "honest slashed",
            "adversary": "none",
            "checks": honest["honest_checks"],
            "value": honest["honest_disagreements"],
            "max_distance": honest["honest_max_distance"],
            "goal": GOALS["honest slashed"],
            "met": honest["honest_disagreements"] == 0 and honest["honest_checks"] >= 200,
        }
    )
    reexec_1 = honest["reexec_s_per_check"][str(honest["threads"][0])]
    share = verification_share(honest["train_s_per_round"], reexec_1, rate)
    add(
        {
            "measure": "verification share",
            "adversary": "none",
            "value": round(share, 4),
            "steady_state": round(rate * reexec_1 / honest["train_s_per_round"], 4),
            "goal": GOALS["verification share"],
            "met": share <= GOALS["verification share"],
        }
    )
    for spec in loss_specs:
        loss = loss_with_adversary(
            spec, rounds=loss_rounds, rate=rate, steps=loss_steps, batch_size=batch_size
        )
        add(
            {
                "measure": "loss impact",
                **{k: v for k, v in loss.items() if k != "spec"},
                "adversary": spec,
                "value": loss["relative"],
                "goal": GOALS["loss impact"],
                "met": loss["relative"] <= GOALS["loss impact"],
            }
        )
    return {"rate": rate, "rows": rows, "details": {"honest": honest}}
