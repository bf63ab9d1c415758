"""Hugging Face causal LMs as RL policies: a tiny GPT-2 and a tiny Llama built
here (random weights, a BPE tokenizer trained here, nothing downloaded) go through the
whole protocol: policy bytes, seeded sampling, proofs on the LM head's input, the
validator's check_batch, and the learner's GRPO step."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from covey.bench.rl_hf_verify import make_hf_policy  # a random-init GPT-2 / Llama dir
from covey.rl import policy as pol
from covey.rl.batch import RolloutSpec, Sample, check_batch, rollout
from covey.rl.hf_policy import hf_newline_id
from covey.rl.learn import LearnConfig, Learner, pass_at_1
from covey.rl.loss import LossConfig
from covey.rl.sampling import forward_hidden
from covey.rl.tasks import ArithmeticTask

ARCHS = ("gpt2", "llama")


@pytest.fixture(scope="module", params=ARCHS)
def hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(descriptor, model, spec, task) of one tiny HF policy."""
    d = make_hf_policy(tmp_path_factory.mktemp("hf") / request.param, request.param)
    desc, model = pol.load_policy_dir(f"hf:{d}")
    spec = RolloutSpec("run-hf", 2, 4, 1.0, 6, desc["vocab_size"], hf_newline_id(desc))
    return desc, model, spec, ArithmeticTask()


def _batch(hf, gen_batch: int = 8, model=None, worker: str = "w1"):
    desc, policy, spec, task = hf
    return rollout(
        model or policy,
        task,
        spec,
        step=3,
        worker_id=worker,
        policy_version=3,
        policy_cid="cid",
        gen_batch=gen_batch,
        **pol.codec_kwargs(desc),
    )


def _check(hf, batch, model=None):
    desc, policy, spec, task = hf
    return check_batch(
        batch,
        spec=spec,
        submitter=batch.worker_id,
        step=3,
        policy_cid="cid",
        model=model or policy,
        task=task,
        **pol.codec_kwargs(desc),
    )


def test_descriptor_round_trips_and_refuses_code(hf, tmp_path: Path) -> None:
    desc, model, _spec, _task = hf
    data = pol.policy_bytes(model)
    again = pol.load_weights(pol.build_policy(json.loads(json.dumps(desc))), data)
    assert pol.policy_bytes(again) == data  # a peer rebuilds the same policy from the spec
    assert pol.config_of(desc)["config"]["model_type"] in ARCHS
    for bad in (
        {**desc, "config": {**desc["config"], "model_type": "bert"}},
        {**desc, "config": {**desc["config"], "auto_map": {"AutoModel": "x.Y"}}},
        {**desc, "tokenizer_sha256": "0" * 64},
        {**desc, "vocab_size": desc["vocab_size"] + 1},
    ):
        with pytest.raises(pol.PolicyError):
            pol.build_policy(bad)
    with pytest.raises(pol.PolicyError, match=r"config\.json"):
        pol.load_policy_dir(f"hf:{tmp_path}")


def test_hidden_state_is_the_final_norms_output(hf) -> None:
    """The proofs commit to what covey GPT's ln_f gives: the LM head's input, which is
    transformers' hidden_states[-1] (after the final norm) and gives the logits."""
    _desc, model, _spec, _task = hf
    ids = torch.tensor([[5, 17, 40, 3, 9]])
    logits, hidden = forward_hidden(model, ids)
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    assert torch.equal(hidden, out.hidden_states[-1].float())
    head = model.get_output_embeddings()
    assert torch.allclose(head(hidden), logits, atol=1e-5)


def test_tokenizer_codec_and_eos(hf) -> None:
    desc, _model, spec, _task = hf
    encode, decode = pol.text_codec(desc)
    ids = encode("12+7=")
    bos = desc["config"]["model_type"] == "llama"
    assert decode(ids) == "12+7=" and len(ids) < len("12+7=") + bos  # merged BPE tokens
    assert decode([spec.eos_id]) == "\n"
    if desc["config"]["model_type"] == "llama":
        assert ids[0] == 0  # the BOS the tokenizer's post-processor adds


