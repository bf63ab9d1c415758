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
    assert 5e6 < total < 40e6  # about 10 MB of .py files, varying by Python version
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
        name = f"docs/doc{i}.txt"  # named inside its directory argument, not by full path
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


# --- portable stdlib corpus and user data formats ------------------------------------


CLUTTER = (
    "test/test_x.py",
    "idlelib/idle.py",
    "tkinter/tk.py",
    "lib2to3/fix.py",
    "site-packages/third.py",
    "_sysconfigdata__linux.py",
    "pkg/tests/t.py",
)


def _fake_stdlib(root: Path, clutter: bool) -> Path:
    for i in range(30):
        (root / "pkg").mkdir(parents=True, exist_ok=True)
        (root / ("pkg" if i % 2 else "") / f"mod{i}.py").write_text(f"x = {i}\n" * 50)
    if clutter:  # what some distributions add or leave out: never part of the corpus
        for rel in CLUTTER:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("clutter = True\n")
    return root


def test_stdlib_fingerprint_is_independent_of_the_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from covey.data import corpus as corpus_mod

    a = _fake_stdlib(tmp_path / "usr/lib/python3.x", clutter=True)
    b = _fake_stdlib(tmp_path / "elsewhere/py", clutter=False)
    assert list(corpus_mod.stdlib_documents(a)) == list(corpus_mod.stdlib_documents(b))
    prints = []
    for root in (a, b):
        monkeypatch.setattr(corpus_mod, "stdlib_root", lambda root=root: root)
        prints.append(load_corpus(val_fraction=0.3).fingerprint)
    assert prints[0] == prints[1]


def test_document_names_do_not_depend_on_how_a_path_is_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"d{i}.txt").write_text(f"text {i} " * 30)
    monkeypatch.chdir(tmp_path)
    prints = {
        load_corpus([p], val_fraction=0.2).fingerprint for p in ("docs", "./docs/", str(docs))
    }
    assert len(prints) == 1


ROWS = [{"text": f"row number {i} says hello " * 3, "n": i} for i in range(60)]


def _write_format(tmp_path: Path, fmt: str) -> Path:
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "csv":
        ds.to_csv(str(path))
    elif fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "arrow":
        import pyarrow as pa

        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, ds.data.schema) as w:
            w.write_table(ds.data.table)
    else:  # a save_to_disk directory
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "arrow", "disk"])
def test_every_data_format_gives_every_row(tmp_path: Path, fmt: str) -> None:
    c = load_corpus([str(_write_format(tmp_path, fmt))], val_fraction=0.2)
    assert (c.n_train_docs + c.n_val_docs, c.n_val_docs > 0) == (60, True)
    text = c.train.numpy().tobytes() + c.val.numpy().tobytes()
    assert all(r["text"].encode() in text for r in ROWS)
    assert text.count(b"\x00") == 60 - 2  # NUL between documents, in each split


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "disk"])
def test_missing_column_names_the_column_and_the_columns(tmp_path: Path, fmt: str) -> None:
    path = _write_format(tmp_path, fmt)
    with pytest.raises(ValueError, match=r"'body'.*\['n', 'text'\]"):
        load_corpus([str(path)], text_column="body")


def test_other_text_column_and_empty_dataset(tmp_path: Path) -> None:
    f = tmp_path / "body.jsonl"
    f.write_text("\n".join(json.dumps({"body": f"b{i} " * 20}) for i in range(30)))
    c = load_corpus([str(f)], val_fraction=0.2, text_column="body")
    assert c.n_train_docs + c.n_val_docs == 30
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_corpus([str(empty)])


def test_chat_rows_use_the_tokenizers_template(tmp_path: Path) -> None:
    from covey.data.tokenizer import HFTokenizer
    from tests.tiny_hf import tiny_tokenizer

    tok_dir = tiny_tokenizer(tmp_path / "tok")
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    cfg_path.write_text(json.dumps(cfg))
    tok = HFTokenizer(tok_dir)
    f = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "bot", "content": "yo"}]}
            for i in range(30)]  # fmt: skip
    f.write_text("\n".join(json.dumps(r) for r in rows))
    c = load_corpus([str(f)], val_fraction=0.2, tokenizer=tok)
    assert c.train.dtype == torch.int32 and c.tokenizer == f"hf:{tok_dir}"
    text = tok.decode(c.train.tolist() + c.val.tolist())
    assert "<user>hi 7<bot>yo" in text
    # EOS between documents: one fewer than the documents of each split
    eos = int((c.train == tok.eos_id).sum() + (c.val == tok.eos_id).sum())
    assert eos == 30 - 2
