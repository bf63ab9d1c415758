"""The randomness of a model's forward pass (dropout), made reproducible per inner step.

Verification re-executes a worker's inner steps (covey.trust.verify) and a referee
recomputes one segment of them starting mid-round (covey.trust.referee), so step s must
draw the same dropout masks on every machine whatever ran before it. Dropout in torch and
transformers draws from torch's global generators; an inner step runs under `step_rng`,
which seeds them from the step's own seed (covey.data.batches.step_seed: a function of the
run seed, round, data key and step alone) and restores them afterwards, so nothing leaks
into the next step or the caller. A model without randomness draws nothing: its numbers
do not change.

What this seeding cannot reproduce (a generator the model makes itself, Python's or
numpy's random module, a forward that is not deterministic given its inputs) is found by
`check_reproducible` at run start: two seeded forwards in train mode must agree bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from covey.models.hf import ModelSourceError

# config fields that turn dropout on, across the architectures transformers ships
DROPOUT_FIELDS = (
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_first_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "hidden_dropout",
    "attention_dropout",
    "embed_dropout",
    "resid_dropout",
    "dropout",
    "activation_dropout",
    "classifier_dropout",
)
PROBE_SEED = 0x5EED  # the seed both probe forwards run under
PROBE_TOKENS = 8  # the probe batch's length (inputs), capped by the run's context


@contextlib.contextmanager
def step_rng(device: torch.device, seed: int | None) -> Iterator[None]:
    """Run the block with torch's global generators (the CPU's, and `device`'s when it is
    a CUDA device) seeded from `seed`, and restore them afterwards; None: unseeded (the
    generators as they are, e.g. the simulator's). Reads and writes only the host-side
    generator state: no device synchronization."""
    if seed is None:
        yield
        return
    cuda = device.type == "cuda"
    index = device.index if device.index is not None else torch.cuda.current_device() if cuda else 0
    with torch.random.fork_rng(devices=[index] if cuda else [], device_type="cuda"):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def dropout_fields(model: nn.Module) -> dict[str, float]:
    """The model's (a Hugging Face model's `config`) dropout fields that are above 0."""
    config = getattr(model, "config", None)
    out = {}
    for name in DROPOUT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            out[name] = float(value)
    return out


def active_dropout(model: nn.Module) -> list[str]:
    """The names of the model's dropout modules that drop something (p > 0)."""
    return [
        name or type(model).__name__
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]


def check_reproducible(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    *,
    seq_len: int,
    vocab_size: int | None,
    source: str,
) -> None:
    """ModelSourceError, in one line, when two forwards in train mode under the same
    `step_rng` seed give different losses: the model's randomness is not drawn from torch's
    global generators, so no validator could re-execute its steps. The message names the
    config's dropout fields (if any) and what to change. Runs on the model's device, on
    a small fixed batch, without gradients; the model's mode, its buffers (batch norm's
    running statistics) and the global generators are left as they were."""
    device = next(model.parameters()).device
    tokens = min(PROBE_TOKENS, seq_len) + 1
    batch = (torch.arange(tokens, dtype=torch.int64) % (vocab_size or 256))[None, :]
    batch = batch.to(device)
    was_training = model.training
    buffers = {n: b.clone() for n, b in model.named_buffers()}  # a train forward moves some
    losses: list[Any] = []
    try:
        model.train()
        with torch.no_grad():
            for _ in range(2):
                with step_rng(device, PROBE_SEED):
                    losses.append(loss_fn(model, batch).detach().float().cpu())
    finally:
        model.train(was_training)
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
    if torch.equal(losses[0], losses[1]):
        return
    fields = dropout_fields(model)
    what = (
        f"config fields {', '.join(f'{k}={v:g}' for k, v in fields.items())}"
        if fields
        else "randomness in its forward pass"
    )
    hint = (
        "set them to 0 in config.json"
        if fields
        else "draw it from torch's global generator (no generator of its own, no random/numpy)"
    )
    raise ModelSourceError(
        f"model {source}: two forwards in train mode under the same seed differ "
        f"({float(losses[0]):.6g} vs {float(losses[1]):.6g}; {what}), so validators could "
        f"not re-execute its steps: {hint}"
    )
