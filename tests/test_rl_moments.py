"""A restarted RL trainer resumes its AdamW moments (covey.rl.moments): its next step gives
exactly (bitwise, same machine and threads) the weights an uninterrupted trainer gives from
the same accepted batches; moments that do not fit the run refuse the start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from covey.rl import policy as pol
from covey.rl.batch import RolloutBatch, rollout
from covey.rl.learning import make_learner
from covey.rl.moments import MomentsError, moments_path
from covey.rl.runspec import RLSpec
from covey.rl.trainer import Trainer

SPEC = RLSpec(group_size=4, samples_per_step=8, eval_prompts=2, eval_every=1000, max_new_tokens=6)


def _batch(t: Trainer, step: int, worker: str) -> RolloutBatch:
    """An honest batch of `step` whose rewards are varied by hand (a random policy scores
    0 everywhere, which would leave every advantage, gradient and moment at zero)."""
    b = rollout(
        t.policy_at(step),
        t.task,
        t.rollout,
        step=step,
        worker_id=worker,
        policy_version=step,
        policy_cid=t.cids[step],
    )
    samples = [s.model_copy(update={"reward": (i * 7 % 3) / 2}) for i, s in enumerate(b.samples)]
    return b.model_copy(update={"samples": samples})


def _accept(t: Trainer, b: RolloutBatch) -> None:
    cid = t.blobs.put(b.model_dump_json().encode())
    tokens = sum(len(s.tokens) for s in b.samples)
    with t.db.transaction() as c:
        c.execute(
            "INSERT INTO rl_batches (step, worker_id, cid, samples, tokens, status, "
            "submitted_at) VALUES (?, ?, ?, ?, ?, 'accepted', 0)",
            (b.step, b.worker_id, cid, len(b.samples), tokens),
        )


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Two trainer steps with a restart between them, and the batches they used."""
    d = tmp_path_factory.mktemp("moments") / "run"
    t = Trainer(d, spec=SPEC, policy_dir="covey:nano")
    v0 = pol.load_weights(pol.build_policy(t.model_cfg), t.blobs.get(t.cids[0]))
    b1 = _batch(t, 0, "w1")
    _accept(t, b1)
    assert t.step_if_ready() is not None and t.version == 1
    assert moments_path(d, 1).exists() and not moments_path(d, 0).exists()
    b2 = _batch(t, 1, "w2")
    v1 = _weights(t.policy)
    t.stop()
    restarted = Trainer(d)  # loads v1's moments
    _accept(restarted, b2)
    assert restarted.step_if_ready() is not None and restarted.version == 2
    v2 = _weights(restarted.policy)
    restarted.stop()
    assert moments_path(d, 2).exists() and not moments_path(d, 1).exists()
    return {"dir": d, "v0": v0, "v1": v1, "v2": v2, "b1": b1, "b2": b2}


def test_restart_steps_exactly_as_an_uninterrupted_trainer(run: dict) -> None:
    model = run["v0"]
    learner = make_learner(model, SPEC, SPEC.task.build())
    learner.step([(run["b1"], 0)], 0)
    assert all(torch.equal(v, run["v1"][k]) for k, v in model.state_dict().items())
    learner.step([(run["b2"], 1)], 1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, run["v2"][k]), f"{k} differs after the restart"


def test_fresh_moments_would_give_other_weights(run: dict) -> None:
    """The check above can fail: a restart with fresh moments lands elsewhere."""
    model = pol.build_policy(Trainer(run["dir"]).model_cfg)
    model.load_state_dict(run["v1"])
    make_learner(model, SPEC, SPEC.task.build()).step([(run["b2"], 1)], 1)
    assert any(not torch.equal(v, run["v2"][k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "fault, message",
    [
        ("version", "version is '7', this run's is '2'"),
        ("nan", "NaN or Infinity"),
        ("shape", "has shape"),
        ("missing", "incomplete moments"),
        ("garbage", "not a safetensors file"),
    ],
)
def test_moments_that_do_not_fit_refuse_the_start(
    run: dict, tmp_path: Path, fault: str, message: str
) -> None:
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(run["dir"], d)
    path = moments_path(d, 2)
    tensors = load_file(str(path))
    meta = {"run_id": Trainer(d).run_id, "version": "2", "policy_cid": ""}
    meta["policy_cid"] = Trainer(d).cids[2]
    name = next(k for k in tensors if k.endswith(".exp_avg"))
    if fault == "version":
        meta["version"] = "7"
    elif fault == "nan":
        tensors[name] = torch.full_like(tensors[name], float("nan"))
    elif fault == "shape":
        tensors[name] = tensors[name].reshape(-1)[:1].clone()
    elif fault == "missing":
        del tensors[name]
    if fault == "garbage":
        path.write_bytes(b"\x80\x04 this is a pickle, not safetensors")
    else:
        save_file(tensors, str(path), metadata=meta)
    with pytest.raises(MomentsError, match=message) as e:
        Trainer(d)
    assert str(path) in str(e.value)


def test_concurrent_checks_of_one_policy_agree(run: dict) -> None:
    """The trainer checks batches from its loop thread (deadline and canary-source checks)
    and from request threads (audits, re-checks), on one frozen model per version. The
    prefill captures hidden states with a forward hook on that shared model, so two
    checks at once read each other's states: a demo rejected an honest batch so ("top-k
    overlap 0.667"). `Judge.check` serializes them."""
    import threading

    t = Trainer(run["dir"])
    try:
        b = rollout(
            t.policy_at(2),
            t.task,
            t.rollout,
            step=2,
            worker_id="w3",
            policy_version=2,
            policy_cid=t.cids[2],
        )
        _accept(t, b)
        row = t.db.one("SELECT * FROM rl_batches WHERE worker_id = 'w3'")
        verdicts: list[object] = []

        def check() -> None:
            for _ in range(8):
                verdicts.append(t.intake.judge.check(row, None))

        threads = [threading.Thread(target=check) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert len(verdicts) == 32
        assert all(v.ok for v in verdicts), [v for v in verdicts if not v.ok][:2]
    finally:
        t.stop()
