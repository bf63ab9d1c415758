"""The referee recomputes on the run's verify device class, or judges nothing.

This machine has no GPU, so a run whose `[peer] verify_device` is "cuda" is one its
coordinator cannot referee: it must say so at start and leave every dispute open (nobody
slashed, nobody cleared) rather than recompute on the CPU and convict on rounding.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from covey.algorithms import build_strategy
from covey.cli import app
from covey.config import DiLoCoConfig, PeerConfig, load_run_config
from covey.coordinator.verification import Verification
from covey.devices import DeviceError, referee_compute
from covey.models.gpt import lm_loss
from tests.conftest import tiny_gpt

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@NO_CUDA
def test_a_cuda_verified_run_is_refused_on_a_cpu_machine() -> None:
    rc = referee_compute("cuda", "auto", None)
    assert rc.device is None and rc.refusal is not None
    assert rc.refusal.startswith("referee lacks device class cuda") and rc.precision == "bf16"
    with pytest.raises(DeviceError, match="'cuda:0'"):
        referee_compute("cpu", "auto", "cuda:0")  # an absent --device: the CLI's exit 2


def test_the_run_class_is_the_default_and_another_class_or_precision_refuses() -> None:
    rc = referee_compute("cpu", "auto", None)
    assert rc.device == torch.device("cpu") and rc.precision == "fp32" and rc.refusal is None
    assert referee_compute("cpu", "bf16", "cpu").precision == "bf16"  # a CPU can check bf16
    wrong = referee_compute("mps", "fp32", "cpu")
    assert wrong.device is None and wrong.refusal is not None
    assert "referee lacks device class mps" in wrong.refusal and "verifies on mps" in wrong.refusal


class _Referee(Verification):
    """The dispute side of a coordinator without its database: `_task` is where judging
    would start, and it must not be reached while the referee refuses."""

    def __init__(self, peer: PeerConfig) -> None:
        self._init_referee()
        self.cfg = SimpleNamespace(peer=peer, algorithm=DiLoCoConfig(inner_steps=2))
        self.strategy = build_strategy(DiLoCoConfig(inner_steps=2), tiny_gpt(), lm_loss)
        self.judged: list[int] = []

    def _task(self, task_id: int) -> None:
        self.judged.append(task_id)
        raise AssertionError("a refusing referee judged a dispute")


@NO_CUDA
def test_a_referee_without_the_class_warns_at_start_and_leaves_disputes_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ref = _Referee(PeerConfig(verify_device="cuda", precision="fp32"))
    with caplog.at_level(logging.WARNING, logger="covey.coordinator"):
        ref.set_referee_device(None)
        ref._settle(7)
    assert ref.judged == []  # nothing recomputed, nothing written: the dispute stays open
    text = caplog.text
    assert "will not judge disputes: referee lacks device class cuda" in text
    assert "dispute 7 stays open: referee lacks device class cuda" in text


def test_the_referee_strategy_takes_the_run_precision() -> None:
    ref = _Referee(PeerConfig(verify_device="cpu", precision="bf16"))
    ref.set_referee_device(None)
    s = ref._referee_strategy_for()
    assert s is not ref.strategy and s.precision == "bf16" and s.device.type == "cpu"


CORPUS_SPEC = """
name = "referee-class"
[model]
size = "nano"
[data]
batch_size = 2
seq_len = 16
paths = ["{corpus}"]
[algorithm]
method = "diloco"
inner_steps = 2
codec = "fp32"
inner_state = "reset"
[peer]
precision = "fp32"
verify_device = "cuda"
"""


@NO_CUDA
def test_a_coordinator_of_a_cuda_run_starts_and_refuses_to_judge(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The real coordinator: it serves the run (workers on CUDA may train it) and its
    referee is the refusing one; `covey coordinator --device` with a bad value is exit 2."""
    from covey.coordinator.service import Coordinator

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: a quick brown fox\n" for i in range(400)))
    spec = tmp_path / "run.toml"
    spec.write_text(CORPUS_SPEC.format(corpus=corpus))
    with caplog.at_level(logging.WARNING, logger="covey.coordinator"):
        coord = Coordinator(load_run_config(spec), tmp_path / "run")
    rc = coord.verification.referee_compute
    assert rc is not None and rc.refusal is not None and "device class cuda" in rc.refusal
    assert "will not judge disputes" in caplog.text
    result = CliRunner().invoke(app, ["coordinator", str(spec), "--device", "tpu"])
    assert result.exit_code == 2 and "'tpu'" in result.output


# -- the SWARM referee ---------------------------------------------------------------------------


def _signed_dispute(k: int = 0) -> tuple[dict, dict[str, str]]:
    """A dispute of two servers' signed replies that disagree, on one claimed state."""
    import base64

    from covey.swarm.wire import reply_message, sha
    from covey.trust.identity import Identity

    request, state = b"request bytes", "f" * 64
    replies, keys = [], {}
    for reply in (b"reply one", b"reply two"):
        ident = Identity.generate()
        keys[ident.peer_id] = ident.public_key
        sig = ident.sign(reply_message(k, state, sha(request), sha(reply)))
        replies.append(
            {"server": ident.peer_id, "state": state, "sig": sig,
             "reply": base64.b64encode(reply).decode()}
        )  # fmt: skip
    body = {"stage": k, "kind": "forward", "request": base64.b64encode(request).decode()}
    return {**body, "replies": replies}, keys


@NO_CUDA
def test_a_swarm_referee_without_the_class_convicts_nobody(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from covey.swarm.config import SwarmConfig
    from covey.swarm.referee import Referee

    with caplog.at_level(logging.WARNING, logger="covey.swarm.referee"):
        ref = Referee(SwarmConfig(verify_device="cuda"))
    assert "will not judge disputes: referee lacks device class cuda" in caplog.text
    body, keys = _signed_dispute()
    verdict = ref.settle(body, keys, providers=[])  # no state fetched: nothing recomputed
    assert verdict["liars"] == [] and verdict["honest"] == []
    assert verdict["detail"].startswith("not judged: referee lacks device class cuda")
    assert Referee(SwarmConfig()).compute.device == torch.device("cpu")  # the default class
    args = ["swarm", "coordinator", "--data-dir", "x", "--device", "tpu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "'tpu'" in result.output
