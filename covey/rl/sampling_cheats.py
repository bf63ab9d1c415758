"""Sampling cheats: rollout workers that decode some samples their own way, written apart
from the honest worker (no call into covey.rl.sampling.generate_batch or covey.rl.batch's
rollout for the altered samples: a decoding loop of its own over the policy's logits).

`SAMPLING_CHEATS[kind](setting, seed, altered)` returns the batch a worker submits when it
decodes `altered` of its samples (the first ones; all when None) by the rule `kind`, and the
rest honestly:

    temperature   the seeded Gumbel noise, at 0.8x the run's temperature
    top_k         the seeded noise over the 8 most likely tokens only
    top_p         the seeded noise over the nucleus of 0.9 probability only
    greedy        the most likely token, no noise
    logit_bias    the seeded noise after +0.5 on the logits of the digits 0-9
    best_of_n     4 completions from the worker's own random seeds, the best-rewarded kept

Every altered sample is the strongest such a worker can send: its logprobs, its proof and
its reward are recomputed under the real policy (covey.rl.cheats.forge_sample), so only
the check of each token against the seeded draw can tell. Adversary code: honest modules
never import it (tests/test_layers.py); `covey bench trust --only rl-sampling` measures it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from covey.rl import sampling
from covey.rl.batch import RolloutBatch, byte_decode, byte_encode, completion_text
from covey.rl.cheats import Setting, forge_sample

Rule = Callable[[torch.Tensor, torch.Tensor, float], int]  # (logits, noise, T) -> token
DIGITS = torch.tensor([ord(c) for c in "0123456789"])


def _temperature(logits: torch.Tensor, noise: torch.Tensor, t: float) -> int:
    return int(torch.argmax(logits / (0.8 * t) + noise))


def _top_k(logits: torch.Tensor, noise: torch.Tensor, t: float, k: int = 8) -> int:
    kept = torch.full_like(logits, -torch.inf)
    top = torch.topk(logits, min(k, logits.numel())).indices
    kept[top] = logits[top]
    return int(torch.argmax(kept / t + noise))


def _top_p(logits: torch.Tensor, noise: torch.Tensor, t: float, p: float = 0.9) -> int:
    probs = torch.softmax(logits / t, dim=-1)
    order = torch.argsort(probs, descending=True)
    before = torch.cumsum(probs[order], dim=0) - probs[order]  # mass ahead of each token
    kept = torch.full_like(logits, -torch.inf)
    nucleus = order[before < p]
    kept[nucleus] = logits[nucleus]
    return int(torch.argmax(kept / t + noise))


def _greedy(logits: torch.Tensor, _noise: torch.Tensor, _t: float) -> int:
    return int(torch.argmax(logits))


def _logit_bias(logits: torch.Tensor, noise: torch.Tensor, t: float) -> int:
    biased = logits.clone()
    biased[DIGITS[logits.numel() > DIGITS]] += 0.5
    return int(torch.argmax(biased / t + noise))


@torch.no_grad()
def decode(h: Setting, prompt: list[int], seed: int, rule: Rule) -> list[int]:
    """Tokens after `prompt` chosen by `rule` from the policy's last-position logits and
    the Gumbel noise of (`seed`, position), one full forward per token; stops at eos."""
    spec, tokens = h.spec, []
    device = next(h.policy.parameters()).device
    for i in range(spec.max_new_tokens):
        ids = torch.tensor([prompt + tokens], device=device)
        logits, _ = sampling.forward_hidden(h.policy, ids)
        last = logits[0, -1].float().cpu()
        tokens.append(rule(last, sampling.gumbel_noise(seed, i, last.numel()), spec.temperature))
        if tokens[-1] == spec.eos_id:
            break
    return tokens


def _by_rule(rule: Rule) -> Callable[[Setting, list[int], int, int, random.Random], list[int]]:
    def tokens(h: Setting, prompt: list[int], _index: int, seed: int, _rng: random.Random):
        return decode(h, prompt, seed, rule)

    return tokens


def _best_of_n(
    h: Setting, prompt: list[int], index: int, _seed: int, rng: random.Random, n: int = 4
) -> list[int]:
    """n completions under the worker's own seeds; the one the task rewards most."""
    candidates = [decode(h, prompt, rng.getrandbits(63), _honest_rule) for _ in range(n)]
    return max(
        candidates,
        key=lambda t: h.task.reward(index, completion_text(t, h.spec.eos_id, byte_decode)),
    )


def _honest_rule(logits: torch.Tensor, noise: torch.Tensor, t: float) -> int:
    return int(torch.argmax(logits / t + noise))


def _cheat(tokens_of: Callable[..., list[int]]) -> Callable[..., RolloutBatch]:
    def cheat(h: Setting, seed: int = 0, altered: int | None = None) -> RolloutBatch:
        honest = h.honest()
        rng, g = random.Random(seed), h.spec.group_size
        samples = list(honest.samples)
        for i in range(len(samples) if altered is None else min(altered, len(samples))):
            index = honest.prompt_indices[i // g]
            prompt = byte_encode(h.task.prompt(index))
            draw = sampling.sample_seed(h.spec.run_id, h.step, h.worker_id, index, i % g)
            tokens = tokens_of(h, prompt, index, draw, rng)
            samples[i] = forge_sample(h.policy, h.spec, h.task, index, prompt, tokens)
        return honest.model_copy(update={"samples": samples})

    return cheat


SAMPLING_CHEATS: dict[str, Callable[..., RolloutBatch]] = {
    "temperature": _cheat(_by_rule(_temperature)),
    "top_k": _cheat(_by_rule(_top_k)),
    "top_p": _cheat(_by_rule(_top_p)),
    "greedy": _cheat(_by_rule(_greedy)),
    "logit_bias": _cheat(_by_rule(_logit_bias)),
    "best_of_n": _cheat(_best_of_n),
}
