"""RL learning: loss math, the Learner's step, SFT's policy directory, pass@1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from covey.models.gpt import GPT, GPTConfig
from covey.rl.batch import RolloutBatch, RolloutSpec, Sample
from covey.rl.learn import ANSWER_EOS, LearnConfig, Learner, greedy_completions, pass_at_1
from covey.rl.loss import LossConfig, group_advantages, grpo_loss
from covey.rl.tasks import ArithmeticTask

TINY = GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=32)


def tiny(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY).eval()


# --- loss math -------------------------------------------------------------------------


def test_advantages_are_reward_minus_group_mean_without_std() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    a = group_advantages(r, 4)
    assert torch.allclose(a, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    s = group_advantages(r, 4, std_normalize=True)
    assert s[0] > 1.5 and torch.allclose(s[4:], torch.zeros(4))
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def test_clipping_is_two_sided_and_bounded_for_negative_advantages() -> None:
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, delta=4.0, max_tokens=1)
    old = torch.zeros(1, 1)
    mask = torch.ones(1, 1)

    def grad_of(log_ratio: float, adv: float) -> float:
        lp = torch.tensor([[log_ratio]], requires_grad=True)
        loss, _ = grpo_loss(lp, old, torch.tensor([adv]), mask, cfg)
        loss.backward()
        assert lp.grad is not None
        return float(lp.grad)

    assert grad_of(0.0, 1.0) < 0  # on-policy, A > 0: push logprob up
    assert grad_of(0.0, -1.0) > 0
    assert grad_of(float(torch.log(torch.tensor(1.5))), 1.0) == 0  # rho > 1 + eps_high: clipped
    assert grad_of(float(torch.log(torch.tensor(0.5))), -1.0) == 0  # rho < 1 - eps_low: clipped
    assert grad_of(float(torch.log(torch.tensor(0.5))), 1.0) < 0  # the other side is not
    # A < 0 with a huge ratio: the objective is bounded at delta * A, no gradient
    lp = torch.tensor([[3.0]], requires_grad=True)
    loss, _ = grpo_loss(lp, old, torch.tensor([-1.0]), mask, cfg)
    assert float(loss.detach()) == pytest.approx(4.0)


def test_loss_is_normalized_by_the_fixed_token_budget() -> None:
    cfg = LossConfig(max_tokens=8)
    lp = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    loss, stats = grpo_loss(lp, lp, torch.tensor([1.0, 1.0]), mask, cfg)
    assert float(loss) == pytest.approx(-5 / (2 * 8))  # 5 tokens, 2 rows x 8, not / 5
    assert stats["tokens"] == 5
    with pytest.raises(ValueError, match="max_tokens"):
        grpo_loss(torch.zeros(1, 9), torch.zeros(1, 9), torch.ones(1), torch.ones(1, 9), cfg)


def test_normalizer_variants() -> None:
    lp = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, 1.0])

    def loss(norm: str) -> float:
        return float(grpo_loss(lp, lp, adv, mask, LossConfig(max_tokens=8, norm=norm))[0])

    assert loss("tokens") == pytest.approx(-1.0)  # 5 tokens / 5
    assert loss("sequence") == pytest.approx(-1.0)  # (4/4 + 1/1) / 2
    assert loss("max_tokens") == pytest.approx(-5 / 16)
    with pytest.raises(ValueError, match="norm"):
        LossConfig(norm="mean")


def test_kl_term_is_off_by_default_and_needs_reference() -> None:
    lp, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, lp, torch.ones(1), mask, LossConfig(kl_coef=0.1))
    ref = torch.full((1, 2), -1.0)
    base, _ = grpo_loss(lp, lp, torch.ones(1), mask, LossConfig())
    kl, _ = grpo_loss(lp, lp, torch.ones(1), mask, LossConfig(kl_coef=0.1), ref)
    assert float(kl) > float(base)


# --- the Learner -----------------------------------------------------------------------

TASK = ArithmeticTask(max_operand=9)
SPEC = RolloutSpec(
    run_id="t", prompts_per_step=1, group_size=2, temperature=1.0, max_new_tokens=3,
    vocab_size=256, eos_id=ANSWER_EOS,
)  # fmt: skip


def batch_of(tokens: list[list[int]], rewards: list[float], logprobs: float = -1.0) -> RolloutBatch:
    """One prompt (training index 0) with len(tokens) samples."""
    samples = [
        Sample(tokens=t, logprobs=[logprobs] * len(t), reward=r, proof="")
        for t, r in zip(tokens, rewards, strict=True)
    ]
    return RolloutBatch(run_id="t", step=0, policy_version=0, policy_cid="c", worker_id="w",
                        prompt_indices=[0], group_size=len(tokens), samples=samples)  # fmt: skip


def seq_logprob(policy: GPT, tokens: list[int]) -> float:
    prompt = list(TASK.prompt(0).encode())
    with torch.no_grad():
        logits = policy(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1 :]
    return float(torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).sum())


def test_step_moves_probability_toward_the_rewarded_completion() -> None:
    policy = tiny()
    good, bad = [ord("7"), ANSWER_EOS], [ord("3"), ANSWER_EOS]
    learner = Learner(policy, LearnConfig(lr=1e-2, loss=LossConfig(max_tokens=3)), TASK)
    before = seq_logprob(policy, good) - seq_logprob(policy, bad)
    b = batch_of([good, bad], [1.0, 0.0])
    for v in range(3):
        # the rollout's logprobs: what the policy gave when it "sampled" them
        lp = [[seq_logprob(policy, good)] * 2, [seq_logprob(policy, bad)] * 2]
        b = b.model_copy(update={"samples": [
            s.model_copy(update={"logprobs": [x / 2 for x in lps]})
            for s, lps in zip(b.samples, lp, strict=True)
        ]})  # fmt: skip
        stats = learner.step([(b, v)], v)
        assert stats["updated"] == 1 and stats["samples"] == 2
    after = seq_logprob(policy, good) - seq_logprob(policy, bad)
    assert after > before + 0.5


def test_stale_batches_are_dropped_and_counted() -> None:
    policy = tiny()
    learner = Learner(policy, LearnConfig(async_level=2, loss=LossConfig(max_tokens=3)), TASK)
    b = batch_of([[ord("1"), ANSWER_EOS], [ord("2"), ANSWER_EOS]], [1.0, 0.0])
    weights = [p.detach().clone() for p in policy.parameters()]
    stats = learner.step([(b, 2), (b, 3)], 5)  # 5 - 2 = 3 is the oldest usable
    assert stats["dropped_stale"] == 1 and stats["batches"] == 1 and stats["staleness_mean"] == 2
    stats = learner.step([(b, 1)], 5)
    assert stats["updated"] == 0 and learner.dropped_stale == 2
    with pytest.raises(ValueError, match="> current"):
        learner.step([(b, 6)], 5)
    assert any(not torch.equal(w, p) for w, p in zip(weights, policy.parameters(), strict=True))


def test_uniform_groups_carry_no_gradient() -> None:
    policy = tiny()
    learner = Learner(policy, LearnConfig(lr=1e-2, loss=LossConfig(max_tokens=3)), TASK)
    weights = [p.detach().clone() for p in policy.parameters()]
    b = batch_of([[ord("1"), ANSWER_EOS], [ord("2"), ANSWER_EOS]], [1.0, 1.0])
    stats = learner.step([(b, 0)], 0)
    assert stats["updated"] == 1 and stats["grad_norm"] == 0
    assert all(torch.equal(w, p) for w, p in zip(weights, policy.parameters(), strict=True))


def test_micro_batching_does_not_change_the_step() -> None:
    b = batch_of([[ord(c), ANSWER_EOS] for c in "1234"], [1.0, 0.0, 0.5, 0.0], logprobs=-5.0)
    results = []
    for micro in (4, 1):
        policy = tiny()
        cfg = LearnConfig(lr=1e-2, micro_batch=micro, loss=LossConfig(max_tokens=3))
        Learner(policy, cfg, TASK).step([(b, 0)], 0)
        # gradients, not weights: Adam's first step is ~lr * sign(g), which float noise flips
        results.append(
            torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
        )
    assert torch.allclose(results[0], results[1], atol=1e-7)
    assert float(results[0].abs().max()) > 1e-4


# --- pass@1 and SFT --------------------------------------------------------------------


def test_greedy_completions_match_one_at_a_time() -> None:
    policy = tiny(1)
    prompts = [list(b"1+2="), list(b"3+4="), list(b"10+2=")]
    together = greedy_completions(policy, prompts, 4, eos_id=None)
    alone = [greedy_completions(policy, [p], 4, eos_id=None)[0] for p in prompts]
    assert together == alone and all(len(t) == 4 for t in together)


def test_pass_at_1_counts_exact_answers() -> None:
    class Oracle(torch.nn.Module):
        """Emits the right sum for 'a+b=' prompts, one byte at a time."""

        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids: torch.Tensor, **_: object) -> object:
            rows = []
            for row in input_ids.tolist():
                text = bytes(row).decode()
                prompt, _, done = text.partition("=")
                a, b = prompt.split("+")
                target = f"{int(a) + int(b)}\n"
                nxt = ord(target[len(done)]) if len(done) < len(target) else ANSWER_EOS
                logits = torch.zeros(len(row), 256)
                logits[-1, nxt] = 10.0
                rows.append(logits)
            out = torch.stack(rows)
            return type("Out", (), {"logits": out, "hidden_states": [out]})()

    task = ArithmeticTask(max_operand=20)
    assert pass_at_1(Oracle(), task, 30) == 1.0
    assert pass_at_1(tiny(), task, 30) == 0.0
    assert pass_at_1(Oracle(), task, 5, temperature=0.5) == 1.0


def test_sft_writes_a_loadable_policy(tmp_path: Path) -> None:
    from covey.rl.sft import load_policy, sft

    task = ArithmeticTask(max_operand=9)
    d1 = sft(task, tmp_path / "a", steps=3, seed=4, model=TINY, eval_prompts=5, hf=False)
    d2 = sft(task, tmp_path / "b", steps=3, seed=4, model=TINY, eval_prompts=5, hf=False)
    m1, doc = load_policy(d1)
    m2, _ = load_policy(d2)
    assert doc["sft_steps"] == 3 and doc["eos_id"] == ANSWER_EOS and "pass_at_1" in doc
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    assert m1.lm_head.weight is m1.wte.weight  # tying survives the round trip
    with pytest.raises(ValueError, match="not a policy directory"):
        load_policy(tmp_path)


def test_policy_directory_loads_as_an_hf_model_source(tmp_path: Path) -> None:
    from covey.models.source import build_model
    from covey.rl.sft import load_policy, sft

    d = sft(ArithmeticTask(max_operand=9), tmp_path / "p", steps=2, model=TINY, eval_prompts=2)
    ours, _ = load_policy(d)
    hf, _, info = build_model(f"hf:{d}", 0, init=f"hf:{d}")
    ids = torch.tensor([list(b"3+4=7")])
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(input_ids=ids).logits, atol=1e-5)
    assert info.parameters == ours.num_parameters()


# --- commands and the bench ------------------------------------------------------------


def _apps() -> tuple[object, object]:
    import typer

    from covey.bench.rl_cli import register as register_bench
    from covey.rl.learn_cli import register_sft

    rl, bench = typer.Typer(), typer.Typer()
    register_sft(rl)
    register_bench(bench)
    rl.command("noop")(lambda: None)  # a group of one command would swallow its name
    bench.command("noop")(lambda: None)
    return rl, bench


def test_sft_command_writes_a_policy_and_refuses_bad_input(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    rl, _ = _apps()
    runner = CliRunner()
    args = ["sft", "--out", str(tmp_path / "p"), "--steps", "2", "--max-operand", "9",
            "--no-hf"]  # fmt: skip
    result = runner.invoke(rl, args)
    assert result.exit_code == 0, result.output
    assert "pass@1" in result.output and (tmp_path / "p" / "policy.json").is_file()
    again = runner.invoke(rl, args)
    assert again.exit_code == 2 and "holds a policy already" in again.output
    bad = runner.invoke(rl, ["sft", "--out", str(tmp_path / "q"), "--model", "huge"])
    assert bad.exit_code == 2 and "unknown model" in bad.output


def test_bench_rl_refuses_a_missing_policy(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    _, bench = _apps()
    result = CliRunner().invoke(bench, ["rl", "--policy", str(tmp_path)])
    assert result.exit_code == 2 and "no policy.json" in result.output


def test_honest_batch_is_the_workers_batch() -> None:
    from covey.bench.rl import honest_batch
    from covey.rl.batch import rollout

    policy = tiny(2)
    spec = RolloutSpec(run_id="t", prompts_per_step=2, group_size=3, temperature=1.0,
                       max_new_tokens=3, vocab_size=256, eos_id=ANSWER_EOS)  # fmt: skip
    ours = honest_batch(policy, TASK, spec, step=1, worker_id="w", policy_version=0)
    theirs = rollout(policy, TASK, spec, step=1, worker_id="w", policy_version=0,
                     policy_cid="v0")  # fmt: skip
    assert [s.tokens for s in ours.samples] == [s.tokens for s in theirs.samples]
    assert [s.reward for s in ours.samples] == [s.reward for s in theirs.samples]
    assert ours.prompt_indices == theirs.prompt_indices and all(s.proof == "" for s in ours.samples)


@pytest.mark.long
def test_bench_rl_quick_writes_json_and_plot(tmp_path: Path) -> None:
    import json

    from covey.bench.rl import run_bench

    out = tmp_path / "rl.json"
    result = run_bench(True, tmp_path / "work", json_path=out, verify=False, echo=lambda _: None)
    doc = json.loads(out.read_text())
    assert doc["learning"]["rl_steps"] == 6 and len(doc["learning"]["curve"]) >= 3
    assert "plot" not in result or out.with_suffix(".png").is_file()


def test_demo_bench_and_trainer_share_one_default_lr() -> None:
    """`covey rl demo` (its RLSpec), a trainer's RLSpec and `covey bench rl` start from
    covey.rl.learn.DEFAULT_LR (why 2e-4: its comment)."""
    from covey.bench.rl import LearningConfig
    from covey.rl.demo import demo_spec
    from covey.rl.learn import DEFAULT_LR
    from covey.rl.runspec import RLSpec

    assert RLSpec().lr == demo_spec().lr == LearningConfig().lr == LearnConfig().lr == DEFAULT_LR
