"""covey.rl's pure core: seeded sampling, proofs, GRPO loss, tasks, batch checks."""

from __future__ import annotations

import base64

import pytest
import torch

from covey.models.gpt import GPT, GPTConfig
from covey.rl import sampling

# Long enough for two 32-token proof chunks after a short prompt; tiny otherwise.
RL_CFG = GPTConfig(block_size=80, vocab_size=256, n_layer=2, n_head=2, n_embd=64)


def rl_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(RL_CFG).eval()


@pytest.fixture(scope="module")
def policy() -> GPT:
    return rl_gpt(0)


PROMPT = list(b"12+7=")


def test_seed_depends_on_every_field() -> None:
    base = sampling.sample_seed("run", 3, "w1", 4, 0)
    assert base == sampling.sample_seed("run", 3, "w1", 4, 0)
    others = {
        sampling.sample_seed("run2", 3, "w1", 4, 0),
        sampling.sample_seed("run", 4, "w1", 4, 0),
        sampling.sample_seed("run", 3, "w2", 4, 0),
        sampling.sample_seed("run", 3, "w1", 5, 0),
        sampling.sample_seed("run", 3, "w1", 4, 1),
    }
    assert base not in others and len(others) == 5
    assert 0 <= base < 2**64


def test_noise_per_position_is_independent_of_others() -> None:
    a = sampling.gumbel_noise(7, 5, 256)
    assert torch.equal(a, sampling.gumbel_noise(7, 5, 256))
    assert not torch.equal(a, sampling.gumbel_noise(7, 6, 256))


def test_generate_is_reproducible_and_checks(policy: GPT) -> None:
    g1 = sampling.generate(policy, PROMPT, 20, 1.0, seed=11)
    g2 = sampling.generate(policy, PROMPT, 20, 1.0, seed=11)
    g3 = sampling.generate(policy, PROMPT, 20, 1.0, seed=12)
    assert g1.tokens == g2.tokens and len(g1.tokens) == 20
    assert g1.tokens != g3.tokens
    assert g1.hidden.shape == (20, RL_CFG.n_embd) and g1.logprobs.shape == (20,)
    check = sampling.check_sampling(policy, PROMPT, g1.tokens, 11, 1.0)
    assert check.mismatches == 0
    assert torch.allclose(check.logprobs, g1.logprobs, atol=1e-4)
    # the same tokens under another seed do not pass: the noise binds the tokens
    assert sampling.check_sampling(policy, PROMPT, g1.tokens, 12, 1.0).mismatches > 5


def test_generate_stops_at_eos(policy: GPT) -> None:
    g = sampling.generate(policy, PROMPT, 20, 1.0, seed=11)
    eos = g.tokens[3]
    stopped = sampling.generate(policy, PROMPT, 20, 1.0, seed=11, eos_id=eos)
    assert stopped.tokens == g.tokens[: g.tokens.index(eos) + 1]


def test_edited_token_is_a_sampling_mismatch(policy: GPT) -> None:
    g = sampling.generate(policy, PROMPT, 12, 1.0, seed=5)
    edited = list(g.tokens)
    edited[6] = (edited[6] + 1) % 256
    check = sampling.check_sampling(policy, PROMPT, edited, 5, 1.0)
    assert not bool(check.agree[6]) and bool(check.agree[:6].all())


def test_bad_temperature_is_named() -> None:
    with pytest.raises(ValueError, match="temperature"):
        sampling.generate(rl_gpt(), PROMPT, 2, 0.0, seed=1)


# --- loss ---------------------------------------------------------------------------

from covey.rl.loss import LossConfig, group_advantages, grpo_loss  # noqa: E402


def test_group_advantages_mean_only_and_std_option() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(r, 4)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    std = group_advantages(r, 4, std_normalize=True)
    assert std[0] > 1.5 and torch.all(std[4:] == 0)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def _lp(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], requires_grad=True)


