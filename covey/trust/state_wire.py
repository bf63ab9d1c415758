"""Local states on the wire: a worker's local state (parameters, inner optimizer tensors,
residuals) as safetensors bytes, its size without serializing, and its parsing against
the receiver's own layout (never unpickled). covey.trust.verify re-exports these."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save as st_save

from covey.algorithms.base import Strategy
from covey.trust.evidence import LOCAL_STATE_FORMAT, local_state_metadata


def local_state_to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """A local state as safetensors bytes (names sorted: equal states give equal bytes)."""
    tensors = {k: state[k].detach().contiguous().cpu() for k in sorted(state)}
    return st_save(tensors, metadata=local_state_metadata())


def local_state_nbytes(state: Mapping[str, torch.Tensor]) -> int:
    """len(local_state_to_bytes(state)), computed without serializing (a big model's local
    state is GBs: the coordinator only needs its size for the upload gate)."""
    from covey.protocol.checkpoint import safetensors_nbytes

    return safetensors_nbytes(state, local_state_metadata())


def published_state_nbytes(strategy: Strategy) -> int:
    """The bytes of one end state a worker of `strategy` publishes (covey.trust.evidence.
    evidence_of: its private state, on the wire), 0 for a strategy that carries no local
    state: what a drawn check's validator fetches per state, and what its deadline counts
    (covey.trust.policy.check_timeout_s)."""
    if not strategy.carries_local_state:
        return 0
    return local_state_nbytes(strategy.evidence_layout())


def local_state_from_bytes(
    data: bytes, template: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Parse a local state and check it against `template` (e.g. the validator's own
    `strategy.local_state_layout()`): the same names, shapes and dtypes, finite values.
    Never unpickles. ValueError naming the first problem."""
    try:
        tensors = st_load(data)
        (n,) = struct.unpack("<Q", data[:8])
        meta = _local_state_meta(data[8 : 8 + n])
    except (SafetensorError, ValueError, struct.error, TypeError) as e:
        raise ValueError(f"not a safetensors local state: {e}") from None
    return _checked_local_state(tensors, meta, template)


def local_state_from_file(
    path: Path, template: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`local_state_from_bytes` of a file, read tensor by tensor: the file's bytes are
    never held next to the tensors (a local state is 1.5 GB at 124M)."""
    from covey.protocol.checkpoint import read_header

    try:
        with open(path, "rb") as f:
            meta = _local_state_meta(read_header(f))
        tensors = st_load_file(str(path))
    except (SafetensorError, ValueError, struct.error, TypeError, OSError) as e:
        raise ValueError(f"not a safetensors local state: {e}") from None
    return _checked_local_state(tensors, meta, template)


def _local_state_meta(header: bytes) -> Any:
    parsed = json.loads(header)
    return json.loads((parsed.get("__metadata__") or {}).get("covey", "{}"))


def _checked_local_state(
    tensors: dict[str, torch.Tensor], meta: Any, template: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    if not isinstance(meta, dict) or meta.get("format") != LOCAL_STATE_FORMAT:
        raise ValueError(f"metadata format is not {LOCAL_STATE_FORMAT!r}")
    if missing := sorted(set(template) - set(tensors)):
        raise ValueError(f"local state lacks {missing[0]!r} ({len(missing)} entries missing)")
    if unexpected := sorted(set(tensors) - set(template)):
        raise ValueError(f"local state has unexpected entry {unexpected[0]!r}")
    for name in sorted(tensors):
        t, want = tensors[name], template[name]
        if t.shape != want.shape or t.dtype != want.dtype:
            raise ValueError(
                f"{name}: {tuple(t.shape)} {t.dtype}, expected {tuple(want.shape)} {want.dtype}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} has NaN or Inf values")
    return tensors
