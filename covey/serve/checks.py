"""The check of one served answer, the same for a validator and the server's referee: one
prefill of prompt + tokens through the request's sampler (covey.serve.model.sampler),
then

1. the answer's shape: at most max_tokens tokens; an end-of-sequence token only last; no
   end-of-sequence token means exactly max_tokens tokens (a worker may not stop early);
2. every token is the argmax of logits / T + the Gumbel noise regenerated from the job's
   seed at its position (a streamed answer's segments each from their own seed,
   `segment_seed`) (covey.rl.sampling.sampling_scores, within SAMPLING_TOLERANCE):
   edited tokens, another seed, temperature or top_p, another model;
3. the inference proof (covey.rl.proofs.compare_proof) against the recomputed hidden states:
   other weights (a perturbed or quantized copy), another model, other hidden states.

A verdict is data, never an exception: a malformed proof is a failed check.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from covey.rl.proofs import ProofThresholds, compare_proof
from covey.rl.sampling import SAMPLING_TOLERANCE, prefill, sampling_scores
from covey.serve.model import sampler


def segment_seed(seed: int, index: int) -> int:
    """The sampling seed of a streamed answer's segment `index` (the job's own seed for the
    first): each segment is one covey.rl.sampling.generate_batch call, whose noise
    positions start at 0, so each needs noise of its own."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"covey-serve-segment|{seed}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def segments(n_tokens: int, segment: int) -> list[tuple[int, int]]:
    """(start, end) of each segment of an answer of `n_tokens` (one when `segment` is 0)."""
    size = segment or max(1, n_tokens)
    return [(a, min(a + size, n_tokens)) for a in range(0, n_tokens, size)]


@dataclass(frozen=True)
class AnswerVerdict:
    ok: bool
    problem: str | None = None  # "shape", "sampling" or "proof"
    detail: str = ""


def check_shape(tokens: list[int], max_tokens: int, eos_id: int | None) -> str | None:
    """Why `tokens` cannot be an honest answer to a job of `max_tokens`, or None."""
    if not tokens:
        return "an empty answer"
    if len(tokens) > max_tokens:
        return f"{len(tokens)} tokens, more than max_tokens {max_tokens}"
    if eos_id is not None and eos_id in tokens[:-1]:
        return f"end-of-sequence at position {tokens.index(eos_id)}, before the last token"
    ended = eos_id is not None and tokens[-1] == eos_id
    if not ended and len(tokens) < max_tokens:
        return f"stopped after {len(tokens)} of {max_tokens} tokens without end-of-sequence"
    return None


@torch.no_grad()
def check_answer(
    model: nn.Module,
    job: dict[str, Any],
    tokens: list[int],
    proof: bytes,
    thresholds: ProofThresholds | None = None,
) -> AnswerVerdict:
    """The verdict on `tokens` and `proof` as the answer to `job` (its prompt_ids,
    max_tokens, temperature, top_p, seed, eos_id) under `model`."""
    shape = check_shape(tokens, int(job["max_tokens"]), job.get("eos_id"))
    if shape is not None:
        return AnswerVerdict(False, "shape", shape)
    prompt = list(job["prompt_ids"])
    vocab = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]
    if any(not 0 <= t < vocab for t in prompt + tokens):
        return AnswerVerdict(False, "shape", f"a token id outside the vocabulary of {vocab}")
    temperature, top_p = float(job["temperature"]), float(job["top_p"])
    lm = sampler(model, top_p, temperature)
    logits, hidden = prefill(lm, [prompt + tokens])[0]
    first = len(prompt) - 1  # the logits at position i predict token i + 1
    seed, gaps = int(job["seed"]), []
    for index, (a, b) in enumerate(segments(len(tokens), int(job.get("segment") or 0))):
        scores = sampling_scores(
            logits[first + a : first + b], tokens[a:b], segment_seed(seed, index), temperature
        )
        gaps.append(scores.gap)
    gap = torch.cat(gaps)
    bad = (gap > SAMPLING_TOLERANCE).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        return AnswerVerdict(
            False,
            "sampling",
            f"{len(bad)} of {len(tokens)} tokens are not the seeded draw (first at {i}: "
            f"gap {float(gap[i]):.3g})",
        )
    verdict = compare_proof(proof, hidden[len(prompt) :], thresholds or ProofThresholds())
    if not verdict.ok:
        return AnswerVerdict(False, "proof", verdict.reason)
    return AnswerVerdict(True)
