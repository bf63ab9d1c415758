"""Canonical training state on the wire and on disk: safetensors, never pickle.

Layout: tensors "params/<name>" and "outer/<name>", metadata {"format": FORMAT, "round": r}.
safetensors orders tensors deterministically, so equal states give equal bytes and hence
equal content ids: a peer that applied a round correctly holds the very blob the
coordinator published, and can serve it to joiners.

States of any size: `write_state` streams the same bytes as `state_to_bytes` to a file,
tensor by tensor, hashing them on the way (safetensors' own writers first copy every
tensor to bytes, which doubles a big model's memory), and `state_from_file` reads one
back from disk without a second copy of the file in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save as st_save

from covey.algorithms import TrainState

FORMAT = "covey-state-1"


class CheckpointError(ValueError):
    """Bytes that are not a valid state for this run; the message says what is wrong."""


# safetensors' dtype names, and the order in which it lays tensors out: by dtype, largest
# alignment first (its Dtype enum, descending), then by name. write_state must match it
# byte for byte: tests/test_blobs_large.py checks it against safetensors itself.
_DTYPES: dict[torch.dtype, tuple[int, str]] = {
    torch.int64: (0, "I64"),
    torch.float64: (1, "F64"),
    torch.float32: (2, "F32"),
    torch.int32: (3, "I32"),
    torch.bfloat16: (4, "BF16"),
    torch.float16: (5, "F16"),
    torch.int16: (6, "I16"),
    torch.int8: (7, "I8"),
    torch.uint8: (8, "U8"),
    torch.bool: (9, "BOOL"),
}
_WRITE_BYTES = 8 << 20  # write_state hands the file this much of a tensor at a time


def _named(state: TrainState) -> dict[str, torch.Tensor]:
    named = {f"params/{n}": t for n, t in state.params.items()}
    named.update({f"outer/{n}": t for n, t in state.outer.items()})
    return {k: named[k].detach() for k in sorted(named)}


def _meta(state: TrainState) -> dict[str, str]:
    # one metadata key: safetensors writes its metadata map in a per-process random order
    return {"covey": json.dumps({"format": FORMAT, "round": state.round}, sort_keys=True)}


def max_state_bytes(template: TrainState) -> int:
    """The most bytes a canonical state of this run can take: its parameters and up to
    three optimizer tensors of each (AdamW's two moments, a momentum), plus room for the
    header and optimizer scalars. A peer fetches states up to this size and no further:
    the bound comes from the run's model, never from what a provider declares."""
    params = sum(t.numel() * t.element_size() for t in template.params.values())
    return 4 * params + (64 << 20)


def state_to_bytes(state: TrainState) -> bytes:
    """Bytes that depend only on the state's content (names sorted), never on dict order.
    Holds the whole state twice in memory: big states go through `write_state`."""
    tensors = {k: t.contiguous().cpu() for k, t in _named(state).items()}
    return st_save(tensors, metadata=_meta(state))


def write_state(state: TrainState, f: BinaryIO) -> tuple[str, int]:
    """Write exactly `state_to_bytes(state)` to `f`, one tensor (in pieces) at a time, and
    return (content id, size). Memory beyond the state: one tensor's contiguous CPU copy
    when it is not already one. ValueError for a dtype safetensors has no name for here."""
    return write_safetensors(_named(state), _meta(state), f)


def write_safetensors(
    named: Mapping[str, torch.Tensor], metadata: dict[str, str], f: BinaryIO
) -> tuple[str, int]:
    """Write exactly `safetensors.torch.save(named, metadata=metadata)` to `f`, one tensor
    (in pieces) at a time, hashing it on the way -> (content id, size). Memory beyond
    the tensors: one tensor's contiguous CPU copy when it is not already one (a local
    state's 1.5 GB at 124M is never held as bytes). ValueError for a dtype
    safetensors has no name for here."""
    text, order = _layout(named, metadata)
    h = hashlib.sha256()
    size = 0

    def out(piece: bytes | memoryview) -> None:
        nonlocal size
        h.update(piece)
        f.write(piece)
        size += len(piece)

    out(struct.pack("<Q", len(text)) + text)
    for k in order:
        t = named[k].detach().contiguous().cpu().reshape(-1)
        raw = memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        for start in range(0, len(raw), _WRITE_BYTES):
            out(raw[start : start + _WRITE_BYTES])
    return h.hexdigest(), size


def _layout(named: Mapping[str, torch.Tensor], meta: dict[str, str]) -> tuple[bytes, list[str]]:
    """safetensors' header for these tensors (8-byte padded JSON) and their order in the
    file. ValueError for a dtype safetensors has no name for here."""
    for k, t in named.items():
        if t.dtype not in _DTYPES:
            raise ValueError(f"{k}: dtype {t.dtype} cannot be written as a state")
    order = sorted(named, key=lambda k: (_DTYPES[named[k].dtype][0], k))
    header: dict[str, object] = {"__metadata__": meta}
    offset = 0
    for k in order:
        t = named[k]
        n = t.numel() * t.element_size()
        header[k] = {
            "dtype": _DTYPES[t.dtype][1],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes with spaces
    return text, order


def safetensors_nbytes(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """len(safetensors.torch.save(tensors, metadata=metadata)), from names, dtypes and
    shapes alone: nothing is copied or serialized. ValueError for an unknown dtype."""
    text, _ = _layout(tensors, metadata)
    return 8 + len(text) + sum(t.numel() * t.element_size() for t in tensors.values())


def state_to_file(state: TrainState, path: Path) -> tuple[str, int]:
    """`write_state` into a new file at `path`; returns (content id, size). OSError on I/O."""
    with open(path, "wb") as f:
        return write_state(state, f)


def read_header(f: BinaryIO) -> bytes:
    """The JSON header of the safetensors file open in `f` (at its start), bounded at
    100 MiB. ValueError when the file is too short or the length is out of bounds."""
    head = f.read(8)
    if len(head) != 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > 100 << 20:
        raise ValueError(f"header of {n} bytes")
    text = f.read(n)
    if len(text) != n:
        raise ValueError(f"header of {n} bytes, {len(text)} in the file")
    return text


def state_from_file(path: Path, template: TrainState, outer_on_disk: bool = False) -> TrainState:
    """`state_from_bytes` for a file, read from disk tensor by tensor (the file is never
    held whole in memory). CheckpointError on any mismatch, as there.

    safetensors' tensors map the file: the pages read stay this process's memory for as
    long as any of them lives, a dropped tensor's included. `outer_on_disk`: the weights
    are read into tensors of their own instead (pread, as `FileTensors` reads), and the
    outer tensors are checked one at a time and left in the file, the state's `outer`
    a `FileTensors` over it: one model size in memory, not the whole file,
    for a peer that needs the weights only (a validator). The same content; the file's
    descriptor is held, so it may be deleted."""
    try:
        with open(path, "rb") as f:
            meta = _header_metadata(read_header(f))
        tensors = st_load_file(str(path))  # checks the layout (no page is read yet)
        if outer_on_disk:
            n_tensors = len(tensors)
            del tensors  # and its mapping: the same bytes are read with pread below
            params, outer = FileTensors(path, "params/"), FileTensors(path, "outer/")
    except (SafetensorError, ValueError, OSError) as e:
        raise CheckpointError(f"not a safetensors state: {e}") from None
    if not outer_on_disk:
        return _checked(tensors, meta, template)
    if len(params) + len(outer) != n_tensors:
        raise CheckpointError("tensors outside the params/ and outer/ sections")
    try:
        state = _checked({f"params/{n}": params[n] for n in params}, meta, template)
        for name in outer:  # as `_checked` checks them, one in memory at a time
            _checked_outer(name, outer[name], template)
    except OSError as e:
        raise CheckpointError(f"not a safetensors state: {e}") from None
    state.outer = outer  # type: ignore[assignment]
    return state


def state_from_bytes(data: bytes, template: TrainState) -> TrainState:
    """Parse and check a state against the run's template (initial state): the same
    parameter names, shapes and dtypes, finite values, and outer tensors named like the
    parameters (or optimizer scalars such as "step"). CheckpointError on any mismatch."""
    try:
        tensors = st_load(data)
        meta = _metadata(data)
    except (SafetensorError, ValueError) as e:
        raise CheckpointError(f"not a safetensors state: {e}") from None
    return _checked(tensors, meta, template)


def _checked(
    tensors: dict[str, torch.Tensor], meta: dict[str, object], template: TrainState
) -> TrainState:
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


def _checked_outer(name: str, t: torch.Tensor, template: TrainState) -> None:
    """`_checked`'s checks of one outer tensor: its shape, finite values."""
    if name in template.params and t.shape != template.params[name].shape:
        raise CheckpointError(f"outer/{name}: shape {tuple(t.shape)} does not match")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{name} has NaN or Inf values")


def _metadata(data: bytes) -> dict[str, object]:
    (n,) = struct.unpack("<Q", data[:8])  # st_load already checked the header's bounds
    return _header_metadata(data[8 : 8 + n])


def _header_metadata(raw: bytes) -> dict[str, object]:
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a table")
    meta = json.loads((header.get("__metadata__") or {}).get("covey", "{}"))
    if not isinstance(meta, dict):
        raise ValueError("covey metadata is not a table")
    return meta


_BY_NAME = {name: dtype for dtype, (_, name) in _DTYPES.items()}


class FileTensors(MutableMapping[str, torch.Tensor]):
    """The tensors of a safetensors file under `prefix` (the prefix cut off their names),
    read from disk each time one is asked for: a fresh tensor filled by `pread`, so the
    file's pages never count as this process's memory (an mmap's would). A peer keeps a
    state's outer momentum like this between rounds (a model size less while it trains;
    docs/memory.md). Setting or deleting an entry changes this mapping only, never the file.
    The file's descriptor is held: it stays readable once deleted from its directory.

    CheckpointError for a file that is not safetensors or holds a dtype covey does not
    write; OSError when it cannot be opened or read."""

    def __init__(self, path: Path, prefix: str = "") -> None:
        with open(path, "rb") as f:
            try:
                text = read_header(f)
                header = json.loads(text)
            except ValueError as e:
                raise CheckpointError(f"{path.name}: {e}") from None
        n = len(text)
        self._entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
        for key, spec in header.items():
            if key == "__metadata__" or not key.startswith(prefix):
                continue
            if spec["dtype"] not in _BY_NAME:
                raise CheckpointError(f"{key}: dtype {spec['dtype']} is not one covey writes")
            begin, end = spec["data_offsets"]
            self._entries[key[len(prefix) :]] = (
                _BY_NAME[spec["dtype"]], list(spec["shape"]), 8 + n + begin, end - begin
            )  # fmt: skip
        self._set: dict[str, torch.Tensor] = {}
        self._fd = os.open(path, os.O_RDONLY)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._set:
            return self._set[key]
        dtype, shape, at, nbytes = self._entries[key]  # KeyError: not in the file
        t = torch.empty(shape, dtype=dtype)
        raw = t.reshape(-1).view(torch.uint8).numpy()  # as bytes: numpy has no bfloat16
        got = os.preadv(self._fd, [raw], at) if nbytes else 0
        if got != nbytes:
            raise OSError(f"state file: read {got} of {nbytes} bytes of {key}")
        return t

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self._entries.pop(key, None)
        self._set[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self._set:
            del self._set[key]
        else:
            del self._entries[key]

    def __contains__(self, key: object) -> bool:  # without reading the tensor
        return key in self._entries or key in self._set

    def __iter__(self) -> Iterator[str]:
        return iter([*self._entries, *self._set])

    def __len__(self) -> int:
        return len(self._entries) + len(self._set)

    def __del__(self) -> None:
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)
