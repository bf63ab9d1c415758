"""The trainer's optimizer moments on disk: AdamW's per-parameter state (step, exp_avg,
exp_avg_sq) saved with each policy version as safetensors (never pickle), so a restarted
trainer takes its next step exactly as an uninterrupted one would.

One file per version, `optimizer/v{N}.safetensors` in the run's data directory, written
(to a temporary name, then renamed) before version N is committed and the older files
removed after, so a crash at any point leaves the committed version's file in place.
Tensors are named `{parameter}.{exp_avg|exp_avg_sq|step}`; the metadata names the run,
the version and the policy's content id. Loading checks all of it against the run (names,
shapes, finite values, non-negative second moments and steps) and refuses anything else
with a `MomentsError` naming the file and the fault: a restart never trains on moments
of another run, version or model.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

KINDS = ("exp_avg", "exp_avg_sq", "step")


class MomentsError(ValueError):
    """Saved optimizer moments that do not fit the run, version or model."""


def moments_path(data_dir: Path, version: int) -> Path:
    return Path(data_dir) / "optimizer" / f"v{version}.safetensors"


def _names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's order (its state_dict indexes them so)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def save_moments(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path, meta: dict[str, str]
) -> None:
    """Write `optimizer`'s per-parameter state to `path` (atomically) with `meta`."""
    tensors: dict[str, torch.Tensor] = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for name, p in zip(_names(model, optimizer), params, strict=True):
        state = optimizer.state.get(p)
        if not state:
            continue  # never stepped (no gradient yet): nothing to keep
        for kind in KINDS:
            tensors[f"{name}.{kind}"] = (
                torch.as_tensor(state[kind]).detach().to("cpu", torch.float32).reshape(-1)
                if kind == "step"
                else state[kind].detach().to("cpu").contiguous()
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_moments(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path, expect: dict[str, str]
) -> int:
    """Load the moments at `path` into `optimizer` after checking the metadata equals
    `expect` and every tensor fits its parameter; returns how many parameters had state.
    MomentsError naming the file and the fault otherwise (nothing is loaded then)."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (OSError, SafetensorError, ValueError) as e:
        raise MomentsError(f"{path}: not a safetensors file of optimizer moments: {e}") from None
    for key, want in expect.items():
        if meta.get(key) != want:
            raise MomentsError(f"{path}: {key} is {meta.get(key)!r}, this run's is {want!r}")
    names = _names(model, optimizer)
    params = dict(zip(names, [p for g in optimizer.param_groups for p in g["params"]], strict=True))
    stated = {k.rsplit(".", 1)[0] for k in tensors}
    if unknown := stated - set(params):
        raise MomentsError(f"{path}: moments of unknown parameters {sorted(unknown)[:5]}")
    expected_keys = {f"{n}.{kind}" for n in stated for kind in KINDS}
    if set(tensors) != expected_keys:
        missing = sorted(expected_keys - set(tensors))[:5]
        raise MomentsError(f"{path}: incomplete moments, missing {missing}")
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, name in enumerate(names):
        if name not in stated:
            continue
        p = params[name]
        avg, sq, step = (tensors[f"{name}.{kind}"] for kind in KINDS)
        for kind, t in (("exp_avg", avg), ("exp_avg_sq", sq)):
            if t.shape != p.shape:
                raise MomentsError(
                    f"{path}: {name}.{kind} has shape {tuple(t.shape)}, the parameter "
                    f"{tuple(p.shape)}"
                )
            if not bool(torch.isfinite(t).all()):
                raise MomentsError(f"{path}: {name}.{kind} holds NaN or Infinity")
        if bool((sq < 0).any()):
            raise MomentsError(f"{path}: {name}.exp_avg_sq has negative entries")
        if step.numel() != 1 or not math.isfinite(s := float(step)) or s < 1 or s != int(s):
            raise MomentsError(f"{path}: {name}.step is {step.tolist()}, not a count >= 1")
        state[index] = {
            "step": torch.tensor(s, dtype=torch.float32),
            "exp_avg": avg.to(p.device, p.dtype),
            "exp_avg_sq": sq.to(p.device, p.dtype),
        }
    optimizer.load_state_dict(
        {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}
    )
    return len(state)


def prune_moments(data_dir: Path, keep: int) -> None:
    """Remove the moments of versions before `keep` (their versions are superseded)."""
    folder = Path(data_dir) / "optimizer"
    for f in folder.glob("v*.safetensors") if folder.is_dir() else ():
        stem = f.stem[1:]
        if stem.isdigit() and int(stem) < keep:
            f.unlink(missing_ok=True)
