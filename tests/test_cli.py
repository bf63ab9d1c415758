"""The command line, run as a real subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest


def covey(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "covey.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_commands_without_importing_torch() -> None:
    r = covey("--help", timeout=60)
    assert r.returncode == 0
    for command in ("sim", "bench", "demo", "coordinator", "worker"):
        assert command in r.stdout
    probe = "import sys, covey.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0


def test_sim_writes_metrics_summary_and_plot(tmp_path: Path) -> None:
    """...and, with the tensorboard extra, the same rounds as TensorBoard event files (one
    sim run for both: the suite's time is shared)."""
    import importlib.util

    out = tmp_path / "run"
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    r = covey(
        "sim",
        "--method",
        "diloco",
        "-H",
        "5",
        "--steps",
        "10",
        "--workers",
        "2",
        "--codec",
        "int8",
        "--no-progress",
        "--out",
        str(out),
        *(["--log", "tensorboard"] if tensorboard else []),
    )
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["round"] for rec in records] == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "diloco" and summary["config"]["algorithm"]["codec"] == "int8"
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if tensorboard:
        from tests.test_tracking import read_scalars

        got = read_scalars(out / "tensorboard")
        assert [step for step, _ in got["val_loss"]] == [1, 2]
        assert [v for _, v in got["val_loss"]] == pytest.approx([x["val_loss"] for x in records])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sim", "--method", "nope"], "invalid configuration"),
        (["sim", "--workers", "0"], "workers"),
        (["sim", "/nonexistent/run.toml"], "config file not found"),
        (["sim", "--codec", "zip", "--steps", "1", "-H", "1"], "codec"),
        (["bench", "comms", "--only", "nope"], "unknown method"),
        (["demo", "--algorithm", "nope"], "--algorithm must be one of"),
        (["coordinator", "/nonexistent/run.toml"], "config file not found"),
        (["worker", "--slowdown", "0.5"], "--slowdown must be >= 1"),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    r = covey(*args, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_coordinator_refuses_an_invalid_run_spec(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text("[rounds]\nheartbeat_s = 10\ndead_after_s = 5\n")
    r = covey("coordinator", str(spec), timeout=60)
    assert r.returncode == 2 and "dead_after_s" in r.stderr and "Traceback" not in r.stderr


def test_worker_without_a_coordinator_gives_up_with_a_clear_error(tmp_path: Path) -> None:
    from covey.local.cluster import free_port

    url = f"http://127.0.0.1:{free_port()}"
    r = covey("worker", "--coordinator", url, "--connect-timeout", "3", timeout=60)
    assert r.returncode == 2  # checked before the worker starts: a person can act on it
    assert "unreachable" in r.stderr and "Traceback" not in r.stderr


def test_log_lines_carry_date_level_and_peer_name_text_and_json() -> None:
    import io
    import logging

    from covey.logs import set_peer, setup_logging

    text, lines = io.StringIO(), io.StringIO()
    try:
        setup_logging("alice", stream=text, json_lines=False)
        logging.getLogger("covey.worker").info("round %d committed", 3)
        setup_logging("worker", stream=lines, json_lines=True)
        set_peer("bob")  # the name known once the identity is loaded
        logging.getLogger("covey.worker").warning("slow")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("covey.client").exception("failed")
    finally:
        import os

        os.environ.pop("COVEY_LOG_JSON", None)
        logging.getLogger().handlers.clear()
    line = text.getvalue().strip()
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z INFO  alice covey.worker: round 3 committed",
        line,
    ), line
    first, second = (json.loads(x) for x in lines.getvalue().splitlines()[:2])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert (first["level"], first["peer"], first["logger"], first["message"]) == (
        "WARNING",
        "bob",
        "covey.worker",
        "slow",
    )
    assert second["message"] == "failed" and "RuntimeError: boom" in second["exc"]


@pytest.mark.network
def test_coordinator_logs_json_lines(tmp_path: Path) -> None:
    """A real coordinator process with --log-json: its log is one JSON object a line."""
    import queue
    import threading

    from covey.local.cluster import free_port

    spec = tmp_path / "run.toml"
    spec.write_text('name = "logs"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "covey.cli", "coordinator", str(spec), "--log-json",
         "--port", str(free_port()), "--data-dir", str(tmp_path / "data")],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    try:
        deadline = time.monotonic() + 90
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            entry = json.loads(line)  # every line is JSON, or the test fails here
            assert entry["peer"] == "coordinator" and entry["time"].endswith("Z")
            if "created" in entry["message"]:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
