"""Generation with covey GPT's KV cache picks the tokens the prefix-rerunning generation
picks for the same seeds, with the same log-probabilities and hidden states up to float
rounding; the cache's attention equals full causal attention."""

from __future__ import annotations

import pytest
import torch

from covey.models.gpt import GPT, GPTConfig, KVCache
from covey.rl import sampling


class Uncached(torch.nn.Module):
    """The same GPT behind a wrapper that is not a GPT: `generate_batch` then takes the
    path without a cache (rerun the prefix every step), today's generation."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids: torch.Tensor, **_: object) -> object:
        logits = self.gpt(input_ids)
        return type("Out", (), {"logits": logits})()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.gpt.lm_head


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=97, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()


def test_cached_attention_is_full_causal_attention() -> None:
    model = _model()
    ids = torch.randint(0, 97, (3, 11))
    full = model(ids)
    cache = KVCache(model, 3, 20)
    first = model(ids[:, :6], cache)
    cache.advance(6)
    rest = []
    for t in range(6, 11):
        rest.append(model(ids[:, t : t + 1], cache))
        cache.advance(1)
    stepped = torch.cat([first, *rest], dim=1)
    torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eos", [None, 40])  # 40 ends one row after 6 tokens
def test_cached_generation_picks_the_uncached_tokens(eos: int | None) -> None:
    model = _model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 9, 1, 6)]
    seeds = [sampling.sample_seed("run", 0, "w", i, 0) for i in range(len(prompts))]
    cached = sampling.generate_batch(model, prompts, 12, 0.9, seeds, eos_id=eos)
    plain = sampling.generate_batch(Uncached(model), prompts, 12, 0.9, seeds, eos_id=eos)
    for a, b in zip(cached, plain, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-5, atol=1e-5)
    assert any(len(a.tokens) == 12 for a in cached)
    assert eos is None or any(len(a.tokens) < 12 for a in cached)  # rows that end early
    one = sampling.generate(model, prompts[1], 12, 0.9, seeds[1], eos_id=eos)
    assert one.tokens == cached[1].tokens  # alone or batched: the same tokens


def test_cached_generation_past_the_context_is_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="exceeds block_size"):
        sampling.generate_batch(model, [[1] * 40], 20, 1.0, [7])


class HFUncached(torch.nn.Module):
    """A Hugging Face causal LM behind a wrapper without `config`: `generate_batch` reruns
    the prefix every step (no past_key_values), as it did before the cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, **_: object) -> object:
        return self.model(input_ids=input_ids, use_cache=False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_generation_with_past_key_values_picks_the_uncached_tokens(arch: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    common = {"vocab_size": 97, "bos_token_id": 0, "eos_token_id": 1}
    if arch == "gpt2":
        config = AutoConfig.for_model(
            "gpt2", n_positions=48, n_embd=32, n_layer=2, n_head=2, **common
        )
    else:
        config = AutoConfig.for_model(
            "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
            **common,
        )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 97, (n,), generator=g).tolist() for n in (3, 9, 1, 6)]
    seeds = [sampling.sample_seed("run", 1, "w", i, 0) for i in range(len(prompts))]
    cached = sampling.generate_batch(model, prompts, 10, 0.8, seeds, eos_id=5)
    plain = sampling.generate_batch(HFUncached(model), prompts, 10, 0.8, seeds, eos_id=5)
    for a, b in zip(cached, plain, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-4, atol=1e-5)
