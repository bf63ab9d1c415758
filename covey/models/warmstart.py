"""Warm start from a covey checkpoint: `model.init` naming a state file or a run directory.

`model.init` is either `hf:<dir>` (a Hugging Face model's own weights, loaded by
covey.models.source when the model is built) or a covey checkpoint, handled here:

- a state file in covey.protocol.checkpoint's layout (`params/<name>` tensors, safetensors:
  never pickle), e.g. `runs/warmup/checkpoints/round-001000.safetensors`;
- a run directory (`covey sim --out`, a coordinator's `--data-dir`): its latest
  `checkpoints/round-*.safetensors`.

Only the parameters are taken; outer optimizer state (DDP's Adam moments, DiLoCo's outer
momentum) starts fresh, as the DiLoCo paper's warm start does (arXiv 2311.08105, section 3).
Whoever owns a run's initial canonical state loads it: the simulator and the coordinator.
Peers receive that state over the network (its content id is the run's round-0 state), so
a worker never needs the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


class WarmStartError(ValueError):
    """A checkpoint that cannot start this model; the message names the path and reason."""


def is_checkpoint_init(init: str | None) -> bool:
    """Whether `init` names a covey checkpoint (anything but None and hf:<dir>)."""
    return init is not None and not init.startswith("hf:")


def checkpoint_file(init: str) -> Path:
    """The state file `init` names: the file itself, or a run directory's latest
    checkpoints/round-*.safetensors. WarmStartError when there is none."""
    path = Path(init).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted((path / "checkpoints").glob("round-*.safetensors"))
        if not found:
            raise WarmStartError(
                f"model.init {init!r}: a directory without checkpoints/round-*.safetensors "
                "(name a `covey sim --out` directory, a coordinator's --data-dir, or a file)"
            )
        return found[-1]
    raise WarmStartError(f"model.init {init!r}: no such file or directory")


def checkpoint_round(path: Path) -> int | None:
    """The round a covey state file records (None when it records none): the rounds the
    warm-up ran, which is what `data.round_offset` of a continuation should be."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = (f.metadata() or {}).get("covey")
    try:
        value = json.loads(meta).get("round") if meta else None
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def load_init_params(init: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters for `model`, checked: the same names, shapes and dtypes
    as the model's parameters, and finite values. WarmStartError naming the first
    mismatch; nothing is changed."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from covey.errors import UserError
    from covey.guards import check_sha256, expected_sha256

    path = checkpoint_file(init)
    try:  # a checkpoint `covey sim` wrote carries its hash (<file>.sha256); older ones do not
        check_sha256(path, expected_sha256(path))
    except UserError as e:
        raise WarmStartError(f"model.init: {e}") from None
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise WarmStartError(f"model.init {path}: not a safetensors state: {e}") from None
    params = {k[len("params/") :]: v for k, v in tensors.items() if k.startswith("params/")}
    want = dict(model.named_parameters())
    if set(params) != set(want):
        missing = sorted(set(want) - set(params))[:3]
        extra = sorted(set(params) - set(want))[:3]
        raise WarmStartError(
            f"model.init {path}: parameter names differ from the model's: missing {missing}, "
            f"unexpected {extra} (another model or size?)"
        )
    for name, t in params.items():
        w = want[name]
        if t.shape != w.shape or t.dtype != w.dtype:
            raise WarmStartError(
                f"model.init {path}: {name} is {tuple(t.shape)} {t.dtype}, the model's "
                f"{tuple(w.shape)} {w.dtype}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise WarmStartError(f"model.init {path}: {name} has NaN or Inf values")
    return params


def apply_init(model: nn.Module, init: str | None) -> Path | None:
    """Copy a covey checkpoint's parameters into `model` when `init` names one; returns
    the file used (None: random or hf: init, left as built). WarmStartError (a
    ValueError) when the checkpoint does not fit the model."""
    if not is_checkpoint_init(init):
        return None
    assert init is not None
    params = load_init_params(init, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return checkpoint_file(init)
