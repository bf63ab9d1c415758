"""Runs out as Hugging Face directories: `covey sim` -> `covey export` -> transformers loads
the model without remote code, with logits equal to covey's; `covey generate` samples."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from covey.cli import app
from covey.config import SimConfig
from covey.data.tokenizer import load_tokenizer
from covey.io.export import export_run, load_checkpoint_into, read_run, save_sim_run
from covey.io.generate import generate, load_exported
from covey.models.source import build_model
from covey.sim.simulator import simulate
from tests.tiny_hf import TEXTS, tiny_llama, tiny_tokenizer

TINY_RUN = {
    "workers": 2,
    "steps": 4,
    "eval_batches": 1,
    "algorithm": {"method": "diloco", "inner_steps": 2},
    "compute": {"step_time_s": 0.01},
}


def _data(tmp_path: Path) -> Path:
    f = tmp_path / "train.jsonl"
    f.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    return f


def _covey_logits(run_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    run = read_run(run_dir)
    vocab = load_tokenizer(run.tokenizer).vocab_size
    model, _, _ = build_model(run.model.spec, run.seed, vocab_size=None if vocab == 256 else vocab)
    load_checkpoint_into(model, run.checkpoint()[1])
    out = model.eval()(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).detach()


def _exported_logits(out: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=False)
    return model.eval()(input_ids=ids).logits.detach()


def _sim(tmp_path: Path, **spec: object) -> Path:
    cfg = SimConfig.model_validate({**TINY_RUN, **spec})
    result = simulate(cfg, progress=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"config": cfg.model_dump(mode="json")}))
    save_sim_run(run, cfg, result.state)
    return run


def test_covey_gpt_exports_as_gpt2_with_equal_logits(tmp_path: Path) -> None:
    run = _sim(
        tmp_path,
        model={"size": "nano"},
        data={"paths": [str(_data(tmp_path))], "batch_size": 2, "seq_len": 16},
    )
    done = export_run(run, tmp_path / "out")
    assert done["round"] == 2
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and "auto_map" not in config
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "out" / name).is_file(), name
    ids = torch.tensor([list(b"def main():\n    return 0\n")])
    ours, theirs = _covey_logits(run, ids), _exported_logits(tmp_path / "out", ids)
    assert (ours - theirs).abs().max() < 1e-5
    _, tok = load_exported(tmp_path / "out")
    assert tok.encode("héllo") == list("héllo".encode())  # bytes leave as bytes


def test_sim_export_generate_a_tiny_llama_from_the_cli(tmp_path: Path) -> None:
    """`covey sim --model hf:DIR`, `covey export` and `covey generate` on a tiny Llama and a
    trained tokenizer."""
    model_dir = tiny_llama(tiny_tokenizer(tmp_path / "DIR", 300), vocab_size=300)
    runner = CliRunner()
    spec = tmp_path / "run.toml"  # short sequences: the tiny data has few tokens
    spec.write_text("[data]\nseq_len = 16\nbatch_size = 2\nval_fraction = 0.2\n")
    args = ["sim", str(spec), "--model", f"hf:{model_dir}", "--tokenizer", f"hf:{model_dir}"]
    args += ["--data", str(_data(tmp_path)), "--steps", "4", "--workers", "2", "-H", "2"]
    run = tmp_path / "runs" / "x"
    result = runner.invoke(app, [*args, "--out", str(run), "--no-progress"])
    assert result.exit_code == 0, result.output
    exported = tmp_path / "exported"
    result = runner.invoke(app, ["export", str(run), "--out", str(exported)])
    assert result.exit_code == 0, result.output
    assert json.loads((exported / "config.json").read_text())["model_type"] == "llama"
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    assert (_covey_logits(run, ids) - _exported_logits(exported, ids)).abs().max() < 1e-5
    gen = ["generate", str(exported), "--prompt", "Once upon a time", "--max-new-tokens", "8"]
    a = runner.invoke(app, [*gen, "--seed", "0"])
    assert a.exit_code == 0, a.output
    assert a.output.startswith("Once upon a time")
    assert a.output == runner.invoke(app, [*gen, "--seed", "0"]).output  # seeded
    # a run directory works too: exported on the fly
    assert generate(run, "Once", max_new_tokens=3, temperature=0) == generate(
        exported, "Once", max_new_tokens=3, temperature=0
    )


def test_mismatched_tokenizer_fails_before_training(tmp_path: Path) -> None:
    model_dir = tiny_llama(tmp_path / "m", vocab_size=260)
    tok = tiny_tokenizer(tmp_path / "tok", 300)
    args = ["sim", "--model", f"hf:{model_dir}", "--tokenizer", f"hf:{tok}"]
    args += ["--data", str(_data(tmp_path)), "--steps", "4", "-H", "2", "--no-progress"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "vocabulary (300)" in result.output and "(260 rows" in result.output


def test_coordinator_data_dirs_and_rounds(tmp_path: Path) -> None:
    """A coordinator's data dir: the spec from coordinator.db, certified checkpoints."""
    run = _sim(
        tmp_path,
        model={"size": "nano"},
        data={"paths": [str(_data(tmp_path))], "batch_size": 2, "seq_len": 16},
    )
    coord = tmp_path / "coord"
    (coord / "checkpoints").mkdir(parents=True)
    spec = json.loads((run / "summary.json").read_text())["config"]
    db = sqlite3.connect(coord / "coordinator.db")
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    db.execute("INSERT INTO meta VALUES ('spec', ?)", (json.dumps(spec),))
    db.commit()
    db.close()
    state = (run / "checkpoints" / "round-000002.safetensors").read_bytes()
    for r in (5, 10):
        (coord / "checkpoints" / f"round-{r:06d}.safetensors").write_bytes(state)
    assert export_run(coord, tmp_path / "latest")["round"] == 10
    assert export_run(coord, tmp_path / "five", round=5)["round"] == 5
    with pytest.raises(ValueError, match=r"no checkpoint of round 7; rounds: \[5, 10\]"):
        export_run(coord, tmp_path / "seven", round=7)
    with pytest.raises(ValueError, match="not a run directory"):
        export_run(tmp_path / "nothing", tmp_path / "x")