def test_gradient_sign_follows_advantage() -> None:
    for a, sign in ((1.0, -1), (-1.0, 1)):
        lp = _lp([-1.0, -2.0])
        loss, _ = grpo_loss(lp, lp.detach().clone(), torch.tensor([a]), torch.ones(1, 2))
        loss.backward()
        # minimizing the loss raises logprobs of positive-advantage tokens
        assert torch.all(torch.sign(lp.grad) == sign)


def test_zero_advantage_group_gives_zero_loss_and_grad() -> None:
    lp = torch.randn(4, 5, requires_grad=True)
    adv = group_advantages(torch.ones(4), 4)
    loss, _ = grpo_loss(lp, lp.detach() - 0.3, adv, torch.ones(4, 5))
    loss.backward()
    assert loss.detach().item() == 0.0 and torch.all(lp.grad == 0)


def test_clipping_boundaries() -> None:
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, delta=4.0, max_tokens=1)
    old = torch.zeros(1, 1)
    import math

    def grad(rho: float, a: float) -> float:
        lp = torch.tensor([[math.log(rho)]], requires_grad=True)
        loss, _ = grpo_loss(lp, old, torch.tensor([a]), torch.ones(1, 1), cfg)
        loss.backward()
        return float(lp.grad)

    assert grad(1.2, 1.0) != 0  # inside the range
    assert grad(1.3, 1.0) == 0  # above 1 + eps_high with A > 0: clipped
    assert grad(0.5, 1.0) != 0  # below 1 - eps_low with A > 0: min keeps the unclipped term
    assert grad(0.7, -1.0) == 0  # below 1 - eps_low with A < 0: clipped
    assert grad(3.0, -1.0) != 0  # large ratio, A < 0, under delta: still pushed down
    assert grad(5.0, -1.0) == 0  # above delta with A < 0: bounded


def test_loss_divides_by_fixed_token_budget() -> None:
    cfg = LossConfig(max_tokens=10)
    lp = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    loss, stats = grpo_loss(lp, lp, torch.tensor([1.0]), mask, cfg)
    assert float(loss) == pytest.approx(-2 / 10) and stats["tokens"] == 2


def test_kl_option() -> None:
    lp = torch.zeros(1, 3, requires_grad=True)
    cfg = LossConfig(kl_coef=0.1, max_tokens=3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 3), cfg)
    loss, _ = grpo_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 3), cfg, lp.detach() - 1)
    assert loss.detach().item() > 0


# --- tasks --------------------------------------------------------------------------

from covey.rl.tasks import (  # noqa: E402
    ArithmeticTask,
    JsonlTask,
    TaskError,
    assigned_prompts,
    load_reward,
)


def reward_contains(record: dict, completion: str) -> float:
    """A py: reward for the JSONL test: 1 if the completion holds the record's answer."""
    return 1.0 if record["answer"] in completion else 0.0


def test_arithmetic_split_is_disjoint_and_deterministic() -> None:
    task = ArithmeticTask(seed=3, max_operand=30, ops="+-")
    again = ArithmeticTask(seed=3, max_operand=30, ops="+-")
    train = {task.prompt(i) for i in range(len(task))}
    test = {p for p, _ in task.test_prompts()}
    assert train.isdisjoint(test) and len(train) + len(test) == 2 * 31 * 31
    assert 0.05 < len(test) / (len(train) + len(test)) < 0.15
    assert [task.prompt(i) for i in range(20)] == [again.prompt(i) for i in range(20)]
    # another seed reorders training prompts but never moves a problem across the split
    other = ArithmeticTask(seed=4, max_operand=30, ops="+-")
    assert {p for p, _ in other.test_prompts()} == test


