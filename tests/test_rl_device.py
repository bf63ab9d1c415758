"""The RL run's verify device class: the spec names the class every check runs on
(`verify_device`, default cpu), a validator of another class refuses before claiming, the
trainer judges nothing where it lacks the class, a worker's `--device auto` is the run's
class, and the default run's id is what it was before the field existed.

The run verified on "cuda" is served on this CPU machine: exactly the case to refuse."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from typer.testing import CliRunner

from covey.cli import app
from covey.devices import DeviceError
from covey.peer.client import CoordinatorClient, PeerRejected
from covey.rl.peer import Membership, read_run
from covey.rl.runspec import (
    NotJudged,
    RLSpec,
    VerifyRefused,
    peer_device,
    run_id_of,
    verify_compute,
)
from covey.rl.trainer import Trainer
from covey.rl.worker import RolloutWorker
from covey.trust.identity import Identity
from tests.rl_helpers import (
    batch_status,
    fund,
    join_funded,
    ledger,
    policy,
    trainer_process,
    wait_for,
)

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
CUDA_SPEC = """
verify_device = "cuda"
group_size = 4
samples_per_step = 1000
audit_rate = 0.0
verify_timeout_s = 1
eval_prompts = 4
eval_every = 1000
heartbeat_s = 1
dead_after_s = 3
max_batch_bytes = 200000
canary_rate = 0.0
"""


def test_default_run_id_is_unchanged_and_the_class_is_hashed_when_set() -> None:
    cfg, policy0, key = {"vocab_size": 256}, "a" * 64, "b" * 64
    # computed with the spec before verify_device existed (commit df396d2), whose
    # canary_rate default was 0.05 (house canaries made it 0.5: a new default, a new id)
    before = RLSpec(canary_rate=0.05)
    assert run_id_of(before, cfg, policy0, key) == "5e3274c9f2c67c92"
    assert run_id_of(RLSpec(group_size=4, canary_rate=0.05), cfg, policy0, key) == (
        "e4e1987e09fcad09"
    )
    assert run_id_of(RLSpec(), cfg, policy0, key) != "5e3274c9f2c67c92"
    cuda = RLSpec(verify_device="cuda", canary_rate=0.05)
    assert run_id_of(cuda, cfg, policy0, key) != "5e3274c9f2c67c92"
    old = RLSpec().model_dump(mode="json")
    del old["verify_device"], old["verify_precision"]
    assert RLSpec.model_validate(old) == RLSpec()  # a stored spec of an older run loads
    with pytest.raises(ValueError, match="verify_device"):
        RLSpec(verify_device="tpu")  # type: ignore[arg-type]


def test_auto_resolves_to_the_run_verify_class() -> None:
    spec = RLSpec()
    assert peer_device(spec, "auto") == torch.device("cpu")
    assert peer_device(spec, "AUTO", "validator") == torch.device("cpu")
    assert peer_device(spec, "cpu", "validator") == torch.device("cpu")
    assert verify_compute(spec).device == torch.device("cpu")


@NO_CUDA
def test_a_cuda_run_on_this_cpu_machine_refuses_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = RLSpec(verify_device="cuda")
    with pytest.raises(VerifyRefused, match="this run verifies on cuda, this validator computes"):
        peer_device(spec, "cpu", "validator")
    with pytest.raises(VerifyRefused, match="verifies on cuda, which this machine lacks"):
        peer_device(spec, "auto", "validator")
    with pytest.raises(DeviceError, match="auto means this run's verify class, cuda"):
        peer_device(spec, "auto")
    with caplog.at_level(logging.WARNING, logger="covey.rl.runspec"):
        assert peer_device(spec, "cpu") == torch.device("cpu")
    assert "honest work may fail the checks" in caplog.text
    assert verify_compute(spec).refusal is not None


@NO_CUDA
def test_a_trainer_without_the_verify_class_judges_nothing(tmp_path: Path) -> None:
    t = Trainer(
        tmp_path / "run", spec=RLSpec(verify_device="cuda", eval_prompts=2), policy_dir="covey:nano"
    )
    try:
        status = t.status()
        assert status["verify_device"] == "cuda"
        assert "referee lacks device class cuda" in status["judging"]
        with pytest.raises(NotJudged, match="not judged: referee lacks device class cuda") as e:
            t.policy_at(0)
        assert e.value.status == 409
    finally:
        t.stop()


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A trainer process serving a run verified on cuda (on this CPU machine)."""
    d = tmp_path_factory.mktemp("rl-cuda") / "run"
    with trainer_process(d, CUDA_SPEC) as url:
        yield url, d.parent / "run.log"


