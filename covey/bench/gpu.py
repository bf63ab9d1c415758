"""`covey bench gpu`: what covey costs a peer on its own device (docs/gpus.md).

For a covey GPT preset (default covey:gpt2, 124M) and a Hugging Face Llama of the same
width, depth and vocabulary (built from a config, nothing downloaded), on one device:

- inner-step throughput, tokens/s: covey's `DiLoCo.inner_step` against a bare PyTorch loop
  (the same loss, AdamW, gradient clipping, `loss.item()` each step), same weights and
  batches, in alternating timed blocks (bare, covey, covey, bare, ...) so that load which
  comes and goes hits both; the medians are compared;
- MFU: achieved FLOP/s over the device's peak, FLOPs per token 6N + 12 L T d (PaLM's
  count, arXiv 2204.02311, appendix B); peak from a table of known GPUs or --peak-tflops,
  none on a CPU;
- DiLoCo overhead per round: `make_contribution` (pseudo-gradient, codec) + `apply_round`
  + `adopt`, in seconds and as a share of the round's H inner steps;
- codec encode / decode-onto-the-device time per MB of float32 pseudo-gradient.

Batches are random token ids (throughput does not depend on the text). CUDA timings
synchronize before reading the clock.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from covey.algorithms import build_strategy
from covey.config import DiLoCoConfig
from covey.devices import autocast, device_name, resolve_device, resolve_precision

# dense bf16 tensor-core peaks, TFLOP/s (vendor datasheets); matched against the name
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "4090": 165.0}
CODECS = ("fp32", "int8", "topk:0.01", "dct:64:8")
GOAL_OVERHEAD_PCT = 2.0
GOAL_MFU = 0.45


Shape = dict[str, int]  # context, layers, width, vocab


def build_models(
    source: str, seed: int, llama: bool = True
) -> list[tuple[str, nn.Module, Any, Shape]]:
    """[(label, model, loss_fn, shape)] for the covey preset and (with `llama`) a Llama of
    its shape. ValueError for a source that is not a covey preset."""
    from covey.models.gpt import lm_loss
    from covey.models.source import build_model, parse_source

    kind, size = parse_source(source)
    if kind != "covey":
        raise ValueError(f"--model must be a covey preset (covey:micro ... gpt2), got {source!r}")
    gpt, _, info = build_model(source, seed)
    c = info.config
    shape = {
        "context": c["block_size"], "layers": c["n_layer"], "width": c["n_embd"],
        "vocab": c["vocab_size"],
    }  # fmt: skip
    models = [(f"covey:{size}", gpt, lm_loss, shape)]
    if not llama:
        return models
    from transformers import LlamaConfig, LlamaForCausalLM

    from covey.models.hf import hf_lm_loss

    llama_cfg = LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["n_embd"],
        intermediate_size=c["n_embd"] * 8 // 3 // 16 * 16,
        num_hidden_layers=c["n_layer"],
        num_attention_heads=c["n_head"],
        num_key_value_heads=c["n_head"],
        max_position_embeddings=c["block_size"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(llama_cfg)
    return [*models, (f"llama ({c['n_layer']}x{c['n_embd']})", hf, hf_lm_loss, shape)]


def flops_per_token(params: int, layers: int, width: int, context: int) -> float:
    """Training FLOPs per token: 6N for the weights, 12 L T d for attention (PaLM, app. B)."""
    return 6.0 * params + 12.0 * layers * context * width


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """The device's dense bf16 peak in FLOP/s: the override, a known GPU's, else None."""
    if override_tflops:
        return override_tflops * 1e12
    name = device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[torch.Tensor], float], batches: Sequence[torch.Tensor]) -> float:
    """Seconds for one block of steps, synchronized at both ends."""
    device = batches[0].device
    _sync(device)
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    _sync(device)
    return time.perf_counter() - t0


def _bare_loop(model: nn.Module, loss_fn: Any, device: torch.device, precision: str) -> Any:
    """The loop a user writes by hand: forward (autocast), backward, clip, AdamW, .item()."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))

    def step(batch: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        with autocast(device, precision):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    return step


def bench_model(
    label: str,
    model: nn.Module,
    loss_fn: Any,
    shape: Shape,
    *,
    device: torch.device,
    precision: str,
    batch_size: int,
    seq_len: int,
    steps: int,
    blocks: int,
    inner_steps: int,
    compile: bool,
    peak: float | None,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    """One model's row: bare vs covey tokens/s, MFU, and DiLoCo's per-round overhead."""
    seq_len = min(seq_len, shape["context"])
    vocab = shape["vocab"]
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g).to(device)
        for _ in range(steps)
    ]
    bare_model = copy.deepcopy(model).to(device)
    bare = _bare_loop(bare_model, loss_fn, device, precision)
    strategy = build_strategy(
        DiLoCoConfig(inner_steps=inner_steps), copy.deepcopy(model).to(device), loss_fn
    )
    strategy.set_compute(precision, compile)
    state = build_strategy(DiLoCoConfig(), model, loss_fn).init_state()  # on the host
    strategy.load_state(state)
    for b in batches[:2]:  # warm-up: kernels, allocator, compilation
        bare(b)
        strategy.inner_step(b)
    times: dict[str, list[float]] = {"bare": [], "covey": []}
    for i in range(blocks):
        order = ("bare", "covey") if i % 2 == 0 else ("covey", "bare")
        for side in order:
            fn = bare if side == "bare" else strategy.inner_step
            times[side].append(_timed(fn, batches))
            echo(f"  {label}: block {i + 1}/{blocks} {side} {times[side][-1]:.2f} s")
    tokens = steps * batch_size * seq_len
    bare_tps = tokens / statistics.median(times["bare"])
    covey_tps = tokens / statistics.median(times["covey"])
    params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(params, shape["layers"], shape["width"], seq_len)
    round_s = _round_overhead(strategy, state, batches[0], device)
    h_time = inner_steps * statistics.median(times["covey"]) / steps
    return {
        "model": label,
        "parameters": params,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "bare_tokens_per_s": bare_tps,
        "covey_tokens_per_s": covey_tps,
        "overhead_pct": 100.0 * (bare_tps / covey_tps - 1.0),
        "flops_per_token": fpt,
        "bare_mfu": bare_tps * fpt / peak if peak else None,
        "covey_mfu": covey_tps * fpt / peak if peak else None,
        "round_overhead_s": round_s,
        "round_overhead_pct_of_h_steps": 100.0 * round_s / h_time,
        "inner_steps": inner_steps,
    }