@pytest.mark.parametrize(("threads", "gen_batch"), [(1, 1), (2, 4)])
def test_honest_batch_is_accepted_on_1_and_2_threads(hf, threads: int, gen_batch: int) -> None:
    """Generated one at a time or G at once, on 1 or 2 threads; checked with prefill
    batches of 4 (check_batch's default)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        verdict = _check(hf, _batch(hf, gen_batch))
        assert verdict.ok, verdict
    finally:
        torch.set_num_threads(before)


def test_cheats_on_an_hf_policy_are_rejected(hf) -> None:
    desc, model, _spec, _task = hf
    honest = _batch(hf)
    perturbed = pol.build_policy(desc)
    with torch.no_grad():
        for p, q in zip(perturbed.parameters(), model.parameters(), strict=True):
            p.copy_(q * (1 + 1e-3 * torch.randn_like(q)))
    assert _check(hf, _batch(hf, model=perturbed)).problem.value == "proof"
    bf16 = pol.build_policy(desc)
    bf16.load_state_dict({k: v.bfloat16().float() for k, v in model.state_dict().items()})
    v = _check(hf, _batch(hf, model=bf16))
    assert not v.ok and v.problem.value in ("proof", "sampling", "logprobs"), v
    s = honest.samples[0]
    edited = [(s.tokens[0] + 1) % desc["vocab_size"], *s.tokens[1:]]
    forged = honest.model_copy(
        update={"samples": [Sample(**{**s.model_dump(), "tokens": edited}), *honest.samples[1:]]}
    )
    v = _check(hf, forged)
    assert not v.ok and v.problem.value in ("tokens", "reward", "proof", "sampling"), v


def test_learner_step_moves_toward_rewarded_samples(hf) -> None:
    """One GRPO step raises the logprob of the best-rewarded samples of each group and
    lowers the worst (advantages r - mean(r))."""
    desc, model, spec, task = hf
    policy = pol.load_weights(pol.build_policy(desc), pol.policy_bytes(model))
    batch = _batch(hf)
    rewards = [float(i % 4 == 0) for i in range(len(batch.samples))]  # one winner per group
    batch = batch.model_copy(
        update={
            "samples": [
                s.model_copy(update={"reward": r})
                for s, r in zip(batch.samples, rewards, strict=True)
            ]
        }
    )
    encode, _ = pol.text_codec(desc)
    learner = Learner(
        policy,
        LearnConfig(lr=1e-2, temperature=spec.temperature, loss=LossConfig(max_tokens=6)),
        task,
        encode=encode,
    )

    def seq_logprob() -> torch.Tensor:
        logp, mask = learner._token_logprobs(*_rows(learner, batch))
        return (logp * mask).sum(1).detach()

    before = seq_logprob()
    stats = learner.step([(batch, 3)], 3)
    assert stats["updated"] == 1.0
    delta = seq_logprob() - before
    win = torch.tensor(rewards) > 0
    assert delta[win].mean() > 0 > delta[~win].mean(), delta
    assert pol.policy_bytes(policy) != pol.policy_bytes(model)


def _rows(learner: Learner, batch) -> tuple[list[list[int]], list[int], int]:
    rows, _ = learner._rows([(batch, 3)], 3)
    width = max(len(s) - p for s, p in zip(rows.seqs, rows.prompt_lens, strict=True))
    return rows.seqs, rows.prompt_lens, width


def test_pass_at_1_uses_the_policys_tokenizer(hf) -> None:
    desc, model, spec, task = hf
    score = pass_at_1(model, task, 4, eos_id=spec.eos_id, **pol.codec_kwargs(desc))
    assert 0.0 <= score <= 1.0


def test_bench_rl_learns_on_an_hf_policy(tmp_path: Path) -> None:
    """`covey bench rl --policy hf:DIR`'s learning loop runs on the policy's tokenizer."""
    from covey.bench.rl import QUICK, learning_run

    d = make_hf_policy(tmp_path / "gpt2", "gpt2")
    cfg = dataclasses.replace(QUICK, rl_steps=2, eval_every=2, eval_prompts=4, prompts_per_step=2)
    result = learning_run(cfg, tmp_path, echo=lambda _: None, policy_dir=f"hf:{d}")
    assert result["rl_steps"] == 2 and len(result["reward_per_step"]) == 2


def test_cli_refuses_a_bad_hf_policy(tmp_path: Path) -> None:
    """`covey rl trainer` and `covey bench rl` name what is wrong with a bad hf: directory
    (exit 2): a missing tokenizer.json, a model type outside the allow-list."""
    from tokenizers import Tokenizer, models
    from typer.testing import CliRunner

    from covey.cli import app
    from tests.rl_helpers import free_port

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text('{"model_type": "bert", "vocab_size": 9}')
    tok = Tokenizer(models.WordLevel({"\n": 0, "?": 1}, unk_token="?"))
    (tmp_path / "cfg" / "tokenizer.json").write_text(tok.to_str())
    runner = CliRunner()
    bad = ((f"hf:{tmp_path}/none", "tokenizer.json"), (f"hf:{tmp_path}/cfg", "not allowed"))
    for policy, why in bad:
        args = ["rl", "trainer", "--data-dir", str(tmp_path / "run"), "--policy", policy]
        result = runner.invoke(app, [*args, "--port", str(free_port())])
        assert result.exit_code == 2 and "error:" in result.output and why in result.output
    result = runner.invoke(app, ["bench", "rl", "--policy", f"hf:{tmp_path}/none"])
    assert result.exit_code == 2 and "config.json" in result.output
