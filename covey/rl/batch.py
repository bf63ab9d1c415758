"""The rollout batch a worker submits, and the checks a validator runs on it.

A batch holds, for step s of a run, the worker's assigned prompt indices and G samples per
prompt (prompt-major order), each with its tokens, per-token logprobs, reward and proof
(base64). `check_batch` returns a typed verdict naming the FIRST problem found, cheapest
checks first: the binding (run, the submitter's own worker id, step, policy); (c) the
prompts are exactly the assigned ones with all G samples; token sanity; (d) rewards
recomputed by the task; then one batched prefill of the checked sequences (a subset drawn
by `verified_subset` from the signed `batch_digest` and a beacon) for (a) the proof and
(b) the seeded sampling and the claimed logprobs, within `TOLERANCES[spec.precision]`.

The run's parameters (temperature, G, token budget, precision) come from the validator's
own `RolloutSpec`, never from the batch: a batch cannot choose its own rules.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import math
from collections.abc import Callable, Collection
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
    precision: str = "fp32"  # the policy's dtype on workers and validators: a key of TOLERANCES

    def __post_init__(self) -> None:
        if self.precision not in TOLERANCES:
            raise ValueError(f"precision {self.precision!r}, expected one of {list(TOLERANCES)}")


@dataclass(frozen=True)
class Tolerances:
    """How far a validator's prefill may differ from the worker's generation and still be
    honest: the proof's thresholds, the sampling gap (how far below the seeded argmax a
    token's perturbed score may be) and the largest |claimed - recomputed| logprob."""

    proof: proofs.ProofThresholds
    sampling_gap: float
    logprob: float


# Calibrated by `python -m covey.bench.rl_verify` (table in BENCHMARKS.md): honest fp32
# rollouts (generated on 1 and 2 threads, one at a time or 4/8 at once; checked on 1 and 2
# threads, prefill batch 1/4/8) reach proof overlap 1.000, mean_ulp <= 0.016, sampling gap
# 0 and logprob error <= 1e-6. The closest cheats: weights perturbed by 1e-3 relative or
# rounded to bf16, mean_ulp >= 1.57 and logprob error >= 5.7e-4; forged tokens, gap >= 5.
# Each fp32 threshold sits between the two (0.1 ulp: 6x / 16x; 1e-4: 100x / 5.7x). A bf16
# run (the policy in bf16 on both sides) is noisier: honest mean_ulp <= 8.9 (1 bf16 ulp is
# 8 fp16 ulps), overlap >= 0.977, gap <= 7e-4, logprob error <= 0.008; its row is 3.6x, 4x
# (of 1 - overlap), 140x and 6.5x above that. No cheat was measured against a bf16 run.
TOLERANCES: dict[str, Tolerances] = {
    "fp32": Tolerances(proofs.ProofThresholds(min_overlap=0.9, max_mean_ulp=0.1), 1e-3, 1e-4),
    "bf16": Tolerances(proofs.ProofThresholds(min_overlap=0.9, max_mean_ulp=32.0), 0.1, 0.05),
}


class Problem(enum.Enum):
    WRONG_RUN = "wrong_run"
    WRONG_WORKER = "wrong_worker"  # not the submitter's own batch: a replay
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


def batch_digest(batch: RolloutBatch) -> str:
    """sha256 (hex) of the batch's canonical JSON: what a worker signs. It covers the run,
    step, policy version and content id and the worker id, so a signature binds the batch
    to its submitter and step (a replayed batch carries its first worker's signature)."""
    return hashlib.sha256(b"covey-rl-batch|" + batch.model_dump_json().encode()).hexdigest()


def draw_samples(cid: str, draw: str, n: int, k: int) -> list[int]:
    """The k (of n) sample indices a validator prefills: `verified_subset` with the
    trainer's draw as the beacon."""
    return verified_subset(cid, draw, n, k)


def proof_detection(n_samples: int, k: int, bad: int) -> float:
    """The probability that `k` proof checks drawn at random of `n_samples` include at
    least one of `bad` samples with a bad proof: 1 - C(n-bad, k) / C(n, k). The k to
    state for a run is the smallest reaching its target for the cheat it must not miss
    (one bad sample of n: k / n)."""
    if not 0 <= bad <= n_samples or k < 0:
        raise ValueError(f"bad n_samples={n_samples}, k={k} or bad={bad}")
    k = min(k, n_samples)
    return 1.0 - math.comb(n_samples - bad, k) / math.comb(n_samples, k)


def verified_subset(digest: str, beacon: str, n_samples: int, k: int) -> list[int]:
    """The `k` sample indices (sorted, distinct, all when k >= n_samples) a validator
    prefills: ranked by sha256(digest, beacon, i). The beacon (e.g. the validator's
    assignment id) is unknown to the worker when it generates, so it cannot know which
    samples will be checked; anyone holding both can recompute the choice."""
    if n_samples < 0 or k < 0:
        raise ValueError(f"bad n_samples={n_samples} or k={k}")
    rank = sorted(
        range(n_samples),
        key=lambda i: hashlib.sha256(f"covey-rl-verify|{digest}|{beacon}|{i}".encode()).digest(),
    )
    return sorted(rank[: min(k, n_samples)])


