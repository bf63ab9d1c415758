"""Calibrate the proof and sampling tolerances: `python -m covey.rl.calibrate`.

Generates seeded completions with a small covey GPT (fp32, 1 torch thread), then verifies
them (a) honestly under other conditions: 2 threads, a right-padded batch of 4, generation
on 2 threads; and (b) as cheats: completions made by weights perturbed by 1e-3 relative,
by weights rounded to bf16, and by an older checkpoint, all checked against the fp32 policy.
Prints, per condition, the worst proof overlap / mean fp16-ulp error over chunks, the worst
honest sampling gap, and the sampling mismatches at the tolerance in use.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import torch

from covey.models.gpt import GPT, GPTConfig, lm_loss
from covey.rl import proofs, sampling
from covey.rl.tasks import ArithmeticTask

CALIB_CFG = GPTConfig(block_size=128, vocab_size=256, n_layer=4, n_head=4, n_embd=128)


@dataclass
class Row:
    name: str
    min_overlap: float  # over chunks
    min_mean_ulp: float
    max_mean_ulp: float
    max_gap: float  # largest positive sampling gap seen (0 when every token is the argmax)
    mismatches: int  # sampling mismatches at the tolerance in use
    tokens: int
    rejected: int  # sequences failing proof or sampling check at the default thresholds
    sequences: int


def policy(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CALIB_CFG).eval()


def perturbed(model: GPT, rel: float, seed: int = 1) -> GPT:
    cheat = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in cheat.parameters():
            p.mul_(1 + rel * torch.randn(p.shape, generator=g))
    return cheat


def bf16_rounded(model: GPT) -> GPT:
    cheat = copy.deepcopy(model)
    with torch.no_grad():
        for p in cheat.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return cheat


def trained(model: GPT, steps: int = 3, lr: float = 1e-3, seed: int = 2) -> GPT:
    """`model` after `steps` Adam steps on random bytes: a newer version of the policy."""
    newer = copy.deepcopy(model).train()
    opt = torch.optim.Adam(newer.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(0, 256, (4, 65), generator=g)
        opt.zero_grad()
        lm_loss(newer, batch).backward()
        opt.step()
    return newer.eval()


def _generate(model: GPT, prompts: list[list[int]], n_new: int, threads: int) -> list:
    torch.set_num_threads(threads)
    return [sampling.generate(model, p, n_new, 1.0, seed=1000 + i) for i, p in enumerate(prompts)]


def _verify(
    name: str, verifier: GPT, prompts: list[list[int]], gens: list, threads: int, batch: int
) -> Row:
    torch.set_num_threads(threads)
    overlaps, ulps, gaps, mismatches, rejected = [], [], [0.0], 0, 0
    for start in range(0, len(prompts), batch):
        part = zip(prompts[start : start + batch], gens[start : start + batch], strict=True)
        seqs = [p + g.tokens for p, g in part]
        outs = sampling.prefill(verifier, seqs)
        for j, (logits, hidden) in enumerate(outs):
            i = start + j
            p, g = prompts[i], gens[i]
            verdict = proofs.compare_proof(proofs.build_proof(g.hidden), hidden[len(p) :])
            overlaps += [c.overlap for c in verdict.chunks]
            ulps += [c.mean_ulp for c in verdict.chunks]
            check = sampling.sampling_scores(logits[len(p) - 1 : -1], g.tokens, 1000 + i, 1.0)
            gaps.append(float(check.gap.max()))
            bad = int((check.gap > sampling.SAMPLING_TOLERANCE).sum())
            mismatches += bad
            rejected += int(not verdict.ok or bad > 0)
    return Row(
        name,
        min(overlaps),
        min(ulps),
        max(ulps),
        max(gaps),
        mismatches,
        sum(len(g.tokens) for g in gens),
        rejected,
        len(gens),
    )


def calibrate(n_seq: int = 8, n_new: int = 64) -> list[Row]:
    """The table's rows; restores torch's thread count afterwards."""
    before = torch.get_num_threads()
    try:
        return _calibrate(n_seq, n_new)
    finally:
        torch.set_num_threads(before)


def _calibrate(n_seq: int, n_new: int) -> list[Row]:
    task = ArithmeticTask(seed=0)
    prompts = [list(task.prompt(i).encode()) for i in range(n_seq)]
    model = policy()
    honest1 = _generate(model, prompts, n_new, threads=1)
    honest2 = _generate(model, prompts, n_new, threads=2)
    rows = [
        _verify("honest: gen 1 thread, verify 1 thread, batch 1", model, prompts, honest1, 1, 1),
        _verify("honest: gen 1 thread, verify 2 threads, batch 1", model, prompts, honest1, 2, 1),
        _verify("honest: gen 1 thread, verify 2 threads, batch 4", model, prompts, honest1, 2, 4),
        _verify("honest: gen 2 threads, verify 1 thread, batch 4", model, prompts, honest2, 1, 4),
    ]
    # A run that says bf16: the policy itself in bf16 on both sides (its own thresholds).
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    gens16 = _generate(model16, prompts, n_new, threads=1)
    rows.append(
        _verify("bf16 run, honest: gen 1 thread, verify 2 thr, b4", model16, prompts, gens16, 2, 4)
    )
    cheats = {
        "cheat: weights perturbed 1e-3 rel": perturbed(model, 1e-3),
        "cheat: weights rounded to bf16": bf16_rounded(model),
        "cheat: older checkpoint (3 steps back)": model,
    }
    newer = trained(model)
    for name, cheat in cheats.items():
        verifier = newer if "older" in name else model
        gens = _generate(cheat, prompts, n_new, threads=1)
        rows.append(_verify(name, verifier, prompts, gens, 2, 4))
    return rows


def measure_costs(n_new: int) -> dict[str, float]:
    """Wall ms on this machine for one `n_new`-token completion: generation (no KV cache),
    the validator's prefill, proof build and proof check."""
    model, prompt = policy(), list(b"12+7=")
    t0 = time.perf_counter()
    gen = sampling.generate(model, prompt, n_new, 1.0, seed=1)
    t1 = time.perf_counter()
    _, hidden = sampling.prefill(model, [prompt + gen.tokens])[0]
    t2 = time.perf_counter()
    proof = proofs.build_proof(gen.hidden)
    t3 = time.perf_counter()
    proofs.compare_proof(proof, hidden[len(prompt) :])
    t4 = time.perf_counter()
    ms = 1000.0
    return {
        "generate": (t1 - t0) * ms,
        "prefill": (t2 - t1) * ms,
        "build_proof": (t3 - t2) * ms,
        "check_proof": (t4 - t3) * ms,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    t = proofs.ProofThresholds()
    size = proofs.proof_size(proofs.CHUNK, CALIB_CFG.n_embd)
    print(f"policy: covey GPT {CALIB_CFG}; proof bytes per {proofs.CHUNK} tokens: {size}")
    print(
        f"thresholds: min_overlap {t.min_overlap}, max_mean_ulp {t.max_mean_ulp}, "
        f"sampling tolerance {sampling.SAMPLING_TOLERANCE}"
    )
    costs = measure_costs(args.tokens)
    print("costs (1 sequence, ms): " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    print(
        f"{'condition':48s} {'min ovl':>8s} {'ulp min':>8s} {'ulp max':>8s} {'max gap':>9s} "
        f"{'mism':>5s} {'tokens':>6s} {'rejected':>9s}"
    )
    for r in calibrate(args.sequences, args.tokens):
        print(
            f"{r.name:48s} {r.min_overlap:8.3f} {r.min_mean_ulp:8.3f} {r.max_mean_ulp:8.3f} "
            f"{r.max_gap:9.2e} {r.mismatches:5d} {r.tokens:6d} {r.rejected:4d}/{r.sequences}"
        )


if __name__ == "__main__":
    main()
