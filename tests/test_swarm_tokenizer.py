"""SWARM trainers tokenize with an hf: model's own tokenizer.json: the run names
the file's digest, every trainer checks its copy against it, and a tokenizer larger than the
model's embedding is refused with the numbers. Servers see only token ids, so the tokenizer
is the trainers' concern alone; a process run of an hf: model over HTTP is in
tests/test_swarm_hf.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from covey.data.corpus import load_corpus
from covey.swarm.config import SwarmConfig
from covey.swarm.trainer import training_tokens
from tests.tiny_hf import TEXTS, tiny_llama, tiny_tokenizer


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tiny_llama(tmp_path / "llama", vocab_size=320)
    tiny_tokenizer(d, vocab_size=300)
    return d


@pytest.fixture
def data(tmp_path: Path) -> Path:
    f = tmp_path / "data.jsonl"
    f.write_text("".join(f'{{"text": "{t}"}}\n' for t in TEXTS))
    return f


def test_an_hf_model_trains_on_its_own_tokenizer(model_dir: Path, data: Path) -> None:
    cfg = SwarmConfig(model=f"hf:{model_dir}", data_paths=(str(data),))
    assert cfg.tokenizer_digest and cfg.tokenizer_source() == f"hf:{model_dir}"
    got = training_tokens(cfg)
    want = load_corpus([str(data)], tokenizer=f"hf:{model_dir}").train
    assert got.equal(want) and int(got.max()) >= 256  # BPE merges, not bytes
    # the spec as peers receive it (digest filled in) keeps its run id and source
    again = SwarmConfig.model_validate(cfg.model_dump(mode="json"))
    assert again.run_id == cfg.run_id and again.tokenizer_source() == cfg.tokenizer_source()
    # bytes when asked, and for a model directory without a tokenizer: the old run ids
    as_bytes = SwarmConfig(model=f"hf:{model_dir}", tokenizer="bytes")
    assert as_bytes.tokenizer_source() == "bytes" and as_bytes.run_id != cfg.run_id
    plain = SwarmConfig()
    assert "tokenizer" not in plain.model_dump_json(exclude_defaults=True)
    assert plain.tokenizer_source() == "bytes"


def test_a_trainer_with_another_tokenizer_or_too_small_a_model_is_refused(
    model_dir: Path, data: Path, tmp_path: Path
) -> None:
    cfg = SwarmConfig(model=f"hf:{model_dir}", data_paths=(str(data),))
    with open(model_dir / "tokenizer.json", "a") as f:
        f.write("\n")  # this peer's copy differs from the run's by one byte
    with pytest.raises(ValueError, match="every trainer must tokenize alike"):
        training_tokens(cfg)
    small = tiny_llama(tmp_path / "small", vocab_size=280)
    tiny_tokenizer(small, vocab_size=300)
    cfg = SwarmConfig(model=f"hf:{small}", data_paths=(str(data),))
    with pytest.raises(ValueError, match=r"has 30\d tokens, the model's embedding 280 rows"):
        training_tokens(cfg)
