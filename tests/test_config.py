"""Run specs: every shipped config loads; bad values get clear errors; frozen and hashed."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from covey.config import SimConfig, StreamingDiLoCoConfig, load_sim_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def test_there_are_shipped_configs() -> None:
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_sim_config(path)
    assert cfg.rounds >= 1
    assert len(cfg.config_hash()) == 16


def test_config_is_frozen_and_hash_tracks_content() -> None:
    a = SimConfig()
    with pytest.raises(ValidationError):
        a.workers = 3  # type: ignore[misc]
    assert a.config_hash() == SimConfig().config_hash()
    assert a.config_hash() != SimConfig(workers=3).config_hash()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"workers": 0}, "workers"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"algorithm": {"method": "nope"}}, "method"),
        ({"algorithm": {"method": "streaming", "inner_steps": 10, "fragments": 4}}, "multiple"),
        ({"algorithm": {"method": "demo", "chunk": 8, "topk": 16}}, "exceed"),
        ({"steps": 10, "algorithm": {"method": "diloco", "inner_steps": 50}}, "fewer than one"),
        ({"compute": {"slowdown": [0.5]}}, ">= 1"),
    ],
)
def test_bad_configs_are_rejected_with_the_field_named(data: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        SimConfig.model_validate(data)


def test_flags_override_toml(tmp_path: Path) -> None:
    p = tmp_path / "run.toml"
    p.write_text('workers = 4\n[algorithm]\nmethod = "streaming"\ninner_steps = 8\nfragments = 2\n')
    cfg = load_sim_config(p, algorithm={"fragments": 4})
    assert isinstance(cfg.algorithm, StreamingDiLoCoConfig)
    assert cfg.algorithm.fragments == 4 and cfg.workers == 4 and cfg.rounds == cfg.steps // 2


def test_invalid_toml_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("workers = [\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_sim_config(p)


RUN_SPECS = sorted((Path(__file__).parent.parent / "configs" / "network").glob("*.toml"))


@pytest.mark.parametrize("path", RUN_SPECS, ids=lambda p: p.name)
def test_every_shipped_run_spec_loads(path: Path) -> None:
    from covey.config import load_run_config

    cfg = load_run_config(path)
    assert len(cfg.run_id) == 16 and cfg.run_id == load_run_config(path).run_id


def test_run_spec_rejects_inconsistent_rounds() -> None:
    from covey.config import RunConfig

    with pytest.raises(ValidationError, match="dead_after_s"):
        RunConfig.model_validate({"rounds": {"heartbeat_s": 5, "dead_after_s": 4}})
    with pytest.raises(ValidationError, match="deadline_max_s"):
        RunConfig.model_validate({"rounds": {"deadline_min_s": 50, "deadline_max_s": 10}})
