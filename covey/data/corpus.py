"""Token corpora: the Python standard library by default, or the user's own data.

The reference corpus is the `.py` files of the running interpreter's standard library
(located with `sysconfig`, no download), limited to the modules every distribution of a
CPython version ships (see STDLIB_EXCLUDED), named relative to the stdlib root: its
fingerprint is the same on every machine with that Python version. User data comes from
covey.data.sources (text, JSONL, JSON/CSV/Parquet/Arrow, `save_to_disk` dirs).

Documents are split into train and held-out validation *by document*, deterministically,
from a hash of each document's name, so no worker ever trains on a validation document.
Each split is one packed token stream with the tokenizer's EOS between documents (bytes:
NUL, as always); training windows are cut from it (covey.data.batches). The streams are
written to unlinked temporary files and memory-mapped as they are tokenized, so memory does
not grow with the dataset.
"""

from __future__ import annotations

import hashlib
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import IO

import numpy as np
import torch

from covey.data.sources import TEXT_SUFFIXES, Document, user_documents
from covey.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = ["TEXT_SUFFIXES", "Corpus", "is_validation", "load_corpus", "stdlib_documents"]

# Parts of the stdlib that distributions ship separately (Debian: idle, tk, lib2to3,
# distutils, venv's ensurepip), that vary by build (_sysconfigdata*, config-*), or that are
# not the library itself (tests, demos, third-party site-packages).
STDLIB_EXCLUDED_DIRS = {
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "distutils", "ensurepip",
    "site-packages", "dist-packages", "__phello__", "__pycache__",
}  # fmt: skip
STDLIB_EXCLUDED_PREFIXES = ("_sysconfigdata", "config-", "_distutils_system_mod", "sitecustomize")
CHUNK_DOCS = 256  # documents tokenized per batch


@dataclass(frozen=True)
class Corpus:
    """Token streams for training and held-out validation (uint8 for bytes, int32 else)."""

    train: torch.Tensor  # (N_train,)
    val: torch.Tensor  # (N_val,)
    source: str
    n_train_docs: int
    n_val_docs: int
    tokenizer: str = "bytes"
    vocab_size: int = 256

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over both splits: equal fingerprints mean bit-identical batches."""
        h = hashlib.sha256()
        _hash_tensor(h, self.train)
        h.update(b"|")
        _hash_tensor(h, self.val)
        return h.hexdigest()[:16]

    def describe(self) -> str:
        unit = "MB" if self.tokenizer == "bytes" else "M tokens"
        return (
            f"{self.source}: {len(self.train) / 1e6:.1f} {unit} train in {self.n_train_docs} "
            f"docs, {len(self.val) / 1e6:.2f} {unit} validation in {self.n_val_docs} docs"
        )


def _hash_tensor(h: hashlib._Hash, t: torch.Tensor) -> None:
    data = memoryview(t.numpy()).cast("B")  # no copy: a memory-mapped split stays on disk
    for i in range(0, len(data), 1 << 24):
        h.update(data[i : i + (1 << 24)])


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(root: Path | None = None) -> Iterator[Document]:
    """The stdlib's `.py` files every CPython distribution ships, named relative to root."""
    root = root or stdlib_root()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        parts = path.relative_to(root).parts
        if any(p in STDLIB_EXCLUDED_DIRS for p in parts[:-1]):
            continue
        if any(p.startswith(STDLIB_EXCLUDED_PREFIXES) for p in parts):
            continue
        yield "/".join(parts), path.read_bytes()


def is_validation(name: str, val_fraction: float) -> bool:
    """Deterministic per-document split: a document is held out iff its name hashes low."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return h < val_fraction * 2**64


class _PackedStream:
    """Documents' token ids appended to an unlinked temp file, EOS between documents."""

    def __init__(self, dtype: type[np.generic], eos: int) -> None:
        # closed with the stream: the memory map keeps its own handle on the file
        self.file: IO[bytes] = tempfile.TemporaryFile(prefix="covey-tokens-")  # noqa: SIM115
        self.dtype, self.eos = np.dtype(dtype), eos
        self.docs = self.tokens = 0

    def add(self, ids: list[int] | bytes) -> None:
        arr = np.frombuffer(ids, np.uint8) if isinstance(ids, bytes) else np.asarray(ids)
        if self.docs:
            np.asarray([self.eos], self.dtype).tofile(self.file)
            self.tokens += 1
        arr.astype(self.dtype, copy=False).tofile(self.file)
        self.docs += 1
        self.tokens += len(arr)

    def tensor(self) -> torch.Tensor:
        self.file.flush()
        if self.tokens == 0:
            return torch.zeros(0, dtype=torch.from_numpy(np.zeros(0, self.dtype)).dtype)
        # copy-on-write mapping: a writable array for torch, never written back
        mapped = np.memmap(self.file, dtype=self.dtype, mode="c", shape=(self.tokens,))
        return torch.from_numpy(mapped)


def load_corpus(
    paths: list[str] | None = None,
    val_fraction: float = 0.02,
    tokenizer: str | Tokenizer = "bytes",
    text_column: str = "text",
) -> Corpus:
    """Tokenize and pack the stdlib corpus (no paths) or the user's data.

    Raises FileNotFoundError for a missing path and ValueError for a bad record, a missing
    column, an empty dataset, or a split too small to train or evaluate on.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    docs = user_documents(paths, text_column, tok.render_chat) if paths else stdlib_documents()
    source = ", ".join(paths) if paths else "python stdlib"
    dtype = np.uint8 if tok.vocab_size <= 256 else np.int32
    train, val = _PackedStream(dtype, tok.eos_id), _PackedStream(dtype, tok.eos_id)
    chunk: list[Document] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == CHUNK_DOCS:
            _pack(chunk, tok, val_fraction, train, val)
            chunk = []
    _pack(chunk, tok, val_fraction, train, val)
    n_docs = train.docs + val.docs
    if n_docs == 0 or train.tokens + val.tokens == 0:
        raise ValueError(f"{source}: the dataset is empty (no documents with any text)")
    train_t, val_t = train.tensor(), val.tensor()
    if n_docs == 1:
        # One document cannot be split by document: hold out its tail instead.
        data = train_t if train.docs else val_t
        cut = int(len(data) * (1 - val_fraction))
        train_t, val_t = data[:cut], data[cut:]
    elif not train.docs or not val.docs:
        raise ValueError(
            f"{source}: {n_docs} documents give {train.docs} train / {val.docs} validation; "
            "add more documents or raise val_fraction"
        )
    return Corpus(
        train_t,
        val_t,
        source,
        train.docs if n_docs > 1 else 1,
        val.docs if n_docs > 1 else 1,
        tok.source,
        tok.vocab_size,
    )


def _pack(
    chunk: list[Document],
    tok: Tokenizer,
    val_fraction: float,
    train: _PackedStream,
    val: _PackedStream,
) -> None:
    if not chunk:
        return
    if isinstance(tok, ByteTokenizer):
        encoded: list[list[int] | bytes] = [
            c if isinstance(c, bytes) else c.encode("utf-8") for _, c in chunk
        ]
    else:
        texts = [
            c.decode("utf-8", errors="replace") if isinstance(c, bytes) else c for _, c in chunk
        ]
        if isinstance(tok, HFTokenizer):
            encoded = list(tok.encode_batch(texts))
        else:
            encoded = [tok.encode(t) for t in texts]
    for (name, _), ids in zip(chunk, encoded, strict=True):
        if len(ids):
            (val if is_validation(name, val_fraction) else train).add(ids)
