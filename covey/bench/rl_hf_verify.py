"""Verification of Hugging Face policies: honest mismatch and cheats, per model type.

`python -m covey.bench.rl_hf_verify [--quick] [--json PATH]`

The fp32 tolerances in `covey.rl.batch.TOLERANCES` were calibrated on covey's GPT. This
measures whether they hold for HF causal LMs (GPT-2 and Llama built from configs here,
random init, a BPE tokenizer trained here on arithmetic text; nothing downloaded):

* honest: batches generated on 1 and 2 torch threads, one sequence at a time and 4 or 8 at
  once, checked by `check_batch` on 1 and 2 threads with prefill batches cycling 1, 4, 8;
  rows count rollouts and false rejections and keep the worst honest measurement (proof
  overlap and fp16-ulp error, sampling gap, logprob error);
* cheats: weights perturbed by 1e-3 relative, weights rounded to bf16, and edited tokens
  (one token of every sample), `tries` each, checked with 2 of 8 samples prefilled (drawn by
  `verified_subset`, as a validator does); rows count catches and the cheat's closest
  measurement to honest.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from covey.rl import policy as pol
from covey.rl.batch import (
    RolloutBatch,
    RolloutSpec,
    Sample,
    batch_digest,
    check_batch,
    measure_samples,
    rollout,
    verified_subset,
)
from covey.rl.hf_policy import hf_newline_id
from covey.rl.tasks import ArithmeticTask

CID = "bench-hf-policy"
VERIFY_K = 2
SIZES = {"tiny": (32, 2), "small": (128, 4)}  # (hidden size, layers)


def _tokenizer(directory: Path, bos: bool) -> None:
    """A byte-level BPE trained on arithmetic text ("\\n" one token); with a BOS
    post-processor for Llama, as Llama tokenizers have."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([f"{a}+{b}={a + b}\n" for a in range(40) for b in range(40)], trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    (directory / "tokenizer.json").write_text(tok.to_str())