def test_arithmetic_reward_format() -> None:
    task = ArithmeticTask(seed=0, max_operand=20, format_reward=0.1)
    p = task.prompt(0)
    a, b = (int(x) for x in p[:-1].split("+"))
    right = str(a + b)
    assert task.reward(0, right + "\nmore") == 1.0
    assert task.reward(0, right) == 1.0
    assert task.reward(0, str(a + b + 1) + "\n") == 0.1
    assert task.reward(0, " " + right) == 0.0
    assert task.reward(0, "x\n") == 0.0
    assert ArithmeticTask(max_operand=20).reward(0, str(a + b + 1)) == 0.0
    with pytest.raises(TaskError, match="out of range"):
        task.prompt(len(task))


def test_assigned_prompts_deterministic_per_run_step_worker() -> None:
    a = assigned_prompts("run", 5, "w1", 8, num_prompts=1000)
    assert a == assigned_prompts("run", 5, "w1", 8, num_prompts=1000)
    assert a != assigned_prompts("run", 6, "w1", 8, num_prompts=1000)
    assert a != assigned_prompts("run", 5, "w2", 8, num_prompts=1000)
    assert all(0 <= i < 1000 for i in a)


def test_jsonl_task_with_py_reward(tmp_path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "capital of France?", "answer": "Paris"}\n\n{"prompt": "2*3=", "answer": "6"}\n'
    )
    task = JsonlTask(path, "py:tests.test_rl:reward_contains")
    assert len(task) == 2 and task.prompt(1) == "2*3="
    assert task.reward(0, "It is Paris.") == 1.0 and task.reward(1, "5") == 0.0
    for bad in ("tests.test_rl:reward_contains", "py:tests.test_rl:nope", "py:no_such_mod:f"):
        with pytest.raises(TaskError, match="reward spec"):
            load_reward(bad)
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(TaskError, match=r"bad\.jsonl:1"):
        JsonlTask(tmp_path / "bad.jsonl", "py:tests.test_rl:reward_contains")


