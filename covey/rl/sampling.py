"""Seeded sampling that a validator can re-check token by token.

The token at generated position i is argmax(logits_i / T + g_i), the Gumbel-max trick
(sampling from softmax(logits / T) exactly), where the Gumbel noise g_i comes from a
torch.Generator seeded by sha256(seed, i). The seed itself is a hash of
(run, step, worker, prompt index, sample index), so a worker cannot choose its noise, and a
validator regenerates the noise of any position without the others.

Works with covey's GPT (the hidden state is the output of `ln_f`, the input of the LM head)
and with a Hugging Face causal LM (the input of its LM head: the final norm's output, which
is transformers' `hidden_states[-1]`).
covey's GPT and Hugging Face causal LMs generate with their cache (covey/rl/decoding.py:
covey GPT's `KVCache`, transformers' `past_key_values`): one prefill of the right-padded
prompts, then one token per row per step. A duck-typed model without an output embedding
reruns the prefix each step. Either way the hidden state kept for position j is the one
computed when j was the last position, as an incremental decoder produces it.

The noise is drawn on the host from the CPU generator seeded per (seed, position) (the
same values on every machine: CUDA's generator streams differ from the CPU's), for all rows
of a step at once, and crosses to the logits' device in one non-blocking copy from pinned
memory; the argmax and log-softmax run there, and one list of token ids per step comes
back. The tokens are today's for a given seed: the same noise, added to the same logits up
to float rounding (tests/test_rl_cache.py compares generation with and without the cache).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch
from torch import nn

from covey.models.gpt import GPT
from covey.rl.decoding import Decoder, capture, decoder_for


def _h64(*parts: object) -> int:
    text = "|".join(str(p) for p in parts).encode()
    return struct.unpack(">Q", hashlib.sha256(text).digest()[:8])[0]


def sample_seed(
    run_id: str, step: int, worker_id: str, prompt_index: int, sample_index: int
) -> int:
    """The 64-bit sampling seed of one completion: sha256 of the five fields."""
    return _h64("covey-rl-sample", run_id, step, worker_id, prompt_index, sample_index)


def gumbel_noise(
    seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Standard Gumbel noise (float32, shape (vocab_size,), on `device`) for one generated
    position.

    Depends only on (seed, position): a validator regenerates any position on its own.
    Always drawn on the CPU (torch.Generator streams differ between CPU and CUDA) and then
    moved, so a GPU worker and a CPU validator add the same noise to the same logits."""
    g = torch.Generator().manual_seed(_h64("covey-rl-gumbel", seed, position))
    u = torch.rand(vocab_size, generator=g, dtype=torch.float64)
    u = u.clamp_(1e-12, 1.0 - 1e-12)
    return (-torch.log(-torch.log(u))).float().to(device)


