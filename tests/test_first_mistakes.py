"""A new user's first mistakes, made with the real `covey` command in subprocesses: each
ends in exit code 2 and one line on stderr naming the problem, never a traceback."""

from __future__ import annotations

import fcntl
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from covey.guards import LOCK_NAME

SIM = ("--workers", "2", "--steps", "4", "-H", "2", "--no-progress")


def covey(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "covey", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def one_line(r: subprocess.CompletedProcess, *words: str) -> str:
    """The single error line of a refused command, which must name each of `words`."""
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-round `covey sim` run (a few seconds)."""
    out = tmp_path_factory.mktemp("sim") / "run"
    r = covey("sim", *SIM, "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


def copy_run(sim_run: Path, tmp_path: Path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(sim_run, d, ignore=shutil.ignore_patterns(LOCK_NAME))
    return d


def checkpoint(run: Path) -> Path:
    return run / "checkpoints" / "round-000002.safetensors"


# --- data ---------------------------------------------------------------------------------


def test_demo_with_missing_data(tmp_path: Path) -> None:
    missing = str(tmp_path / "does-not-exist.jsonl")
    one_line(covey("demo", "--data", missing, "--out", str(tmp_path / "o")), missing)


def test_demo_on_parquet_with_another_text_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"body": ["hello world"] * 20}), path)
    args = ("--data", str(path), "--workers", "1", "--validators", "0", "--no-progress")
    line = one_line(covey("demo", *args, "--out", str(tmp_path / "o")), "body", "--text-column")
    assert "b.parquet" in line
    assert "--text-column" in covey("demo", "-h").stdout


def test_demo_spec_carries_the_text_column() -> None:
    from covey.local.demo import demo_spec

    assert demo_spec("diloco", text_column="body")["data"]["text_column"] == "body"
    assert "text_column" not in demo_spec("diloco")["data"]


# --- checkpoints ----------------------------------------------------------------------------


def test_export_of_a_truncated_checkpoint(sim_run: Path, tmp_path: Path) -> None:
    run = copy_run(sim_run, tmp_path)
    path = checkpoint(run)
    path.write_bytes(path.read_bytes()[:5000])
    one_line(covey("export", str(run), "--out", str(tmp_path / "hf")), str(path), "damaged")
    # a checkpoint of before hashes were kept, truncated: safetensors' own error, one line
    (path.parent / (path.name + ".sha256")).unlink()
    one_line(covey("export", str(run), "--out", str(tmp_path / "hf")), str(path), "truncated")


def test_export_refuses_a_flipped_byte_in_a_tensor(sim_run: Path, tmp_path: Path) -> None:
    run = copy_run(sim_run, tmp_path)
    flip_byte(checkpoint(run), -100)  # inside the last tensor's data: safetensors reads it
    one_line(covey("export", str(run), "--out", str(tmp_path / "hf")), "damaged", "hash")
    # a warm start from it: the same check
    r = covey("sim", *SIM, "--init", str(run), "--out", str(tmp_path / "warm"))
    one_line(r, "model.init", "damaged")


def test_export_checks_a_coordinator_checkpoint_against_its_content_id(
    sim_run: Path, tmp_path: Path
) -> None:
    """A coordinator's checkpoint is its state blob: coordinator.db records its sha256."""
    import hashlib
    import sqlite3

    data = tmp_path / "data"
    (data / "checkpoints").mkdir(parents=True)
    path = data / "checkpoints" / "round-000002.safetensors"
    shutil.copyfile(checkpoint(sim_run), path)
    config = json.loads((sim_run / "summary.json").read_text())["config"]
    db = sqlite3.connect(data / "coordinator.db")
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    db.execute("INSERT INTO meta VALUES ('spec', ?)", (json.dumps(config),))
    db.execute("CREATE TABLE checkpoints (round INTEGER PRIMARY KEY, cid TEXT, size INTEGER, "
               "weights_hash TEXT, created_at REAL)")  # fmt: skip
    cid = hashlib.sha256(path.read_bytes()).hexdigest()
    db.execute("INSERT INTO checkpoints VALUES (2, ?, 0, '', 0)", (cid,))
    db.commit()
    db.close()
    flip_byte(path, -100)
    one_line(covey("export", str(data), "--out", str(tmp_path / "hf")), str(path), "damaged")


def test_a_checkpoint_without_a_hash_still_loads(sim_run: Path, tmp_path: Path) -> None:
    """Backwards compatible: run directories written before hashes were kept open."""
    from covey.io.export import load_checkpoint_into, read_run
    from covey.models.source import build_model

    run = copy_run(sim_run, tmp_path)
    (checkpoint(run).parent / (checkpoint(run).name + ".sha256")).unlink()
    r, path = read_run(run).checked_checkpoint()
    assert r == 2
    cfg = json.loads((run / "summary.json").read_text())["config"]
    assert cfg["model"]["size"] == "nano"
    load_checkpoint_into(build_model("covey:nano", 0)[0], path)


def test_resume_with_a_damaged_checkpoint(sim_run: Path, tmp_path: Path) -> None:
    run = copy_run(sim_run, tmp_path)
    tensors = run / "checkpoint" / "tensors.safetensors"
    flip_byte(tensors, -100)  # a tensor's byte: the recorded hash catches it
    one_line(covey("sim", "--resume", "--out", str(run)), str(tensors), "damaged")
    # the header damaged, in a snapshot of before hashes were kept: still one line
    meta = json.loads((run / "checkpoint" / "sim.json").read_text())
    del meta["tensors_sha256"]
    (run / "checkpoint" / "sim.json").write_text(json.dumps(meta))
    data = bytearray(tensors.read_bytes())
    data[0:8] = (2**40).to_bytes(8, "little")  # a header length past the end of the file
    tensors.write_bytes(bytes(data))
    one_line(covey("sim", "--resume", "--out", str(run)), str(tensors))
    (run / "checkpoint" / "sim.json").write_text("{not json")
    one_line(covey("sim", "--resume", "--out", str(run)), "sim.json", "damaged")


# --- run directories, ports, locks ------------------------------------------------------------


def test_sim_refuses_an_out_holding_another_run_then_overwrites(
    sim_run: Path, tmp_path: Path
) -> None:
    run = copy_run(sim_run, tmp_path)
    before = (run / "metrics.jsonl").read_text()
    one_line(covey("sim", *SIM, "--out", str(run)), str(run), "--resume", "--overwrite")
    assert (run / "metrics.jsonl").read_text() == before  # nothing touched
    # a lock file left by a killed process is no lock: flock died with its holder
    (run / LOCK_NAME).write_text("12345\n")
    r = covey("sim", *SIM, "--out", str(run), "--overwrite", "--log-json")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stderr.splitlines()]  # --log-json: all JSON
    assert any('"round"' in e["message"] for e in records), r.stderr
    assert any("final val loss" in e["message"] for e in records)