def make_hf_policy(directory: Path, arch: str, seed: int = 0, size: str = "tiny") -> Path:
    """A local HF policy directory (config.json, model.safetensors, tokenizer.json) of a
    random-init GPT-2 or Llama: what `--policy hf:DIR` reads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, layers = SIZES[size]
    directory.mkdir(parents=True, exist_ok=True)
    common = {"vocab_size": 320, "bos_token_id": 0, "eos_token_id": 1}
    if arch == "gpt2":
        config = AutoConfig.for_model(
            "gpt2", n_positions=64, n_embd=hidden, n_layer=layers, n_head=4, **common
        )
    elif arch == "llama":
        config = AutoConfig.for_model(
            "llama",
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            **common,
        )
    else:
        raise ValueError(f"arch {arch!r}: expected gpt2 or llama")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(directory), safe_serialization=True)
    _tokenizer(directory, bos=arch == "llama")
    return directory


def _spec(desc: dict[str, Any]) -> RolloutSpec:
    return RolloutSpec("bench-hf", 2, 4, 1.0, 12, desc["vocab_size"], hf_newline_id(desc))


def _worst(stats: list[Any], worst: dict[str, float]) -> None:
    for s in stats:
        worst["min_overlap"] = min(worst.get("min_overlap", 1.0), s.overlap)
        worst["max_mean_ulp"] = max(worst.get("max_mean_ulp", 0.0), s.mean_ulp)
        worst["max_gap"] = max(worst.get("max_gap", 0.0), s.gap)
        worst["max_logprob_err"] = max(worst.get("max_logprob_err", 0.0), s.logprob_err)


def honest_rows(arch: str, desc: dict[str, Any], model: nn.Module, batches: int) -> list[dict]:
    spec, task, codec = _spec(desc), ArithmeticTask(), pol.codec_kwargs(desc)
    rows = []
    for gen_threads in (1, 2):
        for gen_batch in (1, 4, 8):
            worst: dict[str, float] = {}
            rollouts, rejected, problems, t_gen = 0, 0, Counter(), 0.0
            for b in range(batches):
                torch.set_num_threads(gen_threads)
                t0 = time.perf_counter()
                worker = f"w{gen_threads}{gen_batch}"
                batch = rollout(model, task, spec, step=b, worker_id=worker, policy_version=0,
                                policy_cid=CID, gen_batch=gen_batch, **codec)  # fmt: skip
                t_gen += time.perf_counter() - t0
                rollouts += len(batch.samples)
                for v_threads in (1, 2):
                    torch.set_num_threads(v_threads)
                    pb = (1, 4, 8)[(b + v_threads) % 3]
                    verdict = check_batch(batch, spec=spec, submitter=worker, step=b,
                                          policy_cid=CID, model=model, task=task,
                                          prefill_batch=pb, **codec)  # fmt: skip
                    every = list(range(len(batch.samples)))
                    stats = measure_samples(batch, every, spec=spec, model=model, task=task,
                                            encode=codec["encode"], prefill_batch=pb)  # fmt: skip
                    _worst(list(stats.values()), worst)
                    if not verdict.ok:
                        rejected += 1
                        problems[verdict.problem.value if verdict.problem else "?"] += 1
            rows.append({"section": "honest", "arch": arch, "gen_threads": gen_threads,
                         "gen_batch": gen_batch, "verify_threads": "1,2",
                         "prefill_batch": "1,4,8", "rollouts": rollouts, "checks": 2 * batches,
                         "rejected": rejected, "problems": dict(problems),
                         "rollouts_per_s": rollouts / t_gen, **worst})  # fmt: skip
            _say(rows[-1])
    return rows


def _perturbed(desc: dict[str, Any], model: nn.Module, seed: int) -> nn.Module:
    other = pol.load_weights(pol.build_policy(desc), pol.policy_bytes(model))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=g))
    return other


def _bf16(desc: dict[str, Any], model: nn.Module) -> nn.Module:
    other = pol.build_policy(desc)
    other.load_state_dict({k: v.bfloat16().float() for k, v in model.state_dict().items()})
    return other


def _edited(batch: RolloutBatch, vocab: int) -> RolloutBatch:
    samples = []
    for s in batch.samples:
        tokens = [(s.tokens[0] + 1) % vocab, *s.tokens[1:]] if len(s.tokens) > 1 else s.tokens
        samples.append(Sample(**{**s.model_dump(), "tokens": tokens}))
    return batch.model_copy(update={"samples": samples})


def cheat_rows(arch: str, desc: dict[str, Any], model: nn.Module, tries: int) -> list[dict]:
    torch.set_num_threads(1)
    spec, task, codec = _spec(desc), ArithmeticTask(), pol.codec_kwargs(desc)
    bf16 = _bf16(desc, model)
    rows = []
    for kind in ("perturbed_1e-3", "bf16_weights", "edited_tokens"):
        caught, problems, closest = 0, Counter(), {}
        for t in range(tries):
            step, worker = 1000 + t, f"cheat-{t}"
            maker = {"perturbed_1e-3": None, "bf16_weights": bf16, "edited_tokens": model}[kind]
            actor = _perturbed(desc, model, t) if maker is None else maker
            batch = rollout(actor, task, spec, step=step, worker_id=worker, policy_version=0,
                            policy_cid=CID, gen_batch=8, **codec)  # fmt: skip
            if kind == "edited_tokens":
                batch = _edited(batch, desc["vocab_size"])
            subset = verified_subset(batch_digest(batch), f"beacon-{t}", len(batch.samples), 2)
            verdict = check_batch(batch, spec=spec, submitter=worker, step=step,
                                  policy_cid=CID, model=model, task=task,
                                  verify_samples=subset, **codec)  # fmt: skip
            caught += not verdict.ok
            problems[verdict.problem.value if verdict.problem else "accepted"] += 1
            if verdict.problem and verdict.problem.value in ("proof", "sampling", "logprobs"):
                stats = measure_samples(batch, subset, spec=spec, model=model, task=task,
                                        encode=codec["encode"]).values()  # fmt: skip
                for name in ("mean_ulp", "gap", "logprob_err"):
                    strongest = max(getattr(s, name) for s in stats)
                    closest[f"closest_{name}"] = min(closest.get(f"closest_{name}", math.inf),
                                                     strongest)  # fmt: skip
        rows.append({"section": "cheat", "arch": arch, "cheat": kind, "tries": tries,
                     "caught": caught, "problems": dict(problems), **closest})  # fmt: skip
        _say(rows[-1])
    return rows


def _say(row: dict[str, Any]) -> None:
    print(json.dumps(row, default=str), file=sys.stderr, flush=True)


def run(quick: bool = False, size: str = "small") -> list[dict[str, Any]]:
    """Every section for GPT-2 and Llama; restores torch's thread count."""
    before = torch.get_num_threads()
    batches, tries = (2, 5) if quick else (11, 50)
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="covey-rl-hf-") as tmp:
            for arch in ("gpt2", "llama"):
                d = make_hf_policy(Path(tmp) / arch, arch, size=size)
                desc, model = pol.load_policy_dir(f"hf:{d}")
                rows += honest_rows(arch, desc, model, batches)
                rows += cheat_rows(arch, desc, model, tries)
    finally:
        torch.set_num_threads(before)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 batches per condition, 5 tries")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="policy size")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = run(args.quick, args.size)
    honest = [r for r in rows if r["section"] == "honest"]
    cheats = [r for r in rows if r["section"] == "cheat"]
    print(
        f"honest: {sum(r['rejected'] for r in honest)} of {sum(r['checks'] for r in honest)} "
        f"checks rejected ({sum(r['rollouts'] for r in honest)} rollouts); cheats caught "
        f"{sum(r['caught'] for r in cheats)}/{sum(r['tries'] for r in cheats)}; "
        f"{time.time() - t0:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
