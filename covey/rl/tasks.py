"""RL tasks: a prompt source plus a reward function.

- `ArithmeticTask`: verifiable arithmetic generated from a seed ("12+7=" -> "19"), with a
  held-out test split disjoint from the training prompts by construction (a hash of the
  problem decides its split, so no seed or ordering can leak one into the other).
- `JsonlTask`: prompts from a JSONL file (one object with a "prompt" string per line) or a
  table the data layer reads (`.parquet`, `.csv`, `.json`, `.arrow`: one row per prompt, a
  string "prompt" column, same columns as the JSONL records), and a
  `py:<module>:<function>` reward `fn(record: dict, completion: str) -> float`.
- `assigned_prompts(run_id, step, worker_id, n, num_prompts=...)`: the prompt indices a
  worker must answer at a step; workers do not choose them.

Completions are text; the expected answer format is the answer followed by a newline (or the
end of the completion, e.g. at eos).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class TaskError(ValueError):
    """A task cannot be built: a bad spec, a missing file, a malformed record."""


class Task(Protocol):
    """What the roles need: a fixed numbered training set and a reward."""

    name: str

    def __len__(self) -> int: ...

    def prompt(self, index: int) -> str: ...

    def reward(self, index: int, completion: str) -> float: ...


def _h64(*parts: object) -> int:
    text = "|".join(str(p) for p in parts).encode()
    return struct.unpack(">Q", hashlib.sha256(text).digest()[:8])[0]


def assigned_prompts(
    run_id: str, step: int, worker_id: str, n: int, *, num_prompts: int
) -> list[int]:
    """The `n` training prompt indices (in [0, num_prompts)) that `worker_id` must answer
    at `step` of `run_id`: sha256 of (run, step, worker, j), so anyone can recompute them.
    Indices may repeat when n is close to num_prompts; the order is part of the contract."""
    if n < 0 or num_prompts <= 0:
        raise TaskError(f"bad n={n} or num_prompts={num_prompts}")
    return [_h64("covey-rl-prompt", run_id, step, worker_id, j) % num_prompts for j in range(n)]


def completion_answer(completion: str) -> str:
    """The answer part of a completion: the text before the first newline."""
    return completion.split("\n", 1)[0]


def _is_integer(text: str) -> bool:
    return text[1:].isdigit() if text.startswith("-") else text.isdigit()


@dataclass(frozen=True)
class ArithmeticTask:
    """a+b (and a-b when `ops` has "-") with 0 <= a, b <= max_operand.

    `test_fraction` of all problems (chosen by a hash of the problem) are held out;
    `prompt(i)`/`reward(i, ...)` index the shuffled training problems, `test_prompts()`
    lists the held-out ones. `format_reward` (e.g. 0.1) is paid for a wrong integer answer
    in the right format; exact answers earn 1, anything else 0."""

    seed: int = 0
    max_operand: int = 99
    ops: str = "+"
    test_fraction: float = 0.1
    format_reward: float = 0.0
    name: str = "arithmetic"
    _train: list[tuple[int, str, int]] = field(init=False, repr=False, compare=False)
    _test: list[tuple[int, str, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_operand < 1 or not self.ops or set(self.ops) - {"+", "-"}:
            raise TaskError(f"bad arithmetic task max_operand={self.max_operand} ops={self.ops!r}")
        if not 0 < self.test_fraction < 1:
            raise TaskError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        train, test = [], []
        cut = self.test_fraction * 10_000
        for op in self.ops:
            for a in range(self.max_operand + 1):
                for b in range(self.max_operand + 1):
                    problem = (a, op, b)
                    held_out = _h64("covey-rl-split", *problem) % 10_000 < cut
                    (test if held_out else train).append(problem)
        random.Random(self.seed).shuffle(train)
        object.__setattr__(self, "_train", train)
        object.__setattr__(self, "_test", sorted(test))

    def __len__(self) -> int:
        return len(self._train)

    @staticmethod
    def _text(problem: tuple[int, str, int]) -> str:
        a, op, b = problem
        return f"{a}{op}{b}="

    @staticmethod
    def _answer(problem: tuple[int, str, int]) -> str:
        a, op, b = problem
        return str(a + b if op == "+" else a - b)

    def _problem(self, index: int) -> tuple[int, str, int]:
        if not 0 <= index < len(self._train):
            raise TaskError(f"prompt index {index} out of range [0, {len(self._train)})")
        return self._train[index]

    def prompt(self, index: int) -> str:
        return self._text(self._problem(index))

    def answer(self, index: int) -> str:
        return self._answer(self._problem(index))

    def score(self, answer: str, completion: str) -> float:
        """1.0 for the exact answer before the first newline; `format_reward` for another
        integer there; else 0.0."""
        got = completion_answer(completion)
        if got == answer:
            return 1.0
        return self.format_reward if _is_integer(got) else 0.0

    def reward(self, index: int, completion: str) -> float:
        return self.score(self.answer(index), completion)

    def test_prompts(self) -> list[tuple[str, str]]:
        """The held-out (prompt, answer) pairs, never among the training prompts."""
        return [(self._text(p), self._answer(p)) for p in self._test]


RewardFn = Callable[[dict[str, Any], str], float]


def load_reward(spec: str) -> RewardFn:
    """`py:<module>:<function>` -> the function (called as fn(record, completion) -> float).
    TaskError names the spec when it is malformed or does not resolve to a callable."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "py" or not parts[1] or not parts[2]:
        raise TaskError(f"reward spec {spec!r} is not py:<module>:<function>")
    try:
        fn = getattr(importlib.import_module(parts[1]), parts[2])
    except (ImportError, AttributeError) as exc:
        raise TaskError(f"reward spec {spec!r} does not resolve: {exc}") from exc
    if not callable(fn):
        raise TaskError(f"reward spec {spec!r} is not callable")
    return fn


