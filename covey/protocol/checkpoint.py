"""Canonical training state on the wire and on disk: safetensors, never pickle.

Layout: tensors "params/<name>" and "outer/<name>", metadata {"format": FORMAT, "round": r}.
safetensors orders tensors deterministically, so equal states give equal bytes and hence
equal content ids: a peer that applied a round correctly holds the very blob the
coordinator published, and can serve it to joiners.
"""

from __future__ import annotations

import json
import struct

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from covey.algorithms import TrainState

FORMAT = "covey-state-1"


class CheckpointError(ValueError):
    """Bytes that are not a valid state for this run; the message says what is wrong."""


def state_to_bytes(state: TrainState) -> bytes:
    """Bytes that depend only on the state's content (names sorted), never on dict order."""
    named = {f"params/{n}": t for n, t in state.params.items()}
    named.update({f"outer/{n}": t for n, t in state.outer.items()})
    tensors = {k: named[k].detach().contiguous().cpu() for k in sorted(named)}
    # one metadata key: safetensors writes its metadata map in a per-process random order
    meta = json.dumps({"format": FORMAT, "round": state.round}, sort_keys=True)
    return st_save(tensors, metadata={"covey": meta})


def state_from_bytes(data: bytes, template: TrainState) -> TrainState:
    """Parse and check a state against the run's template (initial state): the same
    parameter names, shapes and dtypes, finite values, and outer tensors named like the
    parameters (or optimizer scalars such as "step"). CheckpointError on any mismatch."""
    try:
        tensors = st_load(data)
        meta = _metadata(data)
    except (SafetensorError, ValueError) as e:
        raise CheckpointError(f"not a safetensors state: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"format {meta.get('format')!r} is not {FORMAT!r}")
    round_ = meta.get("round")
    if not isinstance(round_, int) or round_ < 0:
        raise CheckpointError(f"metadata round {round_!r} is not a round number")
    params = {k[7:]: v for k, v in tensors.items() if k.startswith("params/")}
    outer = {k[6:]: v for k, v in tensors.items() if k.startswith("outer/")}
    if len(params) + len(outer) != len(tensors):
        raise CheckpointError("tensors outside the params/ and outer/ sections")
    if set(params) != set(template.params):
        missing = sorted(set(template.params) - set(params))[:3]
        extra = sorted(set(params) - set(template.params))[:3]
        raise CheckpointError(f"parameter names differ: missing {missing}, unexpected {extra}")
    for name, t in params.items():
        want = template.params[name]
        if t.shape != want.shape or t.dtype != want.dtype:
            raise CheckpointError(
                f"{name}: {tuple(t.shape)} {t.dtype}, expected {tuple(want.shape)} {want.dtype}"
            )
    for name, t in outer.items():
        if name in template.params and t.shape != template.params[name].shape:
            raise CheckpointError(f"outer/{name}: shape {tuple(t.shape)} does not match")
    for name, t in {**params, **outer}.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{name} has NaN or Inf values")
    return TrainState(params, outer, round_)


def _metadata(data: bytes) -> dict[str, object]:
    (n,) = struct.unpack("<Q", data[:8])  # st_load already checked the header's bounds
    header = json.loads(data[8 : 8 + n])
    meta = json.loads((header.get("__metadata__") or {}).get("covey", "{}"))
    if not isinstance(meta, dict):
        raise ValueError("covey metadata is not a table")
    return meta
