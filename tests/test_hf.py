"""Tokenizers (bytes, hf:<dir>, `covey tokenizer train`) on real files: what transformers
loads must encode exactly as covey does."""

from __future__ import annotations

import json
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