def _jsonl_records(path: Path) -> list[tuple[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TaskError(f"cannot read prompts file {path}: {exc}") from exc
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise TaskError(f"{path}:{n}: not JSON: {exc}") from exc
    return out


def _table_records(path: Path, builder: str) -> list[tuple[str, Any]]:
    """Rows of a table file, read the way the data layer reads one (covey.data.sources:
    `datasets` in streaming mode, nothing cached), each a dict of its columns."""
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
        return [(f"{path}:row {i}", dict(row)) for i, row in enumerate(ds)]
    except Exception as exc:  # datasets raises many types for unreadable files
        raise TaskError(f"cannot read prompts file {path} as {builder}: {exc}") from None


def read_prompt_records(path: str | Path) -> list[dict[str, Any]]:
    """The prompt records of a JSONL file or a table (suffix in the data layer's
    TABLE_SUFFIXES, e.g. `.parquet`), in file order. TaskError naming the file and line/row
    when it cannot be read, a record has no string "prompt", or there are none."""
    from covey.data.sources import TABLE_SUFFIXES

    p = Path(path)
    if not p.is_file():
        raise TaskError(f"prompts file {path} does not exist")
    suffix = p.suffix.lower()
    if suffix in TABLE_SUFFIXES:
        rows = _table_records(p, TABLE_SUFFIXES[suffix])
    else:  # .jsonl (and anything else) is read as one JSON object per line
        rows = _jsonl_records(p)
    records = []
    for where, record in rows:
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise TaskError(f"{where}: needs an object with a string 'prompt'")
        records.append(record)
    if not records:
        raise TaskError(f"{path} holds no prompts")
    return records


class JsonlTask:
    """Prompts from a JSONL or table file (`read_prompt_records`; each record a "prompt"
    string, other fields reach the reward), rewarded by a `py:<module>:<function>` spec."""

    def __init__(self, path: str | Path, reward_spec: str, name: str = "jsonl") -> None:
        self.name = name
        self.reward_spec = reward_spec
        self._reward = load_reward(reward_spec)
        self._records: list[dict[str, Any]] = read_prompt_records(path)

    def __len__(self) -> int:
        return len(self._records)

    def _record(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self._records):
            raise TaskError(f"prompt index {index} out of range [0, {len(self._records)})")
        return self._records[index]

    def prompt(self, index: int) -> str:
        return str(self._record(index)["prompt"])

    def reward(self, index: int, completion: str) -> float:
        return float(self._reward(self._record(index), completion))
