"""`covey bench model`: what covey costs a worker's inner steps on a Hugging Face model.

A worker trains through `Strategy.inner_step` (DiLoCo here: covey's loss, gradient
clipping and AdamW, on the model `build_model("hf:DIR")` builds). The reference is the loop
a user would write with `transformers` alone: `AutoModelForCausalLM.from_config`, AdamW,
`clip_grad_norm_`, `loss.item()` each step. Both start from the same weights (same seed)
and see the same batches, taken from the same corpus before timing starts, so the
difference is covey's wrapping and nothing else; equal losses over the first steps check
that both do the same work.

The machine may be shared, so both loops run in alternating blocks (bare, covey, covey,
bare, ...), each block timed alone, and each side's throughput is the median over its
blocks: load that comes and goes hits both sides alike. Everything is built in a temporary
directory: a tiny Llama `config.json` and a slice of the Python standard library's source
as data, byte tokenizer; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

GOAL_OVERHEAD_PCT = 3.0


def tiny_llama_config(hidden: int, layers: int, vocab_size: int, positions: int) -> dict:
    """A Llama-architecture config.json: `hidden` wide (heads of 32), `layers` deep."""
    heads = max(1, hidden // 32)
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3 // 16 * 16,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": positions,
        "tie_word_embeddings": False,
    }


def write_data(directory: Path, max_bytes: int = 2 << 20) -> Path:
    """About `max_bytes` of the stdlib's own source as one text file (real text, local)."""
    from covey.data.corpus import stdlib_documents

    out, size = directory / "train.txt", 0
    with open(out, "wb") as f:
        for _, data in stdlib_documents():
            f.write(data + b"\n")
            size += len(data) + 1
            if size >= max_bytes:
                break
    return out


def _bare_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, clip: float
) -> float:
    """One step of the loop a user writes with transformers alone."""
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
    loss.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.item()


def _timed(step: Callable[[torch.Tensor], float], batches: Sequence[torch.Tensor]) -> float:
    """Seconds for `step` over `batches` (CUDA: synchronized at both ends)."""
    sync = torch.cuda.synchronize if batches[0].is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    sync()
    return time.perf_counter() - t0


def run_model_bench(
    *,
    steps: int = 10,
    repeats: int = 3,
    warmup: int = 2,
    hidden: int = 256,
    layers: int = 4,
    batch_size: int = 8,
    seq_len: int = 128,
    threads: int | None = 1,
    device: str = "cpu",
    seed: int = 0,
    echo: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Tokens/s of covey's DiLoCo inner step and of a bare transformers + AdamW loop on a
    tiny Llama, same weights and batches: `steps` timed steps per block, `repeats` blocks
    each, after `warmup` untimed steps each. Returns a JSON-ready dict; `overhead_pct` is
    (bare - covey) / bare of the medians in percent, `met` whether it is within
    GOAL_OVERHEAD_PCT; `paired_overhead_pct` the median over back-to-back block pairs and
    `bare_spread_pct` the bare blocks' range: when the spread exceeds the goal, one run
    cannot tell 3% from noise.
    ValueError for a non-positive size or count; RuntimeError when the two loops compute
    different losses (then they are not doing the same work and the numbers mean nothing)."""
    for name, v in (
        ("steps", steps),
        ("repeats", repeats),
        ("hidden", hidden),
        ("layers", layers),
        ("batch_size", batch_size),
        ("seq_len", seq_len),
    ):
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")  # fmt: skip
    from transformers import AutoConfig, AutoModelForCausalLM

    from covey.algorithms import build_strategy
    from covey.config import DiLoCoConfig
    from covey.data.batches import sample_batch
    from covey.data.corpus import load_corpus
    from covey.models.source import build_model

    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="covey-bench-model-") as tmp:
        model_dir = Path(tmp) / "llama"
        model_dir.mkdir()
        config = tiny_llama_config(hidden, layers, vocab_size=256, positions=max(seq_len, 128))
        (model_dir / "config.json").write_text(json.dumps(config))
        corpus = load_corpus([str(write_data(Path(tmp)))], 0.02, "bytes")
        n = warmup + steps * repeats
        batches = [
            sample_batch(corpus.train, batch_size=batch_size, seq_len=seq_len, seed=seed,
                         round=0, worker="bench", step=i).to(device)
            for i in range(n)
        ]  # fmt: skip

        # covey: the model a worker builds, wrapped by the DiLoCo strategy
        model, loss_fn, info = build_model(f"hf:{model_dir}", seed)
        algo = DiLoCoConfig(inner_steps=n)
        strategy = build_strategy(algo, model.to(device), loss_fn)
        strategy.load_state(strategy.init_state())  # a round's start, as a worker does
        # bare: transformers and torch only, same seed so the same initial weights
        torch.manual_seed(seed)
        bare = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(str(model_dir)), dtype=torch.float32
        ).to(device)
        bare.train()
        o = algo.optim
        opt = torch.optim.AdamW(
            bare.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay
        )

        def bare_step(b: torch.Tensor) -> float:
            return _bare_step(bare, opt, b, o.grad_clip)

        check = [(bare_step(b), float(strategy.inner_step(b))) for b in batches[:warmup]]
        worst = max((abs(a - c) for a, c in check), default=0.0)
        if worst > 1e-4:
            raise RuntimeError(f"the loops' losses differ by {worst:.2e}: {check}")
        tokens = batch_size * seq_len * steps
        bare_tps: list[float] = []
        covey_tps: list[float] = []
        for r in range(repeats):
            block = batches[warmup + r * steps : warmup + (r + 1) * steps]
            order = [("bare", bare_step), ("covey", strategy.inner_step)]
            for name, step in order if r % 2 == 0 else order[::-1]:
                tps = tokens / _timed(step, block)
                (bare_tps if name == "bare" else covey_tps).append(tps)
                echo(f"  block {r + 1}/{repeats} {name:>5}: {tps:,.0f} tokens/s")
    b_med, c_med = statistics.median(bare_tps), statistics.median(covey_tps)
    overhead = (b_med - c_med) / b_med * 100
    # each block pair ran back to back: their ratio cancels load that changes slowly
    pairs = zip(bare_tps, covey_tps, strict=True)
    paired = statistics.median((b - c) / b * 100 for b, c in pairs)
    spread = (max(bare_tps) - min(bare_tps)) / b_med * 100  # the noise of one side
    return {
        "bench": "model",
        "model": {"source": "hf:<tmp>/llama (LlamaForCausalLM)", "parameters": info.parameters,
                  **{k: config[k] for k in ("hidden_size", "intermediate_size",
                                            "num_hidden_layers", "num_attention_heads",
                                            "num_key_value_heads", "vocab_size")}},
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps_per_block": steps,
        "repeats": repeats,
        "warmup": warmup,
        "device": device,
        "threads": torch.get_num_threads(),
        "bare_tokens_per_s": round(b_med, 1),
        "covey_tokens_per_s": round(c_med, 1),
        "bare_blocks": [round(t, 1) for t in bare_tps],
        "covey_blocks": [round(t, 1) for t in covey_tps],
        "overhead_pct": round(overhead, 2),
        "paired_overhead_pct": round(paired, 2),
        "bare_spread_pct": round(spread, 2),
        "goal_pct": GOAL_OVERHEAD_PCT,
        "met": overhead <= GOAL_OVERHEAD_PCT,
        "warmup_loss_max_diff": worst,
        "load_avg": os.getloadavg()[0],
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip
