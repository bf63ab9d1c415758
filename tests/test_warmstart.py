"""Warm start: `model.init` names a covey checkpoint (a state file or a run
directory); the simulator and the coordinator start from its parameters, and
`data.round_offset` keeps the continuation off the warm-up's batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from covey.config import SimConfig
from covey.data.corpus import Corpus
from covey.io.export import save_sim_run
from covey.models.source import build_run_model
from covey.models.warmstart import (
    WarmStartError,
    apply_init,
    checkpoint_file,
    checkpoint_round,
)
from covey.sim.simulator import sim_batch, simulate


def tiny(**over: Any) -> SimConfig:
    base: dict[str, Any] = {
        "workers": 2,
        "steps": 4,
        "eval_batches": 1,
        "threads": 1,
        "data": {"batch_size": 2, "seq_len": 32},
        "algorithm": {"method": "ddp"},
        "compute": {"step_time_s": 0.01},
    }
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return SimConfig.model_validate(base)


@pytest.fixture(scope="module")
def warmup_dir(stdlib_corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-round DDP warm-up, saved as `covey sim --out` saves it."""
    cfg = tiny()
    out = tmp_path_factory.mktemp("warmup")
    result = simulate(cfg, stdlib_corpus, progress=False)
    save_sim_run(out, cfg, result.state)
    return out


def test_a_continuation_starts_from_the_warm_ups_weights(
    warmup_dir: Path, stdlib_corpus: Corpus
) -> None:
    path = checkpoint_file(str(warmup_dir))
    assert path.name == "round-000004.safetensors" and checkpoint_round(path) == 4
    cold = simulate(tiny(steps=1), stdlib_corpus, progress=False).summary
    warm_cfg = tiny(steps=1, model={"init": str(warmup_dir)}, data={"round_offset": 4}, seed=0)
    warm = simulate(warm_cfg, stdlib_corpus, progress=False).summary
    # the warm start evaluates where the warm-up ended, below a random init
    assert warm["initial_val_loss"] < cold["initial_val_loss"] - 0.1
    assert warm["init"] == str(path) and warm["round_offset"] == 4
    # the file itself works as well as its directory
    model, *_ = build_run_model(warm_cfg.model, 0, tokenizer_vocab=256, seq_len=32)
    assert apply_init(model, str(path)) == path


def test_the_continuation_never_draws_the_warm_ups_batches(stdlib_corpus: Corpus) -> None:
    warm = tiny()
    seen = {
        sim_batch(warm, stdlib_corpus, 32, r, w, 0).numpy().tobytes()
        for r in range(warm.rounds)
        for w in range(warm.workers)
    }
    assert len(seen) == warm.rounds * warm.workers

    def continuation(offset: int) -> set[bytes]:
        cfg = tiny(algorithm={"method": "diloco", "inner_steps": 2}, data={"round_offset": offset})
        return {
            sim_batch(cfg, stdlib_corpus, 32, r, w, s).numpy().tobytes()
            for r in range(cfg.rounds)
            for w in range(cfg.workers)
            for s in range(2)
        }

    assert continuation(0) & seen  # without the offset, round 0 re-reads the warm-up's data
    assert not continuation(warm.rounds) & seen


def test_a_checkpoint_of_another_model_is_refused(warmup_dir: Path, tmp_path: Path) -> None:
    other = tiny(model={"size": "micro"})
    model, *_ = build_run_model(other.model, 0, tokenizer_vocab=256, seq_len=32)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(WarmStartError, match="parameter names differ"):
        apply_init(model, str(warmup_dir))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    with pytest.raises(WarmStartError, match="no such file"):
        apply_init(model, str(tmp_path / "missing"))
    with pytest.raises(WarmStartError, match="without checkpoints"):
        apply_init(model, str(tmp_path))
    assert apply_init(model, None) is None and apply_init(model, "hf:somewhere") is None


def test_a_networked_run_starts_from_the_checkpoint(
    warmup_dir: Path, stdlib_corpus: Corpus, tmp_path: Path
) -> None:
    """The coordinator's round-0 state is the checkpoint's parameters (workers receive it
    over the network, so only the coordinator reads the file); a run spec with a round
    offset moves every assignment's batches past the warm-up's."""
    from covey.config import RunConfig
    from covey.coordinator.service import Coordinator
    from covey.data.batches import assignment_batches
    from covey.protocol.checkpoint import state_from_file

    spec = {"model": {"init": str(warmup_dir)}, "data": {"seq_len": 32, "batch_size": 2}}
    cfg = RunConfig.model_validate(spec)
    saved = load_file(str(checkpoint_file(str(warmup_dir))))
    for restart in (False, True):  # the state a new run stores, then the one it resumes
        coord = Coordinator(cfg, tmp_path / "run")
        try:  # the template is shapes only: the round-0 state is the stored one
            served = state_from_file(coord.blobs.path(coord.state_cid), coord.rounds.template)
            assert coord.state.round == served.round == 0
            assert coord.state_hash == served.digest() == coord.state.digest()
            for name, t in served.params.items():
                assert torch.equal(t, saved[f"params/{name}"]), name
                assert torch.equal(coord.state.params[name], t), (name, restart)
        finally:
            coord.stop()
    later = RunConfig.model_validate({**spec, "data": {**spec["data"], "round_offset": 4}})
    first = assignment_batches(cfg, stdlib_corpus, 32, 4, "peer")(0)
    assert torch.equal(assignment_batches(later, stdlib_corpus, 32, 0, "peer")(0), first)
