"""`covey bench trust --only rl-sampling`: how often the RL validator's check catches a
rollout worker that samples its own way (covey.rl.sampling_cheats: other temperature,
top-k, top-p, greedy, logit bias, best-of-n with its own seeds), and what the proof
subset's size buys.

For each cheat, `tries` batches of 8 samples (2 prompts x 4) from the RL bench's policy
(covey.bench.rl_verify), the cheat applied to every sample and to the first 2, each
checked as a validator checks now (covey.rl.batch.check_batch: every sample's tokens
against the seeded draw, proofs on the drawn 2) and as it checked before (sampling and
logprobs only on the 2 prefilled samples). Also honest batches under the same check
(false rejections) and the proof subset's detection probability
(covey.rl.batch.proof_detection). One process, CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from covey.bench.rl_verify import CID, VERIFY_K, bench_policy, bench_spec
from covey.rl.batch import (
    TOLERANCES,
    batch_digest,
    check_batch,
    judge,
    measure_samples,
    proof_detection,
    rollout,
    verified_subset,
)
from covey.rl.cheats import Setting
from covey.rl.sampling_cheats import SAMPLING_CHEATS
from covey.rl.tasks import ArithmeticTask

SAMPLES = 8  # 2 prompts x group of 4, as bench_spec


def _caught(setting: Setting, batch: Any, beacon: str) -> tuple[bool, bool]:
    """(caught by the check of every sample, caught by the check of the drawn 2 only)."""
    spec, task, model = setting.spec, setting.task, setting.policy
    subset = verified_subset(batch_digest(batch), beacon, len(batch.samples), VERIFY_K)
    now = check_batch(
        batch,
        spec=spec,
        submitter=setting.worker_id,
        step=setting.step,
        policy_cid=CID,
        model=model,
        task=task,
        verify_samples=subset,
    )
    stats = measure_samples(batch, subset, spec=spec, model=model, task=task)
    before = all(judge(stats[i], TOLERANCES[spec.precision], i).ok for i in subset)
    return not now.ok, not before


def sampling_report(tries: int = 20, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Rows per (cheat, samples altered): tries, those that changed a token (a cheat that
    changed none is the honest batch), caught now, caught by the old subset check;
    honest batches and false rejections; the proof subset's detection table."""
    before_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, spec, task = bench_policy(), bench_spec(), ArithmeticTask()
        rows = []
        for kind, cheat in SAMPLING_CHEATS.items():
            for altered in (None, 2):
                now = before = changed = 0
                for t in range(tries):
                    setting = Setting(model, task, spec, 3000 + t, f"s-{kind}-{t}", 0, CID)
                    batch = cheat(setting, t, altered)
                    a, b = _caught(setting, batch, f"beacon-{t}")
                    now, before = now + a, before + b
                    pairs = zip(batch.samples, setting.honest().samples, strict=True)
                    changed += any(a.tokens != b.tokens for a, b in pairs)
                row = {
                    "cheat": kind,
                    "altered": SAMPLES if altered is None else altered,
                    "tries": tries,
                    "changed": changed,
                    "caught": now,
                    "caught_subset_only": before,
                }
                rows.append(row)
                echo(
                    f"{kind}, {row['altered']} of {SAMPLES} samples: caught {now}/{tries} "
                    f"(prefilling {VERIFY_K} only: {before}/{tries}); {changed} of the "
                    f"{tries} changed a token"
                )
        rejected = 0
        for t in range(tries):
            honest = rollout(model, task, spec, step=4000 + t, worker_id=f"h-{t}",
                             policy_version=0, policy_cid=CID)  # fmt: skip
            setting = Setting(model, task, spec, 4000 + t, f"h-{t}", 0, CID)
            rejected += _caught(setting, honest, f"beacon-{t}")[0]
        echo(f"honest: {rejected}/{tries} batches rejected")
        detection = {bad: proof_detection(SAMPLES, VERIFY_K, bad) for bad in range(1, SAMPLES + 1)}
        echo(
            f"proof checks on {VERIFY_K} of {SAMPLES}: a batch with b bad proofs is caught with "
            + ", ".join(f"b={b}: {p:.2f}" for b, p in detection.items())
        )
        return {
            "rows": rows,
            "honest": {"batches": tries, "rejected": rejected},
            "proof_detection": {"samples": SAMPLES, "k": VERIFY_K, "by_bad": detection},
        }
    finally:
        torch.set_num_threads(before_threads)
