"""`covey bench model` smoke test: a few steps on a very small Llama, through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from covey.bench.model import run_model_bench, tiny_llama_config


def test_tiny_llama_config_is_a_llama() -> None:
    cfg = tiny_llama_config(128, 3, vocab_size=256, positions=128)
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 3
    assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0


def test_bench_model_smoke(tmp_path: Path) -> None:
    from covey.cli import app

    out = tmp_path / "model.json"
    sizes = "--steps 2 --repeats 2 --hidden 32 --layers 1 --batch-size 2 --seq-len 16"
    args = ["bench", "model", *sizes.split(), "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "overhead" in result.output and "tokens/s" in result.output
    r = json.loads(out.read_text())
    assert r["bare_tokens_per_s"] > 0 and r["covey_tokens_per_s"] > 0
    assert len(r["bare_blocks"]) == len(r["covey_blocks"]) == 2
    expected = (r["bare_tokens_per_s"] - r["covey_tokens_per_s"]) / r["bare_tokens_per_s"] * 100
    assert r["overhead_pct"] == pytest.approx(expected, abs=0.01)
    assert r["met"] == (r["overhead_pct"] <= 3.0)
    assert r["warmup_loss_max_diff"] <= 1e-4  # the two loops do the same work
    assert r["model"]["num_hidden_layers"] == 1


def test_bench_model_refuses_empty_sizes() -> None:
    with pytest.raises(ValueError, match="steps must be at least 1, got 0"):
        run_model_bench(steps=0)
