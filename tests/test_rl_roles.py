"""RL network roles without the network: policy bytes, the run spec, the trainer's ledger
on its own (in-process, a real SQLite run directory), and the CLI's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from covey.cli import app
from covey.io import audit
from covey.rl import policy as pol
from covey.rl.runspec import RLSpec, TaskSpec, run_id_of
from covey.rl.trainer import Trainer


def test_policy_bytes_round_trip_and_refusals(tmp_path: Path) -> None:
    cfg, model = pol.load_policy_dir("covey:nano")
    data = pol.policy_bytes(model)
    other = pol.build_policy(cfg)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    pol.load_weights(other, data)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True)
    )
    bigger = pol.build_policy({**cfg, "n_embd": cfg["n_embd"] * 2})
    with pytest.raises(pol.PolicyError, match="shape"):
        pol.load_weights(bigger, data)
    with pytest.raises(pol.PolicyError, match="not safetensors"):
        pol.load_weights(other, b"garbage")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["wpe.weight"][0, 0] = float("nan")
    nan_model = pol.build_policy(cfg)
    nan_model.load_state_dict(sd)
    with pytest.raises(pol.PolicyError, match="NaN"):
        pol.load_weights(other, pol.policy_bytes(nan_model))
    saved = pol.save_policy_dir(model, tmp_path / "p")
    cfg2, again = pol.load_policy_dir(saved)
    assert cfg2 == cfg and pol.policy_bytes(again) == data
    with pytest.raises(pol.PolicyError, match="not a policy directory"):
        pol.load_policy_dir(tmp_path / "missing")


def test_run_id_covers_spec_model_policy_and_trainer() -> None:
    spec, cfg = RLSpec(), {"vocab_size": 256}
    base = run_id_of(spec, cfg, "a" * 64, "b" * 64)
    assert len(base) == 16
    assert run_id_of(RLSpec(group_size=4), cfg, "a" * 64, "b" * 64) != base
    assert run_id_of(spec, cfg, "c" * 64, "b" * 64) != base
    assert run_id_of(spec, cfg, "a" * 64, "d" * 64) != base
    with pytest.raises(ValueError, match="dead_after_s"):
        RLSpec(heartbeat_s=5, dead_after_s=2)
    with pytest.raises(ValueError, match="jsonl"):
        RLSpec(task=TaskSpec(kind="jsonl"))


def test_trainer_run_directory_audits_and_reopens(tmp_path: Path) -> None:
    spec = RLSpec(eval_prompts=2)
    t = Trainer(tmp_path / "run", spec=spec, policy_dir="covey:nano")
    run_id, cid = t.run_id, t.cids[0]
    assert t.policy_info()["cid"] == cid and t.step_if_ready() is None  # nothing verified yet
    t.stop()
    report = audit.verify(tmp_path / "run")
    assert report.entries == 2  # run created, checkpoint of v0
    again = Trainer(tmp_path / "run")
    assert (again.run_id, again.cids[0], again.version) == (run_id, cid, 0)
    again.stop()
    with pytest.raises(ValueError, match="another spec"):
        Trainer(tmp_path / "run", spec=RLSpec(group_size=4), policy_dir="covey:nano")
    with pytest.raises(ValueError, match="holds no RL run"):
        Trainer(tmp_path / "empty")


def test_cli_refuses_bad_input(tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["rl", "trainer", "--data-dir", str(tmp_path / "x")])
    assert r.exit_code == 2 and "holds no RL run" in r.output
    r = runner.invoke(app, ["rl", "demo", "--adversaries", "99", "--out", str(tmp_path / "d")])
    assert r.exit_code == 2 and "--adversaries must be in" in r.output
    (tmp_path / "spec.toml").write_text("group_size = 1\n")
    r = runner.invoke(
        app,
        [
            "rl",
            "trainer",
            "--data-dir",
            str(tmp_path / "y"),
            "--spec",
            str(tmp_path / "spec.toml"),
            "--policy",
            "covey:nano",
        ],
    )
    assert r.exit_code == 2 and "group_size" in r.output
    r = runner.invoke(app, ["rl", "worker", "--help"])
    assert r.exit_code == 0 and "--behavior" in r.output
    # a house worker plays its own canaries under keys of the trainer's: none other
    key = tmp_path / "trainer.key"
    key.write_text("")
    url = ["--trainer", "http://127.0.0.1:9"]
    r = runner.invoke(app, ["rl", "worker", *url, "--house-of", str(key), "--behavior", "lazy"])
    assert r.exit_code == 2 and "leave --behavior and --identity out" in r.output
    r = runner.invoke(app, ["rl", "worker", *url, "--house-of", str(tmp_path / "none.key")])
    assert r.exit_code == 2 and "no trainer key file" in r.output


def test_cli_refuses_a_bad_url_a_busy_port_and_a_missing_policy(tmp_path: Path) -> None:
    import socket

    runner = CliRunner()
    for cmd in ("worker", "validator"):
        r = runner.invoke(app, ["rl", cmd, "--trainer", "notaurl"])
        assert r.exit_code == 2 and "error: --trainer 'notaurl' is not a URL" in r.output
    r = runner.invoke(app, ["rl", "worker", "--trainer", "http://h:1", "--max-steps", "0"])
    assert r.exit_code == 2
    r = runner.invoke(app, ["rl", "demo", "--policy", str(tmp_path), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "not a policy directory" in r.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        args = ["rl", "trainer", "--data-dir", str(tmp_path / "t"), "--policy", "covey:nano"]
        r = runner.invoke(app, [*args, "--port", port])
    assert r.exit_code == 2 and "cannot listen on" in r.output
    assert not (tmp_path / "t").exists()  # refused before a run was made