@dataclass(frozen=True)
class SampleStats:
    """What one prefill measured of one sample: the proof's worst chunk (`overlap` lowest,
    `mean_ulp` highest; `proof_error` when the proof is malformed), the largest sampling
    gap and the largest logprob error. Honest samples give ~1, ~0, ~0, ~0."""

    overlap: float
    mean_ulp: float
    gap: float
    logprob_err: float
    proof_error: str = ""
    gap_pos: int = 0
    logprob_pos: int = 0


_MEASURE = proofs.ProofThresholds(min_overlap=0.0, max_mean_ulp=math.inf)


def measure_samples(
    batch: RolloutBatch,
    indices: list[int],
    *,
    spec: RolloutSpec,
    model: torch.nn.Module,
    task: Task,
    encode: Callable[[str], list[int]] = byte_encode,
    prefill_batch: int = 4,
    proofs_of: Collection[int] | None = None,
) -> dict[int, SampleStats]:
    """Prefill samples `indices` of `batch` (prompts are the batch's own `prompt_indices`,
    G from `spec`) under `model` and measure sampling and logprobs against it, and the
    proof of those in `proofs_of` (None: all; the others measure as a perfect proof). The
    caller has checked the batch's shape (`check_batch` does). ValueError on an index out
    of range."""
    n, g = len(batch.samples), spec.group_size
    if any(not 0 <= i < n for i in [*indices, *(proofs_of or ())]):
        raise ValueError(f"verify_samples {sorted(proofs_of or indices)} out of range [0, {n})")
    proved = set(indices if proofs_of is None else proofs_of)
    prompts = {p: encode(task.prompt(p)) for p in set(batch.prompt_indices)}
    out: dict[int, SampleStats] = {}
    for start in range(0, len(indices), prefill_batch):
        part = indices[start : start + prefill_batch]
        seqs = [prompts[batch.prompt_indices[i // g]] + batch.samples[i].tokens for i in part]
        for i, (logits, hidden) in zip(part, sampling.prefill(model, seqs), strict=True):
            prompt_len = len(prompts[batch.prompt_indices[i // g]])
            out[i] = _measure(batch, i, prompt_len, logits, hidden, spec, i in proved)
    return out


def _measure(
    batch: RolloutBatch,
    i: int,
    prompt_len: int,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    spec: RolloutSpec,
    prove: bool = True,
) -> SampleStats:
    s, g = batch.samples[i], spec.group_size
    seed = sampling.sample_seed(
        spec.run_id, batch.step, batch.worker_id, batch.prompt_indices[i // g], i % g
    )
    check = sampling.sampling_scores(logits[prompt_len - 1 : -1], s.tokens, seed, spec.temperature)
    err = (check.logprobs - torch.tensor(s.logprobs)).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    overlap, mean_ulp, proof_error = 1.0, 0.0, ""  # the cheap check only: no proof
    if prove:
        proof = proofs.compare_proof(s.proof_bytes(), hidden[prompt_len:], _MEASURE)
        overlap = min((c.overlap for c in proof.chunks), default=0.0)
        mean_ulp = max((c.mean_ulp for c in proof.chunks), default=math.inf)
        proof_error = "" if proof.ok else proof.reason
    return SampleStats(
        overlap=overlap,
        mean_ulp=mean_ulp,
        gap=float(check.gap.max()),
        logprob_err=float(err.max()),
        proof_error=proof_error,
        gap_pos=int(check.gap.argmax()),
        logprob_pos=int(err.argmax()),
    )


def judge(stats: SampleStats, tol: Tolerances, i: int | None = None) -> BatchVerdict:
    """The verdict on one sample's measurements: proof, then sampling, then logprobs."""
    t = tol.proof
    if stats.proof_error:
        return _bad(Problem.PROOF, stats.proof_error, i)
    if stats.overlap < t.min_overlap:
        return _bad(Problem.PROOF, f"top-k overlap {stats.overlap:.3f} < {t.min_overlap}", i)
    if stats.mean_ulp > t.max_mean_ulp:
        return _bad(
            Problem.PROOF, f"mean value error {stats.mean_ulp:.3f} fp16 ulp > {t.max_mean_ulp}", i
        )
    if stats.gap > tol.sampling_gap:
        return _bad(
            Problem.SAMPLING,
            f"token {stats.gap_pos} is {stats.gap:.4f} below the "
            f"seeded argmax (tolerance {tol.sampling_gap})",
            i,
        )
    if stats.logprob_err > tol.logprob:
        return _bad(
            Problem.LOGPROBS,
            f"logprob off by {stats.logprob_err:.2e} at token "
            f"{stats.logprob_pos} (tolerance {tol.logprob})",
            i,
        )
    return BatchVerdict(True)


def check_batch(
    batch: RolloutBatch,
    *,
    spec: RolloutSpec,
    submitter: str,
    step: int,
    policy_cid: str,
    model: torch.nn.Module,
    task: Task,
    policy_version: int | None = None,
    encode: Callable[[str], list[int]] = byte_encode,
    decode: Callable[[list[int]], str] = byte_decode,
    verify_samples: list[int] | None = None,
    tolerances: Tolerances | None = None,
    prefill_batch: int = 4,
) -> BatchVerdict:
    """All checks on `batch` as submitted by `submitter` (the authenticated worker id)
    against the run's `spec`, the expected `step` and policy blob (`model` must be that
    policy; `policy_version` is checked when given). Every sample is prefilled: its tokens
    are checked against the seeded draw from the recomputed logits and its logprobs
    against them (the cheap check, on all samples: a worker that samples some of them
    otherwise, at another temperature, top-k, top-p, greedy, with a logit bias or
    best-of-n, is caught on those). `verify_samples` picks the samples whose proofs are
    compared as well (all when None; see `verified_subset` and `proof_detection`;
    ValueError when out of range); the run/worker/step/policy binding, rewards and token
    sanity run on every sample. `tolerances` default to TOLERANCES[spec.precision]. A bad
    batch is a verdict naming the first problem found, never an exception."""
    tol = tolerances or TOLERANCES[spec.precision]
    if batch.run_id != spec.run_id:
        return _bad(Problem.WRONG_RUN, f"run {batch.run_id!r}, expected {spec.run_id!r}")
    if batch.worker_id != submitter:
        return _bad(
            Problem.WRONG_WORKER, f"batch of worker {batch.worker_id!r} submitted by {submitter!r}"
        )
    if batch.step != step:
        return _bad(Problem.WRONG_STEP, f"step {batch.step}, expected {step}")
    if batch.policy_cid != policy_cid:
        return _bad(Problem.WRONG_POLICY, f"policy {batch.policy_cid!r}, expected {policy_cid!r}")
    if policy_version is not None and batch.policy_version != policy_version:
        return _bad(
            Problem.WRONG_POLICY,
            f"policy version {batch.policy_version}, expected {policy_version}",
        )
    want = assigned_prompts(
        spec.run_id, step, batch.worker_id, spec.prompts_per_step, num_prompts=len(task)
    )
    if batch.prompt_indices != want:
        got = batch.prompt_indices
        return _bad(Problem.PROMPTS, f"prompts {got[:8]}..., assigned {want[:8]}...")
    g = spec.group_size
    if batch.group_size != g or len(batch.samples) != len(want) * g:
        return _bad(
            Problem.GROUP,
            f"{len(batch.samples)} samples with G={batch.group_size}, "
            f"expected {len(want)} prompts x {g}",
        )
    for i, s in enumerate(batch.samples):
        if why := _token_problem(s, spec):
            return _bad(Problem.TOKENS, why, i)
    for i, s in enumerate(batch.samples):
        reward = task.reward(want[i // g], completion_text(s.tokens, spec.eos_id, decode))
        if not abs(reward - s.reward) <= 1e-6:  # NaN claims fail too
            return _bad(Problem.REWARD, f"reward {s.reward}, recomputed {reward}", i)
    every = list(range(len(batch.samples)))
    chosen = every if verify_samples is None else list(verify_samples)
    stats = measure_samples(
        batch,
        every,
        spec=spec,
        model=model,
        task=task,
        encode=encode,
        prefill_batch=prefill_batch,
        proofs_of=chosen,
    )
    for i in every:
        if not (verdict := judge(stats[i], tol, i)).ok:
            return verdict
    return BatchVerdict(True)


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
    gen_batch: int = 1,
) -> RolloutBatch:
    """What an honest worker submits for `step`: its assigned prompts, G seeded samples
    each (generated `gen_batch` sequences at a time), rewards from `task`, and a proof per
    sample."""
    if gen_batch < 1:
        raise ValueError(f"gen_batch must be >= 1, got {gen_batch}")
    indices = assigned_prompts(
        spec.run_id, step, worker_id, spec.prompts_per_step, num_prompts=len(task)
    )
    jobs = [(p, j) for p in indices for j in range(spec.group_size)]
    prompts = {p: encode(task.prompt(p)) for p in set(indices)}
    samples = []
    for start in range(0, len(jobs), gen_batch):
        part = jobs[start : start + gen_batch]
        seeds = [sampling.sample_seed(spec.run_id, step, worker_id, p, j) for p, j in part]
        gens = sampling.generate_batch(
            model,
            [prompts[p] for p, _ in part],
            spec.max_new_tokens,
            spec.temperature,
            seeds,
            spec.eos_id,
        )
        for (p, _), gen in zip(part, gens, strict=True):
            samples.append(
                Sample(
                    tokens=gen.tokens,
                    logprobs=gen.logprobs.tolist(),
                    reward=task.reward(p, completion_text(gen.tokens, spec.eos_id, decode)),
                    proof=base64.b64encode(proofs.build_proof(gen.hidden)).decode(),
                )
            )
    return RolloutBatch(
        run_id=spec.run_id,
        step=step,
        policy_version=policy_version,
        policy_cid=policy_cid,
        worker_id=worker_id,
        prompt_indices=indices,
        group_size=spec.group_size,
        samples=samples,
    )
