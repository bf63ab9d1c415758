"""Every RL sample checked: a worker that samples some of its samples its own way
(covey.rl.sampling_cheats: other temperature, top-k, top-p, greedy, logit bias, best-of-n
with its own seeds; written apart from the honest worker) is caught on those samples even
when the validator's proof checks are drawn elsewhere, because every sample's tokens are
checked against the seeded draw from the recomputed logits (covey.rl.batch.check_batch).
In one process, on the RL bench's small policy."""

from __future__ import annotations

import dataclasses

import pytest

from covey.bench.rl_verify import CID, bench_policy, bench_spec
from covey.rl.batch import Problem, check_batch, proof_detection
from covey.rl.cheats import Setting
from covey.rl.sampling_cheats import SAMPLING_CHEATS
from covey.rl.tasks import ArithmeticTask

MODEL, TASK = bench_policy(), ArithmeticTask()
SPEC = dataclasses.replace(bench_spec(max_new_tokens=6), prompts_per_step=1)  # 4 samples


def check(setting: Setting, batch, proofs: list[int]):
    return check_batch(
        batch,
        spec=SPEC,
        submitter=setting.worker_id,
        step=setting.step,
        policy_cid=CID,
        model=MODEL,
        task=TASK,
        verify_samples=proofs,
    )


@pytest.mark.parametrize("kind", sorted(SAMPLING_CHEATS))
def test_a_sampling_cheat_on_two_samples_is_caught_outside_the_proof_subset(kind: str) -> None:
    for step in range(70, 76):  # the first step where the cheat changes a token
        setting = Setting(MODEL, TASK, SPEC, step, f"cheat-{kind}", 0, CID)
        honest = setting.honest()
        batch = SAMPLING_CHEATS[kind](setting, step, 2)  # samples 0 and 1 its own way
        changed = [i for i in range(2) if batch.samples[i].tokens != honest.samples[i].tokens]
        if changed:
            break
    assert changed, f"{kind} chose the honest tokens in every try: nothing to catch"
    assert batch.samples[2:] == honest.samples[2:]
    verdict = check(setting, batch, proofs=[2, 3])  # proofs drawn on untouched samples
    assert not verdict.ok and verdict.problem is Problem.SAMPLING, verdict
    assert verdict.sample in changed
    assert check(setting, honest, proofs=[2, 3]).ok


def test_the_proof_subset_states_its_detection_probability() -> None:
    assert proof_detection(8, 2, 1) == pytest.approx(0.25)
    assert proof_detection(8, 2, 2) == pytest.approx(1 - 15 / 28)
    assert proof_detection(8, 8, 1) == 1.0 and proof_detection(8, 2, 7) == 1.0
    with pytest.raises(ValueError):
        proof_detection(8, 2, 9)