def _cli(args: list[str]) -> tuple[int, str]:
    """`covey ARGS` in this process (torch is imported already: fast), signals restored."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = CliRunner().invoke(app, args)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    return result.exit_code, result.output


@NO_CUDA
@pytest.mark.network
def test_cuda_run_validator_refuses_and_nothing_is_judged(
    cuda_run: tuple[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    url, log = cuda_run
    status = httpx.get(f"{url}/v1/rl/status").json()
    assert status["verify_device"] == "cuda" and "lacks device class cuda" in status["judging"]
    assert httpx.get(f"{url}/v1/rl/spec").json()["spec"]["verify_device"] == "cuda"
    with caplog.at_level(logging.ERROR, logger="covey.rl.validator"):
        for device in ("auto", "cpu"):
            code, _ = _cli(["rl", "validator", "--trainer", url, "--device", device])
            assert code == 1, device
    assert "refusing to validate: this run verifies on cuda" in caplog.text
    code, out = _cli(["rl", "worker", "--trainer", url, "--max-steps", "1"])
    assert code == 2 and "auto means this run's verify class, cuda" in out, out

    w = RolloutWorker(url, Identity.generate(), name="w-cpu", device="cpu")  # warned
    join_funded(url, w, "worker")
    try:
        assert w.step(policy(url)) is not None
        # no validator may take it, so the trainer would check it itself: it cannot
        wait_for(lambda: "batches not judged" in log.read_text(), 30, "the trainer to decline")
        [row] = batch_status(url, w.identity.peer_id)
        assert row["status"] == "pending", row
        peer = w.identity.peer_id
        for kind in ("verification", "contribution accepted", "contribution rejected", "slash"):
            assert ledger(url, kind, peer) == [], kind
        accounts = httpx.get(f"{url}/v1/rl/status").json()["accounts"]
        assert [a["role"] for a in accounts.values()] == ["worker"]  # no validator joined
        _a_rejection_reported_is_not_judged(url, peer)
    finally:
        w.membership.leave()


def _a_rejection_reported_is_not_judged(url: str, worker_id: str) -> None:
    """A validator that claims the batch anyway (its own client, as one on CUDA would) and
    rejects it: the trainer cannot re-check the rejection, so 409 "not judged", the batch
    goes back to pending, and neither side is paid, slashed or penalized."""
    me = Identity.generate()
    client = CoordinatorClient(url, timeout_s=30.0, lost_s=30.0, identity=me)
    membership = Membership(client, me, read_run(client))
    fund(url, me.public_key, 10.0)
    membership.join("validator", "v-elsewhere", 10.0)
    try:
        body = {"run_id": membership.run.run_id, "peer_id": me.peer_id}
        task = wait_for(lambda: client.post("/v1/rl/claim", body)["task"], 30, "a claim")
        assert task["worker_id"] == worker_id
        cid = task["batch_cid"]
        report = {**body, "batch_cid": cid, "ok": False, "problem": "sampling", "detail": "x"}
        with pytest.raises(PeerRejected, match="not judged: referee lacks device class cuda"):
            client.post("/v1/rl/report", report)
        [row] = batch_status(url, worker_id)
        assert row["status"] == "pending", row  # (claimed batches show as pending too)
        # released, not held: a claim that still held it would be handed it again
        assert client.post("/v1/rl/claim", body)["task"] is None
        for kind in ("verification", "report refused", "penalty", "slash", "reward"):
            assert ledger(url, kind, worker_id) == [] and ledger(url, kind, me.peer_id) == []
    finally:
        membership.leave()
