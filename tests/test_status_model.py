"""The status pages and the demo summary name the run's real model and its parameter count
(covey.models.naming): a covey GPT preset, and tiny Hugging Face models (tests/tiny_hf.py),
counted independently of covey (torch's own modules, transformers' own classes)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.models.naming import count_text, gpt_preset, model_name, model_title
from tests.test_dashboard import StatusServer, chromium, parse, render_dom, server
from tests.tiny_hf import tiny_gpt2, tiny_llama

__all__ = ["chromium", "server"]  # the page tests' fixtures, from tests/test_dashboard.py

SPEC = """
name = "named"
[model]
source = "{source}"
[data]
batch_size = 4
seq_len = 32
"""


def test_names_of_presets_and_hf_configs() -> None:
    from covey.models.gpt import GPT_SIZES

    assert model_name("covey:nano", GPT_SIZES["nano"].to_dict()) == "covey GPT nano (2 layers x 64)"
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 12}
    assert model_name("hf:configs/gpt2-124m", {**gpt2, "n_embd": 768}) == (
        "GPT-2 (GPT2LMHeadModel, 12 layers x 768)"
    )
    assert model_name("hf:x", {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64})
    assert model_name("hf:x", {"model_type": "brandnew"}) == "brandnew"
    assert model_name("py:my.models:build") == "my.models:build (a Python factory)"
    # the RL trainer knows a GPT's config, not the preset it came from
    resized = {**GPT_SIZES["micro"].to_dict(), "vocab_size": 999}
    assert gpt_preset(resized) == "micro" and gpt_preset({**resized, "n_layer": 3}) is None
    assert [count_text(n) for n in (999, 122_432, 1_040_000, 124_439_808, 3_210_000_000)] == [
        "999",
        "0.12M",
        "1.04M",
        "124.4M",
        "3.2B",
    ]
    title = model_title("GPT-2 (GPT2LMHeadModel)", "hf:configs/gpt2-124m", 124_439_808)
    assert title == "GPT-2 (GPT2LMHeadModel), hf:configs/gpt2-124m, 124.4M parameters"


def _hf_count(directory: Path) -> int:
    """Parameters of the model transformers itself builds from `directory`'s config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    return sum(p.numel() for p in model.parameters())


def _gpt_count(preset: str) -> int:
    from covey.models.gpt import GPT, gpt_config

    return sum(p.numel() for p in GPT(gpt_config(preset)).parameters())


MODELS = {
    # source (tmp_path filled in), its name, how to count its parameters independently
    "covey-micro": (
        "covey:micro",
        "covey GPT micro (5 layers x 128)",
        lambda _: _gpt_count("micro"),
    ),
    "hf-gpt2": ("hf:{tmp}/gpt2", "GPT-2 (2 layers x 64)", lambda tmp: _hf_count(tmp / "gpt2")),
    "hf-llama": (
        "hf:{tmp}/llama",
        "Llama (LlamaForCausalLM, 2 layers x 64)",
        lambda tmp: _hf_count(tmp / "llama"),
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def run_status(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict, str, int]]:
    """(the coordinator's /v1/status, the expected name, the independent count) of a run of
    each model, the coordinator's app in-process."""
    from fastapi.testclient import TestClient

    from covey.config import load_run_config
    from covey.coordinator.app import create_app
    from covey.coordinator.service import Coordinator

    source, name, count = MODELS[request.param]
    tmp_path = tmp_path_factory.mktemp(request.param)
    tiny_gpt2(tmp_path / "gpt2")
    tiny_llama(tmp_path / "llama")
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(source=source.format(tmp=tmp_path)))
    coord = Coordinator(load_run_config(spec), tmp_path / "data")
    try:
        with TestClient(create_app(coord)) as http:
            status = http.get("/v1/status").json()
        yield status, name, count(tmp_path)
    finally:
        coord.stop()


def test_status_json_names_the_model_and_counts_its_parameters(
    run_status: tuple[dict, str, int],
) -> None:
    status, name, count = run_status
    assert status["model_name"] == name
    assert status["parameters"] == count
    assert status["model_source"].startswith(("covey:", "hf:"))
    assert status["model_source"].split(":")[-1].endswith(("micro", "/gpt2", "/llama"))


def test_demo_summary_names_the_model(run_status: tuple[dict, str, int]) -> None:
    from covey.local.demo_report import _summary_lines

    status, name, count = run_status
    summary = {
        "run_id": status["run_id"],
        "rounds_committed": 0,
        "minutes": 0.5,
        "algorithm": status["method"],
        "model_name": status["model_name"],
        "model_source": status["model_source"],
        "parameters": status["parameters"],
        "interrupted": False,
        "first_val_loss": None,
        "bytes_total": 0,
        "tokens_total": 0,
        "peers_seen": [],
        "processes": {},
        "trust": {"ledger": "ok", "banned": [], "agreed": 0, "disputes": 0},
        "kills": 0,
        "paths": {"run_dir": "runs/demo", "checkpoints": [], "plot": None},
    }
    first = _summary_lines(summary)[1]
    assert f"({status['method']}, {name}, {status['model_source']}, " in first
    assert first.endswith(f", {count_text(count)} parameters)")


def test_dashboard_shows_the_model_name_source_and_count(
    chromium: str, server: StatusServer, run_status: tuple[dict, str, int]
) -> None:
    status, name, count = run_status
    server.status = status
    doc = parse(render_dom(server.url))
    assert doc.by_id("model").text == name
    sub = doc.by_id("parameters").text
    assert sub.startswith(status["model_source"] + " · ") and sub.endswith(" parameters")
    assert sub.split(" · ")[1] == count_text_js(count) + " parameters"


def count_text_js(n: int) -> str:
    """The page's fmtCount (one decimal, k/M/B)."""
    for d, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= d:
            return f"{n / d:.1f}{unit}"
    return str(n)


@contextlib.contextmanager
def _served(app: Any) -> Iterator[str]:
    import uvicorn

    from tests.rl_helpers import free_port, wait_for

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ok(url + "/v1/rl/status"), 60, "the trainer to serve")
        yield url
    finally:
        srv.should_exit = True
        thread.join(20)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_rl_status_page_names_the_policy(chromium: str, tmp_path: Path) -> None:
    from covey.rl.runspec import RLSpec
    from covey.rl.service import create_app
    from covey.rl.trainer import Trainer

    t = Trainer(tmp_path / "run", spec=RLSpec(), policy_dir="covey:nano")
    try:
        with _served(create_app(t)) as url:
            status = httpx.get(url + "/v1/rl/status", timeout=10).json()
            doc = parse(render_dom(url + "/"))
    finally:
        t.stop()
    assert status["model_name"] == "covey GPT nano (2 layers x 64)"
    assert status["parameters"] == sum(p.numel() for p in t.policy.parameters())
    assert doc.by_id("model").text == status["model_name"]
    assert doc.by_id("parameters").text == count_text_js(status["parameters"])
    # the host's frame, the same on every mode's page, filled from /v1/run and /v1/host
    assert doc.by_id("frame-run").text == f"covey · rl · run {status['run_id']}"
    assert doc.by_id("frame-ledger").text.startswith("ledger ")
    assert " entries · head " in doc.by_id("frame-ledger").text
    assert doc.by_id("frame-live").text.startswith("live ")
    assert doc.by_id("frame-halt").text == ""
