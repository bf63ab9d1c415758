"""Tokenizers (bytes, hf:<dir>, `covey tokenizer train`) on real files: what transformers
loads must encode exactly as covey does."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from covey.data.tokenizer import (
    EOS_TOKEN,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    train_tokenizer,
)
from tests.tiny_hf import TEXTS, tiny_tokenizer


def test_trained_tokenizer_loads_in_transformers_and_round_trips(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = train_tokenizer(TEXTS, 300, tmp_path / "tok")
    assert tok.vocab_size == 300 and tok.eos_id == tok.tok.convert_tokens_to_ids(EOS_TOKEN)
    text = "Once upon a time, a model — naïve — talked."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode()) / 2  # it learned merges
    auto = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert auto.encode(text, add_special_tokens=False) == tok.encode(text)
    assert auto.eos_token == EOS_TOKEN
    assert load_tokenizer(f"hf:{tmp_path / 'tok'}").encode(text) == tok.encode(text)


def test_byte_tokenizer_saved_for_transformers_encodes_bytes(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    ByteTokenizer().save(tmp_path / "bytes")
    fast = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "bytes"))
    text = "héllo\x00 wörld\n\t~"
    assert fast.encode(text, add_special_tokens=False) == list(text.encode())
    assert fast.decode(list(text.encode())) == text


def test_tokenizer_errors_name_the_source(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'sentencepiece:x'"):
        load_tokenizer("sentencepiece:x")
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_tokenizer(f"hf:{tmp_path}")
    with pytest.raises(ValueError, match="vocab"):
        train_tokenizer(TEXTS, 100, tmp_path / "small")


def test_tokenizer_without_eos_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    (tmp_path / "t").mkdir()
    raw.save(str(tmp_path / "t" / "tokenizer.json"))
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        HFTokenizer(tmp_path / "t")


def test_tokenizer_json_alone_finds_eos_by_name(tmp_path: Path) -> None:
    d = tiny_tokenizer(tmp_path / "tok")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)
    tok = HFTokenizer(d)
    assert tok.decode([tok.eos_id]) == EOS_TOKEN


def test_cli_tokenizer_train(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from covey.cli import app

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    out = tmp_path / "tok"
    result = CliRunner().invoke(
        app, ["tokenizer", "train", "--vocab", "280", "--data", str(data), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert HFTokenizer(out).vocab_size == 280
    bad = CliRunner().invoke(
        app, ["tokenizer", "train", "--vocab", "10", "--data", str(data), "--out", str(out)]
    )
    assert bad.exit_code == 2 and "vocab (10)" in bad.output


NETWORK_SPEC = """
name = "tiny-llama"
seed = 3
[model]
source = "hf:{model}"
[data]
paths = ["{data}"]
tokenizer = "hf:{model}"
batch_size = 2
seq_len = 16
val_fraction = 0.2
[algorithm]
method = "diloco"
inner_steps = 2
codec = "fp32"
inner_state = "reset"
[rounds]
deadline_min_s = 3
eval_batches = 1
max_rounds = 3
checkpoint_every = 1
[trust]
sample_rate = 1.0
"""


@pytest.mark.network
def test_network_run_trains_verifies_and_exports_a_tiny_llama(tmp_path: Path) -> None:
    """Coordinator, worker and validator processes on a tiny Llama run spec, the peers
    without the model's files (fetched from the coordinator by content id): rounds commit,
    the validator re-executes the HF model's contributions and agrees, and the coordinator's
    data dir exports to a directory transformers loads with covey's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from covey.io import audit
    from covey.io.export import export_run, load_checkpoint_into, read_run
    from covey.local.cluster import LocalCluster
    from covey.models.source import build_model
    from tests.tiny_hf import tiny_llama

    model_dir = tiny_llama(tiny_tokenizer(tmp_path / "DIR", 300), vocab_size=300)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    spec = tmp_path / "run.toml"
    spec.write_text(NETWORK_SPEC.format(model=model_dir, data=data))
    with LocalCluster(spec, tmp_path / "run") as cluster:
        cluster.start_coordinator()
        # the peers have no model files: they fetch config and tokenizer from the blob plane
        hidden = model_dir.rename(tmp_path / "hidden")
        cluster.start_worker("w0", "--threads", "1")
        cluster.start_validator("v0", "--threads", "1")
        cluster.wait_for(lambda s: s["committed_rounds"] >= 3, 240, "3 rounds")
        give_up = time.monotonic() + 120
        checks: list[str] = []
        while time.monotonic() < give_up and "agree" not in checks:
            found, _, _ = audit.load(cluster.url)
            checks = [e.payload["outcome"] for e in found if e.type == "verification"]
            time.sleep(0.5)
        assert "agree" in checks, (checks, cluster.tail("v0"))
        assert "disagree" not in checks and "fraud" not in checks, checks
    hidden.rename(model_dir)  # the run owner exports with the files the spec names
    out = tmp_path / "exported"
    assert export_run(cluster.data_dir, out)["round"] == 3
    run = read_run(cluster.data_dir)
    model, _, _ = build_model(run.model.spec, run.seed)
    load_checkpoint_into(model, run.checkpoint()[1])
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    exported = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=False)
    with torch.no_grad():
        diff = model.eval()(input_ids=ids).logits - exported.eval()(input_ids=ids).logits
    assert float(diff.abs().max()) < 1e-5


def test_demo_spec_names_hf_model_tokenizer_and_data_by_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`covey demo --model hf:DIR --tokenizer hf:DIR --data train.parquet`: the processes run
    in the run directory, so the spec holds absolute paths."""
    from covey.config import RunConfig
    from covey.local.demo import demo_spec

    monkeypatch.chdir(tmp_path)
    spec = demo_spec("diloco", model="hf:DIR", tokenizer="hf:DIR", data=("train.parquet",))
    cfg = RunConfig.model_validate(spec)
    assert cfg.model.source == f"hf:{tmp_path / 'DIR'}"
    assert cfg.data.tokenizer == f"hf:{tmp_path / 'DIR'}"
    assert cfg.data.paths == (str(tmp_path / "train.parquet"),)
    assert RunConfig.model_validate(demo_spec("diloco", model="micro")).model.spec == "covey:micro"
