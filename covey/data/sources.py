"""Documents from the user's files: text, JSONL, and anything the `datasets` library reads.

A document is `(name, content)`: a whole text file (bytes) or one row of a table (str). Names
never depend on how a path was typed: a file argument is named by its file name, a file found
in a directory argument by the directory's name and its path inside it, a row by its file's
name and its row (JSONL: line) number. Names decide the held-out split, so the split is
the same on every machine.

Formats:
- text files (TEXT_SUFFIXES): one document each; `.jsonl`: one record per line, read here
  line by line (constant memory);
- `.json`, `.csv`, `.parquet`, `.arrow` files, as file arguments (and `.parquet`/`.arrow`
  found in directories): read with `datasets` in streaming mode, so memory does not grow
  with the data;
- a `save_to_disk` directory (it holds `state.json` or `dataset_dict.json`): memory-mapped
  with `datasets.load_from_disk`, its `train` split if it is a DatasetDict.
Rows give their text from the `text_column`, or, for chat data, from a `messages` list
rendered by the tokenizer's chat template (`render_chat`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl", ".json", ".c", ".h", ".html", ".tex"}
TABLE_SUFFIXES = {".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
DIR_TABLE_SUFFIXES = {".parquet", ".arrow"}  # in a directory walk .json stays a text file

Document = tuple[str, "str | bytes"]
ChatRenderer = Callable[[list[dict[str, Any]]], str]


def row_text(row: Any, where: str, text_column: str, render_chat: ChatRenderer) -> str:
    """The text of one row; ValueError naming `where`, the column and the row's columns."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a record must be an object with a {text_column!r} field")
    value = row.get(text_column)
    if isinstance(value, str):
        return value
    messages = row.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        return render_chat(messages)
    raise ValueError(
        f"{where}: each record needs a string {text_column!r} field (or 'messages'); "
        f"columns are {sorted(row)}"
    )


def _jsonl_rows(path: Path, name: str, text_column: str, chat: ChatRenderer) -> Iterator[Document]:
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{name}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            yield where, row_text(record, where, text_column, chat)


def _table_rows(
    path: Path, name: str, builder: str, text_column: str, chat: ChatRenderer
) -> Iterator[Document]:
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    except Exception as e:  # datasets raises many types for unreadable files
        raise ValueError(f"{name}: cannot read as {builder}: {e}") from None
    yield from _rows(ds, name, text_column, chat)


def _disk_rows(path: Path, name: str, text_column: str, chat: ChatRenderer) -> Iterator[Document]:
    import datasets

    ds = datasets.load_from_disk(str(path))  # memory-mapped Arrow: not read into memory
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{name}: a DatasetDict without a 'train' split ({sorted(ds)})")
        ds = ds["train"]
    if text_column not in ds.column_names and "messages" not in ds.column_names:
        raise ValueError(
            f"{name}: missing column {text_column!r} (or 'messages'); columns are "
            f"{sorted(ds.column_names)}"
        )
    yield from _rows(ds, name, text_column, chat)


def _rows(ds: Any, name: str, text_column: str, chat: ChatRenderer) -> Iterator[Document]:
    for i, row in enumerate(ds):
        where = f"{name}:{i}"
        yield where, row_text(row, where, text_column, chat)


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json"))


def file_documents(
    path: Path, name: str, text_column: str, chat: ChatRenderer, *, in_dir: bool = False
) -> Iterator[Document]:
    """The documents of one file, by its suffix."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_rows(path, name, text_column, chat)
    elif suffix in TABLE_SUFFIXES and (not in_dir or suffix in DIR_TABLE_SUFFIXES):
        yield from _table_rows(path, name, TABLE_SUFFIXES[suffix], text_column, chat)
    else:
        yield name, path.read_bytes()


def user_documents(
    paths: list[str], text_column: str = "text", render_chat: ChatRenderer | None = None
) -> Iterator[Document]:
    """Every document of the user's paths, in a fixed order. FileNotFoundError for a
    missing path, ValueError for a directory without readable files or a bad record."""
    from covey.data.tokenizer import plain_chat

    chat = render_chat or plain_chat
    for p in paths:
        path = Path(p).expanduser().resolve()
        if not path.exists():
            raise FileNotFoundError(f"--data path does not exist: {p}")
        if is_saved_dataset(path):
            yield from _disk_rows(path, path.name, text_column, chat)
        elif path.is_dir():
            suffixes = TEXT_SUFFIXES | DIR_TABLE_SUFFIXES
            files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in suffixes)
            if not files:
                raise ValueError(f"no text or data files ({', '.join(sorted(suffixes))}) under {p}")
            for f in files:
                name = f"{path.name}/{f.relative_to(path).as_posix()}"
                yield from file_documents(f, name, text_column, chat, in_dir=True)
        else:
            yield from file_documents(path, path.name, text_column, chat)
