"""Dishonest inference workers (and a lazy validator, caught by covey.serve.canaries), for
tests and `covey bench serve` only (honest code never imports this module:
tests/test_layers.py). Each saves compute or money in a way a real
cheat would, and each must be caught by the answer check (covey.serve.checks):

- other_weights: the served weights perturbed by 1e-3 relative (a fine-tuned copy);
- quantized: the weights rounded to bfloat16 (a cheaper copy);
- other_model: another model of the same shapes (fresh random weights);
- other_settings: the job's temperature halved (a "sharper" sampler);
- edited_tokens: an honest answer with one token changed (censorship, an injected link).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from covey.serve.validator import ServeValidator
from covey.serve.wire import Job
from covey.serve.worker import ServeWorker

CHEATS = ("other_weights", "quantized", "other_model", "other_settings", "edited_tokens")


@torch.no_grad()
def corrupt(model: torch.nn.Module, cheat: str, seed: int = 1) -> torch.nn.Module:
    """`model` changed in place as the weight cheats do; other cheats leave it as it is."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if cheat == "other_weights":
            p.add_(torch.randn(p.shape, generator=g) * 1e-3 * p.abs().mean())
        elif cheat == "quantized":
            p.copy_(p.to(torch.bfloat16).float())
        elif cheat == "other_model":
            p.copy_(torch.randn(p.shape, generator=g) * p.std().clamp_min(1e-3) + p.mean())
    return model


def cheat_answer(model: torch.nn.Module, job: Job, cheat: str) -> tuple[list[int], bytes]:
    """What a worker of `cheat` returns for `job` under `model` (already corrupted)."""
    temperature = job.temperature / 2 if cheat == "other_settings" else job.temperature
    honest = SimpleNamespace(model=model, progress=lambda *_: None)
    tokens, proof = ServeWorker.answer(honest, job.model_copy(update={"temperature": temperature}))
    if cheat != "edited_tokens":
        return tokens, proof
    i = len(tokens) // 2
    vocab = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]
    edit = (tokens[i] + 1) % vocab
    tokens[i] = edit if edit != job.eos_id else (edit + 1) % vocab
    return tokens, proof


class CheatingServeWorker(ServeWorker):
    def __init__(self, *args: Any, cheat: str, **kwargs: Any) -> None:
        if cheat not in CHEATS:
            raise ValueError(f"cheat {cheat!r}: expected one of {CHEATS}")
        self.cheat = cheat
        super().__init__(*args, **kwargs)

    def load(self, model_dir: str | Path) -> tuple[Any, Any]:
        model, tok = super().load(model_dir)
        return corrupt(model, self.cheat), tok

    def answer(self, job: Job) -> tuple[list[int], bytes]:
        return cheat_answer(self.model, job, self.cheat)


def serve_worker(cheat: str, *args: Any, **kwargs: Any) -> ServeWorker:
    """An honest worker, or a cheating one (`cheat` in CHEATS)."""
    if cheat == "honest":
        return ServeWorker(*args, **kwargs)
    return CheatingServeWorker(*args, cheat=cheat, **kwargs)


class LazyServeValidator(ServeValidator):
    """A validator that reports every answer good without checking it (it saves the
    prefill and is paid per check): the serving mode's canaries catch it
    (covey.serve.canaries)."""

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        report = {**self.body(), "answer_id": task["answer_id"], "ok": True, "problem": None}
        report["detail"] = ""
        return {**report, **self.client.post("/v1/serve/report", report)}
