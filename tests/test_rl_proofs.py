"""Proofs of inference for short completions: a partial last chunk costs proportionally
less (at most 258 bytes per 32 generated tokens at any length) and still catches weights
that are not the run's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from covey.models.gpt import GPT, GPTConfig
from covey.rl import proofs, sampling
from covey.rl.calibrate import bf16_rounded, perturbed

CFG = GPTConfig(block_size=48, vocab_size=256, n_layer=2, n_head=2, n_embd=64)
PROMPTS = [list(b"12+7="), list(b"3*14="), list(b"99-41="), list(b"5+5=")]


@pytest.fixture(scope="module")
def policy() -> GPT:
    torch.manual_seed(3)
    return GPT(CFG).eval()


@pytest.mark.parametrize("dim", [64, 96, 4096])
def test_proof_bytes_per_32_tokens_never_exceed_258(dim: int) -> None:
    for n in range(1, 200):
        assert proofs.proof_size(n, dim) * 32 <= 258 * n, (n, dim)
    assert proofs.proof_size(12, 96) == 96  # 47 values: 256 B per 32 tokens (was 258 B)
    assert proofs.proof_size(64, 96) == 2 * 258


def test_chunk_k_scales_with_the_chunk_and_refuses_bad_lengths() -> None:
    assert [proofs.chunk_k(n, 64) for n in (1, 2, 12, 31, 32)] == [3, 7, 47, 123, 128]
    assert proofs.chunk_k(1, 2) == 2  # never more values than the chunk holds
    for bad in (0, 33):
        with pytest.raises(ValueError, match=r"1\.\.32"):
            proofs.chunk_k(bad, 64)


@pytest.mark.parametrize("n_tokens", [1, 3, 12, 40])
def test_short_honest_proof_verifies_on_1_and_2_threads(policy: GPT, n_tokens: int) -> None:
    before = torch.get_num_threads()
    try:
        for i, prompt in enumerate(PROMPTS):
            gen = sampling.generate(policy, prompt, n_tokens, 1.0, seed=100 + i)
            proof = proofs.build_proof(gen.hidden)
            assert len(proof) == proofs.proof_size(n_tokens, CFG.n_embd)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                verdict = proofs.verify_proof(policy, prompt, gen.tokens, proof)
                assert verdict.ok, (n_tokens, threads, verdict.reason)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n_tokens", [3, 12])
def test_short_proof_from_other_weights_is_rejected(policy: GPT, n_tokens: int) -> None:
    for cheat in (perturbed(policy, 1e-3), bf16_rounded(policy)):
        for i, prompt in enumerate(PROMPTS):
            gen = sampling.generate(cheat, prompt, n_tokens, 1.0, seed=200 + i)
            proof = proofs.build_proof(gen.hidden)
            verdict = proofs.verify_proof(policy, prompt, gen.tokens, proof)
            assert not verdict.ok, (n_tokens, i)
            assert "value error" in verdict.reason or "overlap" in verdict.reason


def _nudged(hidden: torch.Tensor, n: int) -> torch.Tensor:
    """`hidden` with its n largest-magnitude values moved up by one fp16 ulp."""
    out = hidden.clone()
    flat = out.reshape(-1)
    for i in torch.topk(flat.abs(), n).indices.tolist():
        half = np.float16(flat[i].item())
        flat[i] = float(np.nextafter(half, np.float16(np.inf) * np.sign(half)))
    return out


def test_partial_chunk_forgives_one_ulp_in_total_not_two(policy: GPT) -> None:
    gen = sampling.generate(policy, PROMPTS[0], 1, 1.0, seed=7)  # 1 token: 3 values
    _, hidden = sampling.prefill(policy, [PROMPTS[0] + gen.tokens])[0]
    mine = hidden[len(PROMPTS[0]) :]
    assert proofs.compare_proof(proofs.build_proof(mine), mine).chunks[0].mean_ulp == 0
    one = proofs.compare_proof(proofs.build_proof(_nudged(mine, 1)), mine)
    assert one.ok and one.chunks[0].mean_ulp == 0, one.reason
    two = proofs.compare_proof(proofs.build_proof(_nudged(mine, 2)), mine)
    assert not two.ok and "value error 0.333" in two.reason


def _dropped(hidden: torch.Tensor, n: int) -> torch.Tensor:
    """`hidden` with its n largest-magnitude values zeroed: a proof built from it misses
    those n indices of the true top-k."""
    out = hidden.clone()
    flat = out.reshape(-1)
    flat[torch.topk(flat.abs(), n).indices] = 0.0
    return out


@pytest.mark.parametrize("n_tokens, k_n", [(1, 3), (2, 7)])
def test_partial_chunk_forgives_two_missed_indices_not_three(
    policy: GPT, n_tokens: int, k_n: int
) -> None:
    gen = sampling.generate(policy, PROMPTS[1], n_tokens, 1.0, seed=9)
    _, hidden = sampling.prefill(policy, [PROMPTS[1] + gen.tokens])[0]
    mine = hidden[len(PROMPTS[1]) :]
    assert proofs.chunk_k(n_tokens, CFG.n_embd) == k_n
    two = proofs.compare_proof(proofs.build_proof(_dropped(mine, 2)), mine)
    assert two.ok and two.chunks[0].overlap == 1.0, two.reason
    three = proofs.compare_proof(proofs.build_proof(_dropped(mine, 3)), mine)
    assert not three.ok and "overlap" in three.reason
    other = sampling.generate(policy, PROMPTS[2], n_tokens, 1.0, seed=9)  # other states
    forged = proofs.compare_proof(proofs.build_proof(other.hidden), mine)
    assert not forged.ok and forged.chunks[0].overlap < 0.9
