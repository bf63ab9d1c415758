"""The rollout batch a worker submits, and the checks a validator runs on it.

A batch holds, for step s of a run, the worker's assigned prompt indices and G samples per
prompt (prompt-major order), each with its tokens, per-token logprobs, reward and proof
(base64). `check_batch` returns a typed verdict naming the FIRST problem found, cheapest
checks first: (c) the prompts are exactly the assigned ones with all G samples; token
sanity; (d) rewards recomputed by the task; then one batched prefill of the checked
sequences for (a) the proof and (b) the seeded sampling and the claimed logprobs.

The run's parameters (temperature, G, token budget) come from the validator's own
`RolloutSpec`, never from the batch: a batch cannot choose its own rules.
"""

from __future__ import annotations

import base64
import binascii
import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from covey.rl import proofs, sampling
from covey.rl.tasks import Task, assigned_prompts

MAX_SAMPLES = 4096  # per batch
MAX_COMPLETION_TOKENS = 4096  # per sample
MAX_PROOF_CHARS = 4 * (MAX_COMPLETION_TOKENS // proofs.CHUNK + 1) * 260 // 3 + 4


class Sample(BaseModel):
    """One completion: generated token ids, their logprobs at the run's temperature, the
    reward the worker computed and its proof (base64 of `proofs.build_proof`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tokens: list[int] = Field(max_length=MAX_COMPLETION_TOKENS)
    logprobs: list[float] = Field(max_length=MAX_COMPLETION_TOKENS)
    reward: float
    proof: str = Field(max_length=MAX_PROOF_CHARS)

    @field_validator("proof")
    @classmethod
    def _base64(cls, value: str) -> str:
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"proof is not base64: {exc}") from exc
        return value

    def proof_bytes(self) -> bytes:
        return base64.b64decode(self.proof)


class RolloutBatch(BaseModel):
    """One worker's submission for one step of one run."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    run_id: str = Field(min_length=1, max_length=200)
    step: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    policy_cid: str = Field(min_length=1, max_length=200)  # content id of the policy blob
    worker_id: str = Field(min_length=1, max_length=200)
    prompt_indices: list[int] = Field(max_length=MAX_SAMPLES)
    group_size: int = Field(ge=1, le=MAX_SAMPLES)
    samples: list[Sample] = Field(max_length=MAX_SAMPLES)


@dataclass(frozen=True)
class RolloutSpec:
    """The run's rules, from the validator's frozen run config."""

    run_id: str
    prompts_per_step: int
    group_size: int
    temperature: float
    max_new_tokens: int
    vocab_size: int
    eos_id: int | None = None
    logprob_tolerance: float = 1e-3  # honest recomputation differs by ~1e-6 in fp32


class Problem(enum.Enum):
    WRONG_RUN = "wrong_run"
    WRONG_STEP = "wrong_step"
    WRONG_POLICY = "wrong_policy"
    PROMPTS = "prompts"  # not the assigned prompts, or some skipped
    GROUP = "group"  # wrong G or samples missing
    TOKENS = "tokens"  # out of vocabulary, too long, stops early without eos
    REWARD = "reward"
    PROOF = "proof"
    SAMPLING = "sampling"
    LOGPROBS = "logprobs"


@dataclass(frozen=True)
class BatchVerdict:
    ok: bool
    problem: Problem | None = None
    detail: str = ""
    sample: int | None = None  # index into batch.samples, when one sample is at fault


def byte_encode(text: str) -> list[int]:
    return list(text.encode())


def byte_decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


def _bad(problem: Problem, detail: str, sample: int | None = None) -> BatchVerdict:
    return BatchVerdict(False, problem, detail, sample)


def _token_problem(s: Sample, spec: RolloutSpec) -> str:
    n = len(s.tokens)
    if len(s.logprobs) != n:
        return f"{len(s.logprobs)} logprobs for {n} tokens"
    if not 1 <= n <= spec.max_new_tokens:
        return f"{n} tokens, allowed 1..{spec.max_new_tokens}"
    if any(not 0 <= t < spec.vocab_size for t in s.tokens):
        return f"token out of vocabulary [0, {spec.vocab_size})"
    if spec.eos_id is not None:
        if spec.eos_id in s.tokens[:-1]:
            return "tokens continue after eos"
        if n < spec.max_new_tokens and s.tokens[-1] != spec.eos_id:
            return f"stops at {n} < {spec.max_new_tokens} tokens without eos"
    elif n != spec.max_new_tokens:
        return f"{n} tokens, the run has no eos and needs {spec.max_new_tokens}"
    return ""


def completion_text(
    tokens: list[int], eos_id: int | None, decode: Callable[[list[int]], str]
) -> str:
    """The text a reward sees: the tokens without a final eos."""
    if eos_id is not None and tokens and tokens[-1] == eos_id:
        tokens = tokens[:-1]
    return decode(tokens)


def check_batch(
    batch: RolloutBatch,
    *,
    spec: RolloutSpec,
    step: int,
    policy_cid: str,
    model: torch.nn.Module,
    task: Task,
    encode: Callable[[str], list[int]] = byte_encode,
    decode: Callable[[list[int]], str] = byte_decode,
    verify_samples: list[int] | None = None,
    thresholds: proofs.ProofThresholds | None = None,
    prefill_batch: int = 4,
) -> BatchVerdict:
    """All checks on `batch` against the run's `spec`, the expected `step` and policy blob
    (`model` must be that policy). `verify_samples` picks which samples get the prefill
    checks (a)/(b) (all when None; ValueError when out of range); (c), (d) and token
    sanity run on every sample. A bad batch is a verdict, never an exception."""
    thresholds = thresholds or proofs.ProofThresholds()
    if batch.run_id != spec.run_id:
        return _bad(Problem.WRONG_RUN, f"run {batch.run_id!r}, expected {spec.run_id!r}")
    if batch.step != step:
        return _bad(Problem.WRONG_STEP, f"step {batch.step}, expected {step}")
    if batch.policy_cid != policy_cid:
        return _bad(Problem.WRONG_POLICY, f"policy {batch.policy_cid!r}, expected {policy_cid!r}")
    want = assigned_prompts(
        spec.run_id, step, batch.worker_id, spec.prompts_per_step, num_prompts=len(task)
    )
    if batch.prompt_indices != want:
        got = batch.prompt_indices
        return _bad(Problem.PROMPTS, f"prompts {got[:8]}..., assigned {want[:8]}...")
    g = spec.group_size
    if batch.group_size != g or len(batch.samples) != len(want) * g:
        return _bad(Problem.GROUP, f"{len(batch.samples)} samples with G={batch.group_size}, "
                    f"expected {len(want)} prompts x {g}")
    for i, s in enumerate(batch.samples):
        if why := _token_problem(s, spec):
            return _bad(Problem.TOKENS, why, i)
    for i, s in enumerate(batch.samples):
        reward = task.reward(want[i // g], completion_text(s.tokens, spec.eos_id, decode))
        if abs(reward - s.reward) > 1e-6:
            return _bad(Problem.REWARD, f"reward {s.reward}, recomputed {reward}", i)
    chosen = range(len(batch.samples)) if verify_samples is None else verify_samples
    prompts = {p: encode(task.prompt(p)) for p in set(want)}
    chosen = list(chosen)
    if any(not 0 <= i < len(batch.samples) for i in chosen):
        raise ValueError(f"verify_samples {chosen} out of range [0, {len(batch.samples)})")
    for start in range(0, len(chosen), prefill_batch):
        part = chosen[start : start + prefill_batch]
        seqs = [prompts[want[i // g]] + batch.samples[i].tokens for i in part]
        for i, (logits, hidden) in zip(part, sampling.prefill(model, seqs), strict=True):
            if verdict := _check_sample(batch, i, prompts[want[i // g]], logits, hidden, spec,
                                        thresholds):
                return verdict
    return BatchVerdict(True)


def _check_sample(
    batch: RolloutBatch,
    i: int,
    prompt: list[int],
    logits: torch.Tensor,
    hidden: torch.Tensor,
    spec: RolloutSpec,
    thresholds: proofs.ProofThresholds,
) -> BatchVerdict | None:
    s = batch.samples[i]
    proof = proofs.compare_proof(s.proof_bytes(), hidden[len(prompt) :], thresholds)
    if not proof.ok:
        return _bad(Problem.PROOF, proof.reason, i)
    g = spec.group_size
    seed = sampling.sample_seed(spec.run_id, batch.step, batch.worker_id,
                                batch.prompt_indices[i // g], i % g)
    check = sampling.sampling_scores(logits[len(prompt) - 1 : -1], s.tokens, seed,
                                     spec.temperature)
    bad = (check.gap > sampling.SAMPLING_TOLERANCE).nonzero()
    if bad.numel():
        pos = int(bad[0])
        return _bad(Problem.SAMPLING, f"token {pos} is {float(check.gap[pos]):.4f} below the "
                    f"seeded argmax", i)
    err = (check.logprobs - torch.tensor(s.logprobs)).abs()
    if float(err.max()) > spec.logprob_tolerance:
        return _bad(Problem.LOGPROBS, f"logprob off by {float(err.max()):.2e} at token "
                    f"{int(err.argmax())}", i)
    return None


def rollout(
    model: torch.nn.Module,
    task: Task,
    spec: RolloutSpec,
    *,
    step: int,
    worker_id: str,
    policy_version: int,
    policy_cid: str,
    encode: Callable[[str], list[int]] = byte_encode,
    decode: Callable[[list[int]], str] = byte_decode,
) -> RolloutBatch:
    """What an honest worker submits for `step`: its assigned prompts, G seeded samples
    each, rewards from `task`, and a proof per sample."""
    indices = assigned_prompts(
        spec.run_id, step, worker_id, spec.prompts_per_step, num_prompts=len(task)
    )
    samples = []
    for p in indices:
        prompt = encode(task.prompt(p))
        for j in range(spec.group_size):
            seed = sampling.sample_seed(spec.run_id, step, worker_id, p, j)
            gen = sampling.generate(model, prompt, spec.max_new_tokens, spec.temperature, seed,
                                    spec.eos_id)
            samples.append(Sample(
                tokens=gen.tokens,
                logprobs=gen.logprobs.tolist(),
                reward=task.reward(p, completion_text(gen.tokens, spec.eos_id, decode)),
                proof=base64.b64encode(proofs.build_proof(gen.hidden)).decode(),
            ))
    return RolloutBatch(run_id=spec.run_id, step=step, policy_version=policy_version,
                        policy_cid=policy_cid, worker_id=worker_id, prompt_indices=indices,
                        group_size=spec.group_size, samples=samples)
