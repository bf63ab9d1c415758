"""A validator stopped by a signal in the middle of a re-execution (minutes of CPU at 124M)
leaves the task at once and exits 0, reporting nothing for it; a stop before the
re-execution starts skips it. The signal is a real SIGTERM to this process, handled by the
validator's own handler."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from covey.peer import validator as validator_mod
from covey.peer.validator import Validator, ValidatorOptions

TASK = {
    "task_id": 7, "round": 3, "peer_id": "p" * 16, "cid": "c" * 64, "size": 8, "tokens": 8,
    "inner_steps": 2, "fragment": None, "data_key": "d", "start_cid": "s" * 64,
    "start_hash": "h" * 64, "start_size": 8, "commitments": [], "providers": [],
}  # fmt: skip


def _validator(tmp_path: Path, posted: list[str]) -> Validator:
    v = Validator(ValidatorOptions("http://127.0.0.1:9", identity=tmp_path / "key"))
    v._setup = lambda: None  # type: ignore[method-assign]  # no coordinator: one task below
    v.cfg = SimpleNamespace(trust=SimpleNamespace(commit_every=1))  # type: ignore[assignment]
    v.run_id, v.strategy = "r" * 16, None  # type: ignore[assignment]
    v._batch_fn = lambda task: None  # type: ignore[method-assign]

    def post(path: str, body: Any, **_: Any) -> dict[str, Any]:
        posted.append(path)
        return {"task": TASK} if path == "/v1/verify/claim" else {}

    v.client = SimpleNamespace(post=post)  # type: ignore[assignment]
    local = {"claimed_end": None, "previous_end": None}
    v.check = lambda task: v._check(task, None, tmp_path / "p", local, tmp_path, [])  # type: ignore
    return v


def test_a_stop_signal_cuts_a_reexecution_short_and_the_validator_exits_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = threading.Event()

    def slow_reexecute(*args: Any, **kwargs: Any) -> None:
        started.set()
        deadline = time.monotonic() + 30  # the signal's handler must raise long before
        while time.monotonic() < deadline:
            time.sleep(0.01)
        raise AssertionError("the stop signal did not cut the re-execution short")

    monkeypatch.setattr(validator_mod.verify, "reexecute", slow_reexecute)
    posted: list[str] = []
    v = _validator(tmp_path, posted)
    threading.Thread(
        target=lambda: started.wait(30) and os.kill(os.getpid(), signal.SIGTERM), daemon=True
    ).start()
    before = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    assert v.run() == 0
    assert time.monotonic() - t0 < 10
    assert posted == ["/v1/verify/claim"]  # no report for the task it left
    assert v.done == 0 and v.stop.is_set() and v._reexecuting is None
    assert signal.getsignal(signal.SIGTERM) == before  # its handler is put back


def test_a_stop_before_the_reexecution_skips_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[int] = []
    monkeypatch.setattr(validator_mod.verify, "reexecute", lambda *a, **k: ran.append(1))
    posted: list[str] = []
    v = _validator(tmp_path, posted)
    inner = v.check

    def stopped_while_fetching(task: Any) -> None:
        v.stop.set()  # as the handler does when a signal comes during the fetches
        inner(task)

    v.check = stopped_while_fetching  # type: ignore[method-assign]
    assert v.run() == 0
    assert ran == [] and posted == ["/v1/verify/claim"]
