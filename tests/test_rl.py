"""covey.rl's pure core: seeded sampling, proofs, GRPO loss, tasks, batch checks."""

from __future__ import annotations

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
