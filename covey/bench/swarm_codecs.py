"""`covey bench swarm-codecs`: what each activation codec between SWARM stages costs in
bytes on the wire and in loss, over the same tokens.

Loss: one process trains the bench's model (covey.bench.swarm.SETTINGS: 4-layer GPT,
n_embd 64, 2 stages, microbatches of 4 x 32 stdlib bytes) for the same seeded microbatches
with each codec between the stages (covey.swarm.pipeline: fp32, blockwise 8-bit, subspace
at several ranks), stepping AdamW every `target_samples`, then reports the held-out loss
(the same validation batches, forward through the same codec). Bytes: a coordinator and
two stage servers in this process over real sockets (covey.swarm.local), a trainer sends
microbatches and counts the payload bytes between stages per microbatch.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CODECS = ("plain", "int8", "subspace:4", "subspace:8", "subspace:16")


def _cfg(codec: str, seed: int = 0) -> Any:
    from covey.bench.swarm import SETTINGS
    from covey.swarm.config import SwarmConfig

    name, _, rank = codec.partition(":")
    extra = {"subspace_rank": int(rank)} if rank else {}
    return SwarmConfig(**{**SETTINGS, "codec": name, **extra, "verify_rate": 0.0,
                          "rebalance_s": 3600.0, "seed": seed})  # fmt: skip


def loss_run(codec: str, microbatches: int, train: Any, val: Any, seed: int = 0) -> dict[str, Any]:
    """Train from `seed` (weights, basis, batches) with `codec` between the stages;
    held-out loss at the end (the same held-out batches for every seed)."""
    import torch

    from covey.data.batches import sample_batch
    from covey.swarm.pipeline import int8_wire, plain_wire, train_microbatch
    from covey.swarm.pipeline import train_microbatch_subspace as sub_microbatch
    from covey.swarm.subspace import for_run
    from covey.swarm.wire import build_stage

    cfg = _cfg(codec, seed)
    stages = [build_stage(cfg, k) for k in range(cfg.stages)]
    wire = int8_wire(64) if cfg.codec == "int8" else plain_wire()
    sw = for_run(cfg) if cfg.codec == "subspace" else None
    losses, sent = [], 0

    def batch(tokens: Any, i: int, who: str) -> Any:
        return sample_batch(tokens, batch_size=cfg.microbatch, seq_len=cfg.seq_len,
                            seed=0 if who == "held-out" else seed, round=0, worker=who,
                            step=i)  # fmt: skip

    for i in range(microbatches):
        b = batch(train, i, "codecs")
        if sw is not None:
            loss, n = sub_microbatch(stages, b, sw)
            sent += n
        else:
            loss = train_microbatch(stages, b, wire)
        losses.append(loss)
        for s in stages:
            s.maybe_step()
    held = []
    with torch.no_grad():
        for i in range(16):
            b = batch(val, i, "held-out")
            ids, x = b[:, :-1], b[:, :-1]
            for s in stages[:-1]:
                h = s.forward(x)
                x = sw.from_coeffs(sw.to_coeffs(h, ids), ids) if sw is not None else wire(h)
            logits = stages[-1].forward(x)
            held.append(float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1))))  # fmt: skip
    return {
        "codec": codec,
        "seed": seed,
        "microbatches": microbatches,
        "train_loss_last_50": sum(losses[-50:]) / len(losses[-50:]),
        "held_out_loss": sum(held) / len(held),
    }


def wire_bytes(codec: str, samples: int = 32) -> int:
    """Payload bytes between stages per microbatch, counted by a trainer over HTTP."""
    import torch

    from covey.swarm.local import LocalSwarm
    from covey.swarm.trainer import SwarmTrainer

    cfg = _cfg(codec)
    with tempfile.TemporaryDirectory(prefix="covey-codecs-") as work:
        s = LocalSwarm(cfg, Path(work))
        try:
            for k in range(cfg.stages):
                s.add_server(f"c{k}", k)
            s.ready([f"c{k}" for k in range(cfg.stages)])
            tokens = torch.randint(0, 256, (1 << 16,), generator=torch.Generator().manual_seed(0))
            t = SwarmTrainer(s.url, name="codecs", inflight=1, progress=lambda _: None,
                             tokens=tokens)  # fmt: skip
            st = t.train(samples=samples)
            t.close()
            return round(st.bytes_between_stages / max(st.microbatches, 1))
        finally:
            s.close()


def run_codecs(
    microbatches: int,
    seeds: int,
    json_path: Path | None,
    echo: Callable[[str], None],
    codecs: tuple[str, ...] = CODECS,
) -> list[dict[str, Any]]:
    """One row per codec: bytes per microbatch over HTTP, held-out loss per seed and its
    mean, and the mean's change against fp32 (the same seeds and tokens)."""
    import torch

    from covey.data.corpus import load_corpus

    torch.set_num_threads(1)
    corpus = load_corpus()
    rows = []
    for codec in codecs:
        runs = [loss_run(codec, microbatches, corpus.train, corpus.val, s) for s in range(seeds)]
        held = [r["held_out_loss"] for r in runs]
        row = {
            "codec": codec,
            "microbatches": microbatches,
            "held_out_loss_per_seed": [round(h, 4) for h in held],
            "held_out_loss": sum(held) / len(held),
            "bytes_per_microbatch_http": wire_bytes(codec),
        }
        echo(json.dumps(row))
        rows.append(row)
    base = rows[0]["held_out_loss"]
    for r in rows:
        r["held_out_vs_plain"] = round(r["held_out_loss"] / base - 1, 4)
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=1) + "\n")
    return rows
