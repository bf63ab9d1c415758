"""CUDA checks of covey's device paths (run by scripts/gpu_check.sh on a machine with a GPU):
each prints one line and goes into --json; the exit status is 1 when any fails.

- codecs: int8/int4 encoded on the GPU give the host's bytes; decode and roundtrip the
  host's bits;
- sketch: a commitment of a state on the GPU agrees with the host's (hash equal, sketch
  distance at float64 rounding), tables cached on the GPU;
- memory: DiLoCo (AdamW, error feedback) holds at most 4 model sizes of the GPU's memory
  between inner steps;
- rl: generation with the KV cache on the GPU picks the tokens the CPU picks;
- swarm: int8 activations encoded on the GPU give the host's bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

CUDA = torch.device("cuda")


def check_codecs() -> str:
    from covey.algorithms.codecs import get_codec

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1_000_003, generator=g), torch.zeros(130), torch.randn(65) * 1e30]
    for spec in ("int8", "int4", "int4:3"):
        codec = get_codec(spec)
        for x in xs:
            host = codec.encode(x)
            assert codec.encode(x.to(CUDA)) == host, f"{spec}: device bytes differ"
            payload, decoded = codec.roundtrip(x.to(CUDA))
            assert payload == host and decoded.device.type == "cuda"
            want = codec.decode(host).view(torch.int32)
            assert torch.equal(decoded.cpu().view(torch.int32), want), f"{spec}: roundtrip"
            on_gpu = codec.decode(host, device=CUDA).cpu().view(torch.int32)
            assert torch.equal(on_gpu, want), f"{spec}: device decode"
    return "int8/int4 device bytes and bits equal the host's"


def check_sketch() -> str:
    from covey.trust import sketch_hashing
    from covey.trust.sketch import commitment_distance, commitment_of

    g = torch.Generator().manual_seed(1)
    start = {"w": torch.randn(3_000_001, generator=g), "b": torch.randn(77, generator=g)}
    local = {f"param/{k}": v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in start.items()}
    local |= {f"optim/{k}/exp_avg": v * 0.1 for k, v in start.items()}
    host = commitment_of(local, start, 10)
    dev_local = {k: v.to(CUDA) for k, v in local.items()}
    dev_start = {k: v.to(CUDA) for k, v in start.items()}
    t0 = time.perf_counter()
    dev = commitment_of(dev_local, dev_start, 10)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    dev = commitment_of(dev_local, dev_start, 10)
    again = time.perf_counter() - t0
    assert dev.hash == host.hash, "state hash differs"
    gap = max(
        abs(a - b) / max(abs(b), 1e-30)
        for k in ("params", "optim")
        for a, b in zip(dev.sketch[k], host.sketch[k], strict=True)
    )
    assert gap < 1e-9 and commitment_distance(dev, host) == 0.0, f"sketch relative gap {gap}"
    held = sketch_hashing.held_bytes(CUDA)
    return (
        f"sketch max relative gap {gap:.2e}; commitment of 3M params {first * 1e3:.0f} ms "
        f"first, {again * 1e3:.0f} ms cached ({held / 2**20:.0f} MiB of tables)"
    )


def check_memory() -> str:
    from covey.algorithms import TrainState, build_strategy
    from covey.bench.hostsync import method_config
    from covey.models.gpt import GPT, gpt_config, lm_loss

    torch.manual_seed(0)
    model = GPT(gpt_config("micro"))
    host = {n: p.detach().clone() for n, p in model.named_parameters()}
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    s = build_strategy(method_config("diloco"), model.to(CUDA), lm_loss)
    s.begin_round(TrainState({n: host[n] for n in s.names}))
    batch = torch.randint(0, model.cfg.vocab_size, (4, 65), device=CUDA)
    for _ in range(3):
        s.inner_step(batch)
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base) / model_bytes
    peak = (torch.cuda.max_memory_allocated() - base) / model_bytes
    assert held <= 4.05, f"DiLoCo holds {held:.2f} model sizes on the GPU"
    return f"DiLoCo+AdamW+EF holds {held:.2f} model sizes between steps (peak {peak:.2f})"


def check_rl() -> str:
    from covey.models.gpt import GPT, gpt_config
    from covey.rl import sampling

    torch.manual_seed(0)
    model = GPT(gpt_config("nano")).eval()
    prompts = [[1, 2, 3], [5] * 9, [7]]
    seeds = [11, 12, 13]
    cpu = sampling.generate_batch(model, prompts, 32, 1.0, seeds)
    gpu = sampling.generate_batch(model.to(CUDA), prompts, 32, 1.0, seeds)
    same = sum(a.tokens == b.tokens for a, b in zip(cpu, gpu, strict=True))
    assert same == len(prompts), f"{len(prompts) - same} of {len(prompts)} completions differ"
    return "KV-cache generation on the GPU picks the CPU's tokens"


def check_swarm() -> str:
    from covey.swarm.codecs import encode_int8

    x = torch.randn(4, 128, 768, generator=torch.Generator().manual_seed(2))
    assert encode_int8(x.to(CUDA)) == encode_int8(x), "SWARM int8 bytes differ"
    return "SWARM int8 device bytes equal the host's"


CHECKS: dict[str, Callable[[], str]] = {
    "codecs": check_codecs,
    "sketch": check_sketch,
    "memory": check_memory,
    "rl": check_rl,
    "swarm": check_swarm,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    failed = False
    for name, check in CHECKS.items():
        try:
            results[name] = {"ok": True, "result": check()}
        except Exception as e:  # every check reports; the exit status says if any failed
            results[name] = {"ok": False, "result": f"{type(e).__name__}: {e}"}
            failed = True
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'}: {results[name]['result']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