def test_a_sim_stopped_before_its_first_round_leaves_no_run_to_refuse(tmp_path: Path) -> None:
    """Data too small is fixed and the same --out used again: no "holds another run"."""
    out, tiny = tmp_path / "run", tmp_path / "tiny.txt"
    tiny.write_text("x")
    for _ in range(2):
        one_line(covey("sim", *SIM, "--data", str(tiny), "--out", str(out)), "fewer than")


def test_sim_refuses_an_out_in_use(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    with (out / LOCK_NAME).open("a+") as held:  # this process holds the run dir
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        one_line(covey("sim", *SIM, "--out", str(out)), str(out), "in use")
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def spec(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text('name = "first-mistakes"\n')
    return path


def test_coordinator_on_a_damaged_database(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "coordinator.db").write_bytes(b"not a database " * 100)
    r = covey("coordinator", str(spec(tmp_path)), "--data-dir", str(data), "--port", "0")
    one_line(r, "coordinator.db", "SQLite")
    one_line(covey("export", str(data), "--out", str(tmp_path / "hf")), "coordinator.db")
    one_line(covey("ledger", "verify", str(data)), str(data), "database")


def test_coordinator_on_a_busy_port_creates_nothing(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        data = tmp_path / "data"
        r = covey("coordinator", str(spec(tmp_path)), "--data-dir", str(data), "--port", str(port))
        one_line(r, f"127.0.0.1:{port}", "in use", "--port")
    assert r.stdout == ""  # no banner, no run id
    assert not data.exists()


def test_second_coordinator_on_a_data_dir_in_use(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with (data / LOCK_NAME).open("a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        r = covey("coordinator", str(spec(tmp_path)), "--data-dir", str(data), "--port", "0")
        one_line(r, str(data), "in use")
    assert r.stdout == ""


def test_the_lock_of_a_killed_coordinator_dies_with_it(tmp_path: Path) -> None:
    """A SIGKILLed holder leaves its lock file behind but no lock: the next one starts."""
    import signal

    data = tmp_path / "data"
    data.mkdir()
    (data / "coordinator.db").write_bytes(b"not a database " * 100)  # refused past the lock
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from covey.guards import lock_dir; lock_dir(Path(sys.argv[1]), 'holder'); "
         "print('locked', flush=True); time.sleep(120)", str(data)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        args = ("coordinator", str(spec(tmp_path)), "--data-dir", str(data), "--port", "0")
        one_line(covey(*args), "in use")
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert (data / LOCK_NAME).exists()
        one_line(covey(*args), "coordinator.db", "SQLite")  # got past the lock
    finally:
        holder.kill()
        holder.wait(timeout=30)


@pytest.mark.long  # test_cli.py's worker_without_a_coordinator runs the same refusal by default
def test_worker_says_it_cannot_reach_the_coordinator(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    r = covey("worker", "--coordinator", url, "--connect-timeout", "12", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "cannot reach" in lines[0] and url in lines[0] and "refused" in lines[0]
    assert any("after 1" in line for line in lines[1:-1]), r.stderr  # "after 10 s of 12"
    assert lines[-1].startswith("error: ") and "unreachable for 12 s" in lines[-1]
    assert time.monotonic() - start < 45


# --- conventions ------------------------------------------------------------------------------


def test_short_help_markup_and_no_issue_numbers() -> None:
    for command in (("sim",), ("coordinator",), ("rl", "trainer"), ("swarm", "coordinator")):
        r = covey(*command, "-h")
        assert r.returncode == 0 and "Usage:" in r.stdout, (command, r.stderr)
    assert "[tensorboard|wandb]" in covey("sim", "--help").stdout
    assert "issue" not in covey("rl", "--help").stdout.lower()


def test_wandb_project_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from covey.tracking import wandb_project

    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert wandb_project() == "covey"
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    assert wandb_project() == "mine"
    assert wandb_project("flag") == "flag"
    assert "--wandb-project" in covey("sim", "-h").stdout


def test_set_reaches_every_spec_through_one_loader(tmp_path: Path) -> None:
    out = str(tmp_path / "o")
    one_line(covey("sim", *SIM, "--set", "algorithm.inner_stepz=3", "--out", out), "inner_steps")
    one_line(covey("sim", *SIM, "--set", "workers=many", "--out", out), "workers", "many")
    one_line(covey("sim", *SIM, "--set", "workers", "--out", out), "KEY=VALUE")
    r = covey("coordinator", str(spec(tmp_path)), "--set", "rounds.heartbeat=3")
    one_line(r, "heartbeat_s")
    one_line(covey("demo", "--set", "rounds.max_roundz=3", "--out", out), "max_rounds")
    one_line(covey("swarm", "coordinator", "--set", "stagez=2"), "stagez")


def test_coordinator_refuses_a_state_blob_that_does_not_hash_to_its_id(tmp_path: Path) -> None:
    """The state a restarted coordinator resumes from is checked against its content id."""
    import hashlib
    import sqlite3

    from covey.coordinator.integrity import check_data_dir
    from covey.errors import UserError

    state = b"the bytes of a canonical state"
    cid = hashlib.sha256(state).hexdigest()
    blob = tmp_path / "blobs" / cid[:2] / cid
    blob.parent.mkdir(parents=True)
    blob.write_bytes(state)
    db = sqlite3.connect(tmp_path / "coordinator.db")
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    db.execute("INSERT INTO meta VALUES ('initial_cid', ?)", (cid,))
    db.commit()
    db.close()
    check_data_dir(tmp_path)  # intact: passes
    flip_byte(blob, 3)
    with pytest.raises(UserError, match="damaged"):
        check_data_dir(tmp_path)
    blob.unlink()
    with pytest.raises(UserError, match="missing"):
        check_data_dir(tmp_path)


LONG_RUNNING = (
    ("sim",), ("demo",), ("coordinator",), ("worker",), ("validator",),
    ("rl", "trainer"), ("rl", "worker"), ("rl", "validator"), ("rl", "demo"),
    ("swarm", "coordinator"), ("swarm", "server"), ("swarm", "trainer"), ("swarm", "demo"),
    *(("bench", b) for b in ("comms", "network", "coordinator", "model", "trust", "compare",
                             "agreement", "gpu", "hostsync", "rl", "shards", "swarm",
                             "swarm-codecs")),
)  # fmt: skip


def test_every_long_running_command_takes_log_json() -> None:
    from typer.testing import CliRunner

    from covey.cli import app

    runner = CliRunner()
    for command in LONG_RUNNING:
        r = runner.invoke(app, [*command, "-h"])
        assert r.exit_code == 0 and "--log-json" in r.output, command


def test_a_bench_with_log_json_writes_json_log_lines(tmp_path: Path) -> None:
    """The cheapest bench (host syncs of one nano inner step per method): with --log-json
    every line it writes is a JSON log record on stderr, its results among them; stdout
    (where they go without it) stays empty."""
    small = ("--commit-params", "65536", "--workers", "3")
    r = covey(
        "bench", "hostsync", "--model", "nano", "--steps", "1", *small, "--log-json", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "", r.stdout
    records = [json.loads(line) for line in r.stderr.splitlines()]  # --log-json: all JSON
    results = [e for e in records if "host ms/step/1M params" in e["message"]]
    assert len(results) == 4, r.stderr  # ddp, diloco, streaming, demo
    assert {(e["level"], e["peer"]) for e in results} == {("INFO", "bench-hostsync")}
    assert sum("round result:" in e["message"] for e in records) == 1, r.stderr


def test_set_values_reach_the_spec_over_flags_and_toml(tmp_path: Path) -> None:
    from covey.config import load_run_config, load_sim_config
    from covey.errors import UserError
    from covey.spec import load_spec, parse_sets
    from covey.swarm.config import SwarmConfig

    assert parse_sets(["a.b=1", "a.c=x", "d=[1, 2]", 'e="5"']) == {
        "a": {"b": 1, "c": "x"}, "d": [1, 2], "e": "5"
    }  # fmt: skip
    toml = tmp_path / "run.toml"
    toml.write_text("workers = 3\n[algorithm]\ninner_steps = 4\n")
    cfg = load_spec(load_sim_config, toml, {"workers": 2}, ["algorithm.inner_steps=5"])
    assert (cfg.workers, cfg.algorithm.inner_steps) == (2, 5)  # flags over TOML, --set last
    run = load_spec(load_run_config, None, {}, ["name=set-run", "rounds.max_rounds=7"])
    assert (run.name, run.rounds.max_rounds) == ("set-run", 7)
    assert load_spec(SwarmConfig, sets=["n_layer=6", "name=s"]).n_layer == 6
    with pytest.raises(UserError, match="is set to a value and used as a table"):
        parse_sets(["a=1", "a.b=2"])