def test_parquet_prompts_give_the_same_assignments_as_jsonl(tmp_path) -> None:
    """The same records as JSONL and as Parquet (through the data layer's table reader):
    same prompts, same rewards, so the same assignments and checks on every role."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"prompt": f"{a}*{a + 1}=", "answer": str(a * (a + 1)), "n": a} for a in range(23)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    spec = "py:tests.test_rl:reward_contains"
    jl, pt = JsonlTask(tmp_path / "p.jsonl", spec), JsonlTask(tmp_path / "p.parquet", spec)
    assert len(pt) == len(jl) == 23
    for step, worker in ((0, "w1"), (7, "w2")):
        want = assigned_prompts("run", step, worker, 6, num_prompts=len(jl))
        assert want == assigned_prompts("run", step, worker, 6, num_prompts=len(pt))
        assert [pt.prompt(i) for i in want] == [jl.prompt(i) for i in want]
        assert [pt.reward(i, records[i]["answer"]) for i in want] == [1.0] * 6
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), tmp_path / "bad.parquet")
    with pytest.raises(TaskError, match="string 'prompt'"):
        JsonlTask(tmp_path / "bad.parquet", spec)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(TaskError, match="junk"):
        JsonlTask(tmp_path / "junk.parquet", spec)


# --- proofs -------------------------------------------------------------------------

from covey.rl import proofs  # noqa: E402
from covey.rl.calibrate import bf16_rounded, perturbed, trained  # noqa: E402


@pytest.fixture(scope="module")
def honest_gen(policy: GPT) -> sampling.Generation:
    return sampling.generate(policy, PROMPT, 40, 1.0, seed=21)  # a full chunk and a part


def test_proof_size_meets_goal() -> None:
    assert proofs.proof_size(32, 64) == 258 and proofs.proof_size(32, 4096) == 258
    assert proofs.proof_size(40, 64) == 258 + 2 + 2 * 31  # 8 tokens commit 31 values
    assert proofs.proof_size(33, 2) == (2 + 2 * 64) + (2 + 2 * 2)  # fewer values than k


def test_honest_proof_verifies_on_1_and_2_threads(policy: GPT, honest_gen) -> None:
    proof = proofs.build_proof(honest_gen.hidden)
    assert len(proof) == proofs.proof_size(40, RL_CFG.n_embd)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            verdict = proofs.verify_proof(policy, PROMPT, honest_gen.tokens, proof)
            assert verdict.ok, verdict.reason
            assert all(c.overlap == 1.0 and c.mean_ulp < 0.1 for c in verdict.chunks)
    finally:
        torch.set_num_threads(before)


def test_proof_from_other_weights_is_rejected(policy: GPT) -> None:
    for cheat in (perturbed(policy, 1e-3), bf16_rounded(policy), trained(policy, steps=1)):
        gen = sampling.generate(cheat, PROMPT, 16, 1.0, seed=21)
        verdict = proofs.verify_proof(policy, PROMPT, gen.tokens, proofs.build_proof(gen.hidden))
        assert not verdict.ok


def test_proof_of_altered_prompt_or_tokens_is_rejected(policy: GPT, honest_gen) -> None:
    proof = proofs.build_proof(honest_gen.hidden)
    other_prompt = list(b"13+7=")
    assert not proofs.verify_proof(policy, other_prompt, honest_gen.tokens, proof).ok
    edited = list(honest_gen.tokens)
    edited[3] = (edited[3] + 1) % 256
    assert not proofs.verify_proof(policy, PROMPT, edited, proof).ok


def test_malformed_proof_is_a_verdict_not_an_exception(policy: GPT, honest_gen) -> None:
    proof = proofs.build_proof(honest_gen.hidden)
    short = proofs.verify_proof(policy, PROMPT, honest_gen.tokens, proof[:-1])
    assert not short.ok and "bytes" in short.reason
    bad_mod = (1).to_bytes(2, "little") + proof[2:]
    assert "modulus" in proofs.verify_proof(policy, PROMPT, honest_gen.tokens, bad_mod).reason


# --- batch checks ---------------------------------------------------------------------

from covey.rl.batch import (  # noqa: E402
    Problem,
    RolloutBatch,
    RolloutSpec,
    Sample,
    check_batch,
    rollout,
)

SPEC = RolloutSpec(
    run_id="run-rl",
    prompts_per_step=2,
    group_size=2,
    temperature=1.0,
    max_new_tokens=8,
    vocab_size=256,
    eos_id=None,
)
TASK = ArithmeticTask(seed=0, max_operand=20)
CID = "cid-v3"


def _batch(model: GPT, worker: str = "w1", step: int = 3) -> RolloutBatch:
    return rollout(model, TASK, SPEC, step=step, worker_id=worker, policy_version=3, policy_cid=CID)


@pytest.fixture(scope="module")
def honest_batch(policy: GPT) -> RolloutBatch:
    return _batch(policy)


def _check(model: GPT, batch: RolloutBatch, step: int = 3, submitter: str = "w1", **kw):
    return check_batch(
        batch,
        spec=SPEC,
        submitter=submitter,
        step=step,
        policy_cid=CID,
        model=model,
        task=TASK,
        **kw,
    )


def _with_sample(batch: RolloutBatch, i: int, **changes) -> RolloutBatch:
    samples = list(batch.samples)
    samples[i] = samples[i].model_copy(update=changes)
    return batch.model_copy(update={"samples": samples})


def test_honest_batch_passes_on_1_and_2_threads(policy: GPT) -> None:
    before = torch.get_num_threads()
    try:
        batches = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            batches[threads] = _batch(policy)
        for gen_threads, batch in batches.items():
            for threads in (1, 2):
                torch.set_num_threads(threads)
                verdict = _check(policy, batch)
                assert verdict.ok, (gen_threads, threads, verdict)
    finally:
        torch.set_num_threads(before)
    # the schema round-trips through JSON, the wire format
    batch = batches[1]
    assert RolloutBatch.model_validate_json(batch.model_dump_json()) == batch


def test_batch_from_other_weights_is_rejected(policy: GPT) -> None:
    for cheat in (perturbed(policy, 1e-3), bf16_rounded(policy), trained(policy, steps=1)):
        verdict = _check(policy, _batch(cheat))
        assert not verdict.ok and verdict.problem in (Problem.PROOF, Problem.SAMPLING), verdict


def test_altered_prompt_is_rejected(policy: GPT, honest_batch: RolloutBatch) -> None:
    # sample 0 generated for another prompt, claimed for the assigned one
    other = list(b"1+1=")
    seed = sampling.sample_seed(SPEC.run_id, 3, "w1", honest_batch.prompt_indices[0], 0)
    gen = sampling.generate(policy, other, SPEC.max_new_tokens, 1.0, seed)
    forged = _with_sample(
        honest_batch,
        0,
        tokens=gen.tokens,
        logprobs=gen.logprobs.tolist(),
        proof=base64.b64encode(proofs.build_proof(gen.hidden)).decode(),
        reward=TASK.reward(
            honest_batch.prompt_indices[0], bytes(gen.tokens).decode("utf-8", "replace")
        ),
    )
    verdict = _check(policy, forged)
    assert not verdict.ok and verdict.sample == 0 and verdict.problem is Problem.PROOF


def test_edited_tokens_are_rejected(policy: GPT, honest_batch: RolloutBatch) -> None:
    s = honest_batch.samples[1]
    for pos in (0, 4, 7):
        tokens = list(s.tokens)
        tokens[pos] = (tokens[pos] + 7) % 256
        text = bytes(tokens).decode("utf-8", "replace")
        forged = _with_sample(
            honest_batch, 1, tokens=tokens, reward=TASK.reward(honest_batch.prompt_indices[0], text)
        )
        verdict = _check(policy, forged)
        assert not verdict.ok and verdict.sample == 1, verdict
        assert verdict.problem in (Problem.PROOF, Problem.SAMPLING)


def test_fabricated_logprobs_are_rejected(policy: GPT, honest_batch: RolloutBatch) -> None:
    s = honest_batch.samples[2]
    forged = _with_sample(honest_batch, 2, logprobs=[x + 0.01 for x in s.logprobs])
    assert _check(policy, forged).problem is Problem.LOGPROBS


def test_inflated_reward_is_rejected(policy: GPT, honest_batch: RolloutBatch) -> None:
    s = honest_batch.samples[3]
    verdict = _check(policy, _with_sample(honest_batch, 3, reward=s.reward + 1.0))
    assert verdict.problem is Problem.REWARD and verdict.sample == 3


def test_dropped_samples_and_skipped_prompts_are_rejected(
    policy: GPT, honest_batch: RolloutBatch
) -> None:
    dropped = honest_batch.model_copy(update={"samples": honest_batch.samples[:-1]})
    assert _check(policy, dropped).problem is Problem.GROUP
    smaller_g = honest_batch.model_copy(
        update={"samples": honest_batch.samples[::2], "group_size": 1}
    )
    assert _check(policy, smaller_g).problem is Problem.GROUP
    skipped = honest_batch.model_copy(
        update={
            "prompt_indices": honest_batch.prompt_indices[:1],
            "samples": honest_batch.samples[:2],
        }
    )
    assert _check(policy, skipped).problem is Problem.PROMPTS
    chosen = honest_batch.model_copy(update={"prompt_indices": [0, 1]})
    assert _check(policy, chosen).problem is Problem.PROMPTS


def test_replayed_or_stale_batch_is_rejected(policy: GPT, honest_batch: RolloutBatch) -> None:
    # w2 resubmits w1's batch as it is (its signature names w1), or relabelled as its own
    assert _check(policy, honest_batch, submitter="w2").problem is Problem.WRONG_WORKER
    replay = honest_batch.model_copy(update={"worker_id": "w2"})
    assert _check(policy, replay, submitter="w2").problem is Problem.PROMPTS
    assert _check(policy, honest_batch, policy_version=4).problem is Problem.WRONG_POLICY
    assert _check(policy, honest_batch, step=4).problem is Problem.WRONG_STEP
    other_policy = honest_batch.model_copy(update={"policy_cid": "cid-v2"})
    assert _check(policy, other_policy).problem is Problem.WRONG_POLICY


def test_schema_limits_and_bad_proof() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="base64"):
        Sample(tokens=[1], logprobs=[0.0], reward=0.0, proof="not base64!")
    with pytest.raises(ValidationError):
        Sample(tokens=[1] * 5000, logprobs=[0.0] * 5000, reward=0.0, proof="")
    with pytest.raises(ValidationError):
        Sample(tokens=[1], logprobs=[0.0], reward=0.0, proof="", extra=1)


def test_hf_causal_lm_generates_and_verifies(tmp_path) -> None:
    from covey.models.hf import build_hf_model
    from tests.tiny_hf import tiny_llama

    model = build_hf_model(tiny_llama(tmp_path / "llama"), seed=0).eval()
    prompt = [5, 17, 42]
    gen = sampling.generate(model, prompt, 12, 0.8, seed=9)
    assert len(gen.tokens) == 12 and gen.hidden.shape == (12, 64)
    assert sampling.check_sampling(model, prompt, gen.tokens, 9, 0.8).mismatches == 0
    proof = proofs.build_proof(gen.hidden)
    assert proofs.verify_proof(model, prompt, gen.tokens, proof).ok
    assert not proofs.verify_proof(model, [5, 17, 43], gen.tokens, proof).ok


def test_calibration_separates_honest_from_cheats() -> None:
    from covey.rl.calibrate import calibrate

    rows = {r.name: r for r in calibrate(n_seq=2, n_new=8)}
    for name, row in rows.items():
        if name.startswith("honest"):
            assert row.rejected == 0 and row.max_mean_ulp < 0.1, row
        elif name.startswith("cheat"):
            assert row.rejected == row.sequences, row


# --- verification: cheats, binding, subsets, batched generation -----------------------

from covey.rl.batch import (  # noqa: E402
    TOLERANCES,
    batch_digest,
    verified_subset,
)
from covey.rl.cheats import CHEATS, Setting  # noqa: E402


@pytest.mark.parametrize("kind", sorted(CHEATS))
def test_every_cheat_is_caught(policy: GPT, kind: str) -> None:
    # prefill checks on 2 of 4 samples, drawn as a validator draws them: a full-batch cheat
    # is caught whichever 2 (replay alternates as-is / relabelled: both seeds)
    for seed in (0, 1) if kind == "replayed_batch" else (0,):
        step, worker = 10 + seed, f"cheat-{seed}"
        batch = CHEATS[kind](Setting(policy, TASK, SPEC, step, worker, 3, CID), seed)
        subset = verified_subset(batch_digest(batch), f"beacon{seed}", len(batch.samples), 2)
        verdict = _check(policy, batch, step=step, submitter=worker, verify_samples=subset)
        assert not verdict.ok, (kind, seed)


def test_honest_batches_pass_with_generation_batches(policy: GPT) -> None:
    before = torch.get_num_threads()
    try:
        for threads, gen_batch in ((1, 4), (2, 3)):
            torch.set_num_threads(threads)
            batch = rollout(
                policy,
                TASK,
                SPEC,
                step=5,
                worker_id="w1",
                policy_version=3,
                policy_cid=CID,
                gen_batch=gen_batch,
            )
            for verify_threads, prefill_batch in ((1, 1), (2, 4)):
                torch.set_num_threads(verify_threads)
                verdict = _check(policy, batch, step=5, prefill_batch=prefill_batch)
                assert verdict.ok, (threads, gen_batch, verify_threads, verdict)
    finally:
        torch.set_num_threads(before)


def test_generate_batch_matches_one_at_a_time(policy: GPT) -> None:
    prompts = [list(b"1+2="), list(b"12+34="), PROMPT]
    one = [sampling.generate(policy, p, 10, 1.0, seed=40 + i) for i, p in enumerate(prompts)]
    eos = one[0].tokens[3]  # one sequence stops early, the others run on
    one = [sampling.generate(policy, p, 10, 1.0, 40 + i, eos) for i, p in enumerate(prompts)]
    many = sampling.generate_batch(policy, prompts, 10, 1.0, [40, 41, 42], eos)
    assert len(one[0].tokens) == 4
    for a, b in zip(one, many, strict=True):
        assert a.tokens == b.tokens and a.hidden.shape == b.hidden.shape
        assert torch.allclose(a.hidden, b.hidden, atol=1e-4)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="seeds"):
        sampling.generate_batch(policy, prompts, 2, 1.0, [1], None)


def test_verified_subset_is_beacon_drawn() -> None:
    a = verified_subset("d1", "b1", 16, 4)
    assert a == verified_subset("d1", "b1", 16, 4) and len(set(a)) == 4 == len(a)
    assert a == sorted(a) and all(0 <= i < 16 for i in a)
    draws = {tuple(verified_subset("d1", f"b{i}", 16, 4)) for i in range(20)}
    assert len(draws) > 10  # the beacon moves the choice
    assert verified_subset("d1", "b1", 3, 5) == [0, 1, 2]
    with pytest.raises(ValueError):
        verified_subset("d", "b", -1, 2)


def test_digest_binds_worker_step_and_version(honest_batch: RolloutBatch) -> None:
    d = batch_digest(honest_batch)
    assert d == batch_digest(RolloutBatch.model_validate_json(honest_batch.model_dump_json()))
    for change in ({"worker_id": "w2"}, {"step": 4}, {"policy_version": 4}):
        assert batch_digest(honest_batch.model_copy(update=change)) != d


def test_precision_picks_tolerances(policy: GPT) -> None:
    import dataclasses

    assert TOLERANCES["bf16"].proof.max_mean_ulp > TOLERANCES["fp32"].proof.max_mean_ulp
    with pytest.raises(ValueError, match="precision"):
        dataclasses.replace(SPEC, precision="fp8")
    spec16 = dataclasses.replace(SPEC, precision="bf16")
    model16 = rl_gpt(0).to(torch.bfloat16)
    batch = rollout(
        model16, TASK, spec16, step=3, worker_id="w1", policy_version=3, policy_cid=CID, gen_batch=2
    )
    verdict = check_batch(
        batch,
        spec=spec16,
        submitter="w1",
        step=3,
        policy_cid=CID,
        model=model16,
        task=TASK,
        prefill_batch=4,
    )
    assert verdict.ok, verdict
    # checked by the fp32 rules against the fp32 policy, the bf16 batch is a cheat
    assert not _check(policy, batch).ok


def test_bench_rl_verify_refuses_bad_arguments(capsys) -> None:
    from covey.bench import rl_verify

    for argv in (["--sections", "nope"], ["--tries", "0"]):
        with pytest.raises(SystemExit) as exc:
            rl_verify.main(argv)
        assert exc.value.code == 2
        assert "error:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="sections"):
        rl_verify.run(sections=("nope",))


@pytest.mark.long
def test_bench_rl_verify_quick_run() -> None:
    from covey.bench import rl_verify

    rows = rl_verify.run(quick=True, honest_batches=1, tries=1, progress=lambda _: None)
    s = rl_verify.summary(rows)
    assert s["honest_rollouts"] > 0 and s["honest_rejected"] == 0, s
    assert s["cheat_kinds"] == len(CHEATS) and s["cheats_missed"] == 0, s
    assert s["proof_bytes_per_full_chunk"] <= 258
