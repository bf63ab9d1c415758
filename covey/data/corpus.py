"""Byte-level text corpora: the Python standard library by default, or the user's own files.

The reference corpus is every `.py` file of the running interpreter's standard library
(located with `sysconfig`, about 30 MB, no download). Documents are split into train and
held-out validation *by document*, deterministically, from a hash of each document's name,
so no worker ever trains on a validation file and every machine with the same Python
version gets the same split. The tokenizer is the identity on bytes (vocabulary 256).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl", ".json", ".c", ".h", ".html", ".tex"}


@dataclass(frozen=True)
class Corpus:
    """Token streams (uint8 byte ids) for training and held-out validation."""

    train: torch.Tensor  # (N_train,) uint8
    val: torch.Tensor  # (N_val,) uint8
    source: str
    n_train_docs: int
    n_val_docs: int

    @property
    def fingerprint(self) -> str:
        """sha256 over both splits: equal fingerprints mean bit-identical batches."""
        h = hashlib.sha256()
        h.update(self.train.numpy().tobytes())
        h.update(b"|")
        h.update(self.val.numpy().tobytes())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        return (
            f"{self.source}: {len(self.train) / 1e6:.1f} MB train in {self.n_train_docs} docs, "
            f"{len(self.val) / 1e6:.2f} MB validation in {self.n_val_docs} docs"
        )


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_documents() -> Iterator[tuple[str, bytes]]:
    root = stdlib_root()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/"):
            continue  # third-party code is not part of the standard library
        yield rel, path.read_bytes()


def _jsonl_documents(path: Path) -> Iterator[tuple[str, bytes]]:
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{lineno}: each JSONL record needs a string 'text' field")
            yield f"{path}:{lineno}", record["text"].encode("utf-8")


def _user_documents(paths: list[str]) -> Iterator[tuple[str, bytes]]:
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"--data path does not exist: {path}")
        files = (
            sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if path.is_dir()
            else [path]
        )
        if not files:
            raise ValueError(f"no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under {path}")
        for f in files:
            if f.suffix == ".jsonl":
                yield from _jsonl_documents(f)
            else:
                yield str(f), f.read_bytes()


def is_validation(name: str, val_fraction: float) -> bool:
    """Deterministic per-document split: a document is held out iff its name hashes low."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return h < val_fraction * 2**64


def load_corpus(paths: list[str] | None = None, val_fraction: float = 0.02) -> Corpus:
    """Load the stdlib corpus (no paths) or the user's files, directories and JSONL.

    Raises ValueError if either split would be too small to train or evaluate on.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    docs = list(_user_documents(paths) if paths else _stdlib_documents())
    source = ", ".join(paths) if paths else f"python stdlib ({stdlib_root()})"
    if len(docs) == 1:
        # One document cannot be split by document: hold out its tail instead.
        data = docs[0][1]
        cut = int(len(data) * (1 - val_fraction))
        train, val = [data[:cut]], [data[cut:]]
    else:
        train = [d for name, d in docs if not is_validation(name, val_fraction)]
        val = [d for name, d in docs if is_validation(name, val_fraction)]
    if not train or not val:
        raise ValueError(
            f"{source}: {len(docs)} documents give {len(train)} train / {len(val)} validation; "
            "add more documents or raise val_fraction"
        )

    def to_tensor(parts: list[bytes]) -> torch.Tensor:
        # Documents are joined with a NUL byte so no window silently spans two files unmarked.
        blob = b"\x00".join(parts)
        return torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy())

    return Corpus(to_tensor(train), to_tensor(val), source, len(train), len(val))
