"""Corpus loading and the pure batch function."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from covey.data.batches import sample_batch, validation_batches, window_offsets
from covey.data.corpus import Corpus, is_validation, load_corpus


def test_batches_are_a_pure_function_of_their_arguments(tokens: torch.Tensor) -> None:
    args = dict(batch_size=4, seq_len=32, seed=3, round=5, worker=2, step=7)
    a = sample_batch(tokens, **args)
    assert a.shape == (4, 33) and a.dtype == torch.int64
    assert torch.equal(a, sample_batch(tokens, **args))
    for key, other in (("seed", 4), ("round", 6), ("worker", 3), ("step", 8)):
        assert not torch.equal(a, sample_batch(tokens, **{**args, key: other})), key
    # windows really are contiguous slices of the token stream
    off = window_offsets(len(tokens), 33, 4, seed=3, round=5, worker=2, step=7)
    for row, o in zip(a, off.tolist(), strict=True):
        assert torch.equal(row, tokens[o : o + 33].long())


def test_batch_offsets_golden() -> None:
    """Pinned values: if this changes, every recorded contribution becomes unverifiable."""
    off = window_offsets(10_000, 65, 8, seed=0, round=1, worker="peer-a", step=2)
    digest = hashlib.sha256(off.numpy().tobytes()).hexdigest()[:16]
    assert off.tolist()[:3] == GOLDEN_FIRST_OFFSETS
    assert digest == GOLDEN_DIGEST


GOLDEN_FIRST_OFFSETS = [4584, 9828, 2584]
GOLDEN_DIGEST = "874d9c08d313a926"


def test_batch_offsets_follow_the_documented_derivation() -> None:
    """Offset j = uint64 little-endian from BLAKE2b-512 of the key and a block counter,
    modulo the number of window starts: recomputed here without covey's code."""
    key = b"covey-batch/0/1/peer-a/2" + (0).to_bytes(4, "little")
    digest = hashlib.blake2b(key, digest_size=64).digest()
    expected = [int.from_bytes(digest[i : i + 8], "little") % (10_000 - 65 + 1) for i in (0, 8)]
    off = window_offsets(10_000, 65, 2, seed=0, round=1, worker="peer-a", step=2)
    assert off.tolist() == expected


def test_window_larger_than_split_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fewer than one window"):
        window_offsets(10, 65, 1, seed=0, round=0, worker=0, step=0)


def test_stdlib_corpus_split_is_by_document_and_held_out(stdlib_corpus: Corpus) -> None:
    c = stdlib_corpus
    total = len(c.train) + len(c.val)
    assert 10e6 < total < 80e6  # "about 30 MB" of .py files, varying by Python version
    assert 0.005 < c.n_val_docs / (c.n_train_docs + c.n_val_docs) < 0.05
    assert c.fingerprint == load_corpus().fingerprint  # deterministic
    assert c.train.dtype == torch.uint8


def test_validation_batches_come_from_the_held_out_split(stdlib_corpus: Corpus) -> None:
    vb = validation_batches(stdlib_corpus, n_batches=2, batch_size=3, seq_len=16)
    assert len(vb) == 2 and vb[0].shape == (3, 17)
    val_bytes = stdlib_corpus.val.numpy().tobytes()
    for b in vb:
        for row in b:
            assert bytes(row.tolist()) in val_bytes


def test_user_text_dirs_and_jsonl(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(200):
        (docs / f"doc{i}.txt").write_text(f"document number {i} " * 20)
    (docs / "ignored.bin").write_bytes(b"\x00\x01")
    jsonl = tmp_path / "extra.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"record {i} " * 10}) for i in range(100)))
    c = load_corpus([str(docs), str(jsonl)], val_fraction=0.1)
    assert c.n_train_docs + c.n_val_docs == 300
    assert c.n_val_docs > 0
    train = c.train.numpy().tobytes()
    for i in range(200):
        name = str(docs / f"doc{i}.txt")
        assert (f"document number {i} ".encode() in train) != is_validation(name, 0.1)


def test_single_file_holds_out_its_tail(tmp_path: Path) -> None:
    f = tmp_path / "one.txt"
    f.write_text("abcdefghij" * 1000)
    c = load_corpus([str(f)], val_fraction=0.1)
    assert len(c.val) == 1000 and len(c.train) == 9000


@pytest.mark.parametrize(
    ("content", "match"),
    [("{not json}\n", "not valid JSON"), ('{"txt": "x"}\n', "'text' field"), ("[1]\n", "'text'")],
)
def test_bad_jsonl_names_the_line(tmp_path: Path, content: str, match: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n' + content)
    with pytest.raises(ValueError, match=match) as e:
        load_corpus([str(f)])
    assert "bad.jsonl:2" in str(e.value)


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus([str(tmp_path / "nope")])