def forward_hidden(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) token ids -> (logits (B, L, V) float32, last hidden states (B, L, D) float32).

    Right padding is safe: attention is causal, so a position never sees later pads."""
    if isinstance(model, GPT):
        captured, handle = capture(model.ln_f, pre=False)  # this thread's forward only
        try:
            logits = model(ids)
        finally:
            handle.remove()
        return logits.float(), captured[0].float()
    # A Hugging Face causal LM: the input of its LM head, i.e. the final norm's output, as
    # for covey's GPT (transformers' hidden_states[-1] is the same tensor for the models
    # covey admits, tests/test_rl_hf.py checks it; the hook does not depend on that).
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):  # a duck-typed causal LM: its last hidden state
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        return out.logits.float(), out.hidden_states[-1].float()
    inputs, handle = capture(head, pre=True)
    try:
        out = model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return out.logits.float(), inputs[0].float()


@dataclass(frozen=True)
class Generation:
    """One seeded completion: `tokens` (generated ids, eos included if reached),
    `logprobs` (log-softmax at temperature T of each generated token, float32, (n,)),
    `hidden` (last hidden state at each generated token's position, float32, (n, D))."""

    tokens: list[int]
    logprobs: torch.Tensor
    hidden: torch.Tensor


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_id: int | None = None,
) -> Generation:
    """Generate up to `max_new_tokens` tokens after `prompt_ids` with seeded Gumbel-max
    sampling; stops after `eos_id`. ValueError on an empty prompt or T <= 0."""
    return generate_batch(model, [prompt_ids], max_new_tokens, temperature, [seed], eos_id)[0]


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seeds: list[int],
    eos_id: int | None = None,
) -> list[Generation]:
    """`generate` for several prompts at once (one seed each): every step is one forward of
    the unfinished sequences, right-padded (causal attention: pads never reach real
    positions). Sampling runs on the model's device (only each token id comes to the
    host, to extend its sequence); `logprobs` and `hidden` stay on that device.
    The tokens are the ones one-at-a-time generation picks, up to float noise from the
    different shapes, which the validator's tolerances absorb. ValueError on an
    empty prompt, T <= 0 or a seed count that differs from the prompt count."""
    _check_temperature(temperature)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    if any(not p for p in prompts):
        raise ValueError("prompt_ids is empty")
    device = next(model.parameters()).device
    size = max(len(p) for p in prompts) + max_new_tokens
    decoder = decoder_for(model, len(prompts), size)
    if decoder is not None:
        return _generate_cached(
            decoder, prompts, max_new_tokens, temperature, seeds, eos_id, device
        )
    seqs = [list(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[torch.Tensor]] = [[] for _ in prompts]
    hidden: list[list[torch.Tensor]] = [[] for _ in prompts]
    live = list(range(len(prompts))) if max_new_tokens > 0 else []
    for i in range(max_new_tokens + 1):
        if not live:
            break
        width = max(len(seqs[r]) for r in live)
        ids = torch.tensor([seqs[r] + [0] * (width - len(seqs[r])) for r in live], device=device)
        logits, h = forward_hidden(model, ids)
        still = []
        for row, r in enumerate(live):
            last = len(seqs[r]) - 1
            if i > 0:  # hidden state of the previous generated token, now the last position
                hidden[r].append(h[row, last])
            if len(tokens[r]) == max_new_tokens or (
                eos_id is not None and tokens[r][-1:] == [eos_id]
            ):
                continue  # done: this pass only collected its last token's hidden state
            scaled = logits[row, last] / temperature
            noise = gumbel_noise(seeds[r], i, scaled.numel(), scaled.device)
            tok = int(torch.argmax(scaled + noise))
            logprobs[r].append(torch.log_softmax(scaled, dim=-1)[tok])
            tokens[r].append(tok)
            seqs[r].append(tok)
            still.append(r)
        live = still  # one that just emitted eos stays for one pass: its last hidden state
    out = []
    for r in range(len(prompts)):
        d = hidden[r][0].numel() if hidden[r] else 0
        out.append(
            Generation(
                tokens=tokens[r],
                logprobs=torch.stack(logprobs[r]) if logprobs[r] else torch.zeros(0, device=device),
                hidden=torch.stack(hidden[r]) if hidden[r] else torch.zeros(0, d, device=device),
            )
        )
    return out


def _step_noise(
    seeds: list[int], position: int, rows: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """(len(rows), vocab) Gumbel noise of `position` for those rows, drawn on the host
    (`gumbel_noise`'s values) and copied to `device` once, from pinned memory on CUDA."""
    noise = torch.stack([gumbel_noise(seeds[r], position, vocab) for r in rows])
    if device.type == "cuda":
        return noise.pin_memory().to(device, non_blocking=True)
    return noise.to(device)


def _generate_cached(
    decoder: Decoder,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seeds: list[int],
    eos_id: int | None,
    device: torch.device,
) -> list[Generation]:
    """`generate_batch` with the model's cache (covey/rl/decoding.py): a prefill of the
    right-padded prompts, then every row's last token at its own position."""
    n = len(prompts)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=device)
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[torch.Tensor]] = [[] for _ in prompts]
    hidden: list[list[torch.Tensor]] = [[] for _ in prompts]
    live = list(range(n)) if max_new_tokens > 0 else []
    moving = torch.ones(n, dtype=torch.bool, device=device)
    for i in range(max_new_tokens + 1):
        if not live:
            break
        longest = max(lengths[r] + len(tokens[r]) for r in live)
        if decoder.max_positions is not None and longest > decoder.max_positions:
            raise ValueError(  # as the model says without a cache
                f"sequence length {longest} exceeds block_size {decoder.max_positions}"
            )
        if i == 0:
            logits, h = decoder.prefill(ids, torch.tensor(lengths, device=device))
        else:
            logits, h = decoder.step(ids, moving)
        sampling = []
        for r in live:
            if i > 0:  # hidden state of the previous generated token, now the last position
                hidden[r].append(h[r])
            if len(tokens[r]) < max_new_tokens and not (
                eos_id is not None and tokens[r][-1:] == [eos_id]
            ):
                sampling.append(r)
        if not sampling:
            break
        rows = torch.tensor(sampling, device=device)
        scaled = logits[rows] / temperature
        noise = _step_noise(seeds, i, sampling, scaled.shape[-1], device)
        picked = torch.argmax(scaled + noise, dim=-1)
        lp = torch.log_softmax(scaled, dim=-1).gather(1, picked[:, None])[:, 0]
        for j, (r, tok) in enumerate(zip(sampling, picked.tolist(), strict=True)):  # the sync
            logprobs[r].append(lp[j])
            tokens[r].append(tok)
        ids = torch.zeros(n, 1, dtype=torch.long, device=device)
        ids[rows, 0] = picked
        # the rows sampled now are fed next; the others are done and stay where they are
        moving = torch.zeros(n, dtype=torch.bool, device=device)
        moving[rows] = True
        live = sampling  # one that just emitted eos stays for one pass: its last hidden state
    return [_generation(tokens[r], logprobs[r], hidden[r], device) for r in range(n)]