def _round_overhead(strategy: Any, state: Any, batch: torch.Tensor, device: torch.device) -> float:
    """make_contribution + apply_round (one contribution) + adopt, after one inner step."""
    strategy.begin_round(state)
    strategy.inner_step(batch)
    _sync(device)
    t0 = time.perf_counter()
    c = strategy.make_contribution()
    new = strategy.apply_round(state, [c])
    strategy.adopt(new)
    _sync(device)
    return time.perf_counter() - t0


def bench_codecs(numel: int, device: torch.device, repeats: int = 3) -> list[dict[str, Any]]:
    """Encode (device tensor -> bytes) and decode (bytes -> device tensor) ms per MB."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1)).to(device)
    mb = numel * 4 / 1e6
    rows = []
    for spec in CODECS:
        from covey.algorithms.codecs import get_codec

        codec = get_codec(spec)
        enc, dec = [], []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            payload = codec.encode(x)
            enc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            codec.decode(payload, numel, device=device)
            _sync(device)
            dec.append(time.perf_counter() - t0)
        rows.append(
            {
                "codec": spec,
                "mb": mb,
                "payload_bytes": len(payload),
                "encode_ms_per_mb": 1e3 * min(enc) / mb,
                "decode_ms_per_mb": 1e3 * min(dec) / mb,
            }
        )
    return rows


def run_gpu_bench(
    *,
    model: str = "covey:gpt2",
    device: str = "auto",
    precision: str = "auto",
    batch_size: int = 8,
    seq_len: int = 1024,
    steps: int = 10,
    blocks: int = 4,
    inner_steps: int = 50,
    compile: bool = False,
    llama: bool = True,
    peak_tflops: float | None = None,
    seed: int = 0,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The whole bench as a JSON-ready dict (see the module docstring)."""
    where = resolve_device(device)
    prec = resolve_precision(precision, where)
    peak = peak_flops(where, peak_tflops)
    models = build_models(model, seed, llama)
    rows = []
    for label, m, loss_fn, shape in models:
        echo(f"{label}: {sum(p.numel() for p in m.parameters()):,} parameters on {where}")
        rows.append(
            bench_model(
                label, m, loss_fn, shape, device=where, precision=prec,
                batch_size=batch_size, seq_len=seq_len, steps=steps, blocks=blocks,
                inner_steps=inner_steps, compile=compile, peak=peak, echo=echo,
            )
        )  # fmt: skip
    numel = sum(p.numel() for p in models[0][1].parameters())
    return {
        "device": device_name(where),
        "precision": prec,
        "compile": compile,
        "peak_flops": peak,
        "goal": {"overhead_pct": GOAL_OVERHEAD_PCT, "mfu": GOAL_MFU},
        "models": rows,
        "codecs": bench_codecs(numel, where),
        "torch": torch.__version__,
        "mfu_note": None if peak else "no known peak for this device: MFU not reported",
        "finite": all(math.isfinite(r["covey_tokens_per_s"]) for r in rows),
    }
