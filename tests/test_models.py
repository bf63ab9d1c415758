"""Model sources: covey's GPT (named sizes have the parameter counts the docs state),
Hugging Face config directories, Python factories, and the errors of each."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from covey.config import ModelConfig
from covey.models.gpt import GPT, gpt_config, lm_loss
from covey.models.hf import ModelSourceError
from covey.models.source import build_model, build_run_model
from tests.tiny_hf import tiny_gpt2, tiny_llama


@pytest.mark.parametrize(
    ("size", "millions"),
    [("nano", 0.121), ("micro", 1.04), ("mini", 10.8), ("small", 48.3), ("gpt2", 124.5)],
)
def test_named_sizes(size: str, millions: float) -> None:
    with torch.device("meta"):  # no memory: only shapes
        model = GPT(gpt_config(size))
    assert model.num_parameters() / 1e6 == pytest.approx(millions, rel=0.01)


def test_unknown_size_and_long_input_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        gpt_config("huge")
    model = GPT(gpt_config("nano"))
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_loss_starts_near_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_config("nano"))
    batch = torch.randint(0, 256, (4, 65))
    assert float(lm_loss(model, batch).detach()) == pytest.approx(math.log(256), abs=0.1)


# --- model sources (covey.models.source) ------------------------------------------------


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_covey_presets_by_source_and_bare_name() -> None:
    a, loss, info = build_model("covey:nano", seed=3)
    b, _, _ = build_model("nano", seed=3)
    assert isinstance(a, GPT) and loss is lm_loss and _same_weights(a, b)
    assert (info.kind, info.vocab_size, info.max_positions) == ("covey", 256, 64)
    c, _, _ = build_model("covey:nano", seed=4)
    assert not _same_weights(a, c)  # the seed is the only source of the init
    wide, _, wide_info = build_model("covey:nano", seed=3, vocab_size=300)
    assert wide_info.vocab_size == 300 and wide.wte.weight.shape[0] == 300  # type: ignore[union-attr]


@pytest.mark.parametrize("maker", [tiny_llama, tiny_gpt2])
def test_hf_config_dirs_build_deterministic_models(tmp_path: Path, maker: Any) -> None:
    d = maker(tmp_path / "m")
    a, loss, info = build_model(f"hf:{d}", seed=0)
    b, _, _ = build_model(f"hf:{d}", seed=0)
    c, _, _ = build_model(f"hf:{d}", seed=1)
    assert _same_weights(a, b) and not _same_weights(a, c)
    assert info.kind == "hf" and info.vocab_size == 320 and 50_000 < info.parameters < 400_000
    batch = torch.randint(0, 320, (2, 17))
    assert float(loss(a, batch).detach()) == pytest.approx(math.log(320), abs=0.3)


def test_hf_pretrained_init_loads_safetensors(tmp_path: Path) -> None:
    d = tiny_llama(tmp_path / "m")
    trained, _, _ = build_model(f"hf:{d}", seed=7)
    trained.save_pretrained(str(tmp_path / "w"), safe_serialization=True)  # type: ignore[operator]
    model, _, _ = build_model(f"hf:{d}", seed=0, init=f"hf:{tmp_path / 'w'}")
    assert _same_weights(model, trained)
    with pytest.raises(ModelSourceError, match=r"no \*\.safetensors"):
        build_model(f"hf:{d}", seed=0, init=f"hf:{d}")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "x.Y"}}, "trust_remote_code"),
        ({"model_type": "my_secret_arch"}, "not an architecture"),
        ({"hidden_size": 4}, "model_type"),
    ],
)
def test_hf_configs_that_need_code_are_refused(
    tmp_path: Path, config: dict[str, Any], match: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError, match=match):
        build_model(f"hf:{tmp_path}", seed=0)


def test_bad_sources_name_the_source(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="'onnx:x'"):
        build_model("onnx:x", seed=0)
    with pytest.raises(ModelSourceError, match=r"no config\.json"):
        build_model(f"hf:{tmp_path}", seed=0)
    with pytest.raises(ModelSourceError, match="cannot import"):
        build_model("py:no_such_module_xyz:make", seed=0)
    with pytest.raises(ModelSourceError, match="has no nothing"):
        build_model("py:tests.test_models:nothing", seed=0)
    with pytest.raises(ModelSourceError, match=r"must return \(nn.Module, loss_fn\)"):
        build_model("py:tests.test_models:bad_factory", seed=0)


def tiny_factory() -> tuple[torch.nn.Module, Any]:
    """A py: model source: an embedding and a linear head."""
    model = torch.nn.Sequential(torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256))

    def loss(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = m(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    return model, loss


def bad_factory() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


def test_python_factory_source() -> None:
    a, loss, info = build_model("py:tests.test_models:tiny_factory", seed=5)
    b, _, _ = build_model("py:tests.test_models:tiny_factory", seed=5)
    assert _same_weights(a, b) and info.kind == "py" and info.max_positions is None
    assert float(loss(a, torch.randint(0, 256, (2, 9))).detach()) > 0


def test_mismatches_fail_before_training_naming_both_values(tmp_path: Path) -> None:
    d = tiny_llama(tmp_path / "m", vocab_size=320, positions=32)
    cfg = ModelConfig(source=f"hf:{d}")
    with pytest.raises(ValueError, match=r"vocabulary \(400\).*\(320 rows"):
        build_run_model(cfg, 0, tokenizer_vocab=400, seq_len=16)
    with pytest.raises(ValueError, match=r"seq_len \(64\).*positions \(32"):
        build_run_model(cfg, 0, tokenizer_vocab=300, seq_len=64)
    _, _, _, seq_len = build_run_model(cfg, 0, tokenizer_vocab=300, seq_len=None)
    assert seq_len == 32  # default: min(256, the model's positions)
    _, _, info, seq_len = build_run_model(
        ModelConfig(size="nano"), 0, tokenizer_vocab=300, seq_len=None
    )
    assert (seq_len, info.vocab_size) == (64, 300)  # a covey preset takes the tokenizer's vocab


def test_model_files_bundle_round_trips_and_refuses_anything_but_json(tmp_path: Path) -> None:
    from covey.models.bundle import bundle_model_files, local_sources, unpack_model_files

    d = tiny_llama(tmp_path / "m")
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    (d / "modeling_evil.py").write_text("import os")  # never bundled
    data = bundle_model_files(f"hf:{d}", f"hf:{d}")
    assert data is not None and b"modeling_evil" not in data
    assert bundle_model_files("covey:nano", "bytes") is None
    out = unpack_model_files(data, tmp_path / "got")
    assert json.loads((out["model"] / "config.json").read_text())["model_type"] == "llama"
    evil = json.loads(data)
    evil["model"]["modeling_evil.py"] = "import os"
    with pytest.raises(ValueError, match="must be among"):
        unpack_model_files(json.dumps(evil).encode(), tmp_path / "x")
    with pytest.raises(ValueError, match="not JSON"):
        unpack_model_files(b"\x80abc", tmp_path / "x")
    with pytest.raises(ValueError, match="format"):
        unpack_model_files(b'{"format": "zip"}', tmp_path / "x")
    # a peer without the files fetches them; with them, it keeps its own
    cfg = ModelConfig(source=f"hf:{tmp_path / 'absent'}")
    got, tok = local_sources(cfg, f"hf:{tmp_path / 'absent'}", "cid", lambda cid: data)
    assert build_model(got.spec, 0)[2].kind == "hf" and tok.startswith("hf:")
    with pytest.raises(RuntimeError, match="publishes no model files"):
        local_sources(cfg, "bytes", None, lambda cid: data)
    same = ModelConfig(source=f"hf:{d}")
    assert local_sources(same, "bytes", None, lambda cid: b"") == (same, "bytes")
