"""The status page's samples (covey.coordinator.samples): seeded continuations of fixed
prompts by the canonical model, refreshed by a real coordinator's evaluator every
`rounds.samples_every` rounds and served in /v1/status."""

from __future__ import annotations

from pathlib import Path

import pytest

from covey.config import RunConfig
from covey.coordinator.samples import draw_samples
from covey.data.tokenizer import load_tokenizer
from covey.models.source import build_model


def test_defaults_name_prompts_and_a_period() -> None:
    rounds = RunConfig().rounds
    assert rounds.samples_every == 5 and rounds.sample_tokens == 40
    assert rounds.sample_prompts == ("def ", "import ", "The ")


def test_samples_are_seeded_and_follow_the_weights() -> None:
    import torch

    model, _, _ = build_model("covey:nano", 0)
    tok = load_tokenizer("bytes")
    args = {"round": 3, "window": 64, "max_new_tokens": 12, "hf": False}
    first = draw_samples(model, tok, ["def ", "The "], **args)
    assert first == draw_samples(model, tok, ["def ", "The "], **args)  # fixed seed
    assert first["round"] == 3 and [s["prompt"] for s in first["samples"]] == ["def ", "The "]
    assert all(isinstance(s["text"], str) and s["text"] for s in first["samples"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    assert draw_samples(model, tok, ["def ", "The "], **args) != first


def test_samples_of_a_hugging_face_model(tmp_path: Path) -> None:
    from tests.tiny_hf import tiny_llama

    model, _, _ = build_model(f"hf:{tiny_llama(tmp_path / 'llama', vocab_size=256)}", 0)
    out = draw_samples(
        model, load_tokenizer("bytes"), ["import "], round=1, window=32, max_new_tokens=5, hf=True
    )
    assert len(out["samples"]) == 1 and isinstance(out["samples"][0]["text"], str)


SPEC = """
name = "samples"
[model]
size = "nano"
[data]
batch_size = 2
seq_len = 32
[algorithm]
inner_steps = 2
[rounds]
deadline_min_s = 2
eval_batches = 1
samples_every = 2
sample_tokens = 8
"""


@pytest.mark.network
@pytest.mark.long  # ~17 s; the samples themselves are tested without a process above
def test_a_running_coordinator_serves_samples(tmp_path: Path) -> None:
    """Coordinator and worker processes: after the first evaluation /v1/status carries one
    sample per default prompt, and it is refreshed at later multiples of samples_every."""
    from covey.local.cluster import LocalCluster

    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        assert cluster.status()["samples"] is None  # nothing evaluated yet
        cluster.start_worker("w0", "--threads", "1")
        status = cluster.wait_for(
            lambda s: bool(s["samples"]) and s["samples"]["round"] >= 4, 180, "samples >= 4"
        )
    samples = status["samples"]
    assert samples["round"] % 2 == 0 and samples["max_new_tokens"] == 8
    assert [s["prompt"] for s in samples["samples"]] == ["def ", "import ", "The "]
    assert all(isinstance(s["text"], str) for s in samples["samples"])