def _generation(
    tokens: list[int],
    logprobs: list[torch.Tensor],
    hidden: list[torch.Tensor],
    device: torch.device,
) -> Generation:
    d = hidden[0].numel() if hidden else 0
    return Generation(
        tokens=tokens,
        logprobs=torch.stack(logprobs) if logprobs else torch.zeros(0, device=device),
        hidden=torch.stack(hidden) if hidden else torch.zeros(0, d, device=device),
    )


@dataclass(frozen=True)
class SamplingCheck:
    """Per generated position: `agree` (the token is the argmax of the perturbed scores, or
    within `tolerance` of it), `gap` (best perturbed score minus the token's, >= 0),
    `logprobs` (recomputed log-softmax at T of each token). `mismatches` counts disagreements."""

    agree: torch.Tensor
    gap: torch.Tensor
    logprobs: torch.Tensor

    @property
    def mismatches(self) -> int:
        return int((~self.agree).sum())


def sampling_scores(
    logits: torch.Tensor, tokens: list[int], seed: int, temperature: float
) -> SamplingCheck:
    """The sampling check on the logits (n, V) that predicted each of the n `tokens`,
    with no tolerance (gap > 0 means the token was not the argmax)."""
    scaled = logits.float().cpu() / temperature
    idx = torch.tensor(tokens, dtype=torch.long)
    noise = torch.stack([gumbel_noise(seed, i, scaled.shape[-1]) for i in range(len(tokens))])
    perturbed = scaled + noise
    gap = perturbed.max(dim=-1).values - perturbed.gather(1, idx[:, None])[:, 0]
    lp = torch.log_softmax(scaled, dim=-1).gather(1, idx[:, None])[:, 0]
    return SamplingCheck(agree=gap <= 0, gap=gap, logprobs=lp)


# A token counts as a mismatch only when the claimed token's perturbed score is more than
# this far below the best one. Honest recomputation noise in fp32 is ~1e-5 in the scores;
# see `python -m covey.rl.calibrate`.
SAMPLING_TOLERANCE = 1e-3


@torch.no_grad()
def check_sampling(
    model: nn.Module,
    prompt: list[int],
    tokens: list[int],
    seed: int,
    temperature: float,
    tolerance: float = SAMPLING_TOLERANCE,
) -> SamplingCheck:
    """Re-check every generated token with one prefill of prompt + tokens: each must be the
    argmax of logits/T + the regenerated noise, up to `tolerance` in the perturbed scores."""
    _check_temperature(temperature)
    if not tokens:
        return SamplingCheck(torch.zeros(0, dtype=torch.bool), torch.zeros(0), torch.zeros(0))
    device = next(model.parameters()).device
    logits, _ = forward_hidden(model, torch.tensor([prompt + tokens[:-1]], device=device))
    raw = sampling_scores(logits[0, len(prompt) - 1 :], tokens, seed, temperature)
    return SamplingCheck(agree=raw.gap <= tolerance, gap=raw.gap, logprobs=raw.logprobs)


@torch.no_grad()
def prefill(
    model: nn.Module, sequences: list[list[int]], pad_id: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batched forward of `sequences`, right-padded with `pad_id` (causal attention: pads
    never reach real positions) -> per sequence (logits (L, V), hidden (L, D)), float32, CPU."""
    if not sequences or any(not s for s in sequences):
        raise ValueError("prefill needs non-empty sequences")
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences], device=device)
    logits, hidden = forward_hidden(model, ids)
    return [(logits[i, : len(s)].cpu(), hidden[i, : len(s)].cpu()) for i, s in enumerate(sequences)]
