"""What a run fixes about compute (covey.devices.plan_run_compute, covey.spec.fix_run_compute):
a default spec verifies and trains on CUDA in bf16 on a machine with a GPU and on the CPU in
fp32 elsewhere; the class is fixed when the spec is loaded, so every peer reads the same.
Whether a GPU is there is an argument of the pure functions: "a GPU" is faked only there."""

from __future__ import annotations

from pathlib import Path

import torch

from covey.config import RunConfig, run_id_of
from covey.config.specs import load_run_config
from covey.devices import (
    RunCompute,
    peer_compute_line,
    plan_run_compute,
    referee_compute,
    verification_mismatch,
)
from covey.spec import fix_run_compute, load_spec


def test_a_default_run_uses_the_gpu_where_there_is_one() -> None:
    peer = RunConfig().peer
    assert peer.verify_device == "auto" and peer.precision == "auto" and not peer.compile
    gpu = plan_run_compute(peer.verify_device, peer.precision, peer.compile, cuda=True)
    cpu = plan_run_compute(peer.verify_device, peer.precision, peer.compile, cuda=False)
    assert gpu == RunCompute("cuda", "bf16", False)
    assert cpu == RunCompute("cpu", "fp32", False)


def test_what_a_spec_names_is_kept() -> None:
    assert plan_run_compute("cpu", "auto", True, cuda=True) == RunCompute("cpu", "fp32", True)
    assert plan_run_compute("cuda", "fp32", False, cuda=False) == RunCompute("cuda", "fp32", False)
    assert plan_run_compute("auto", "fp32", True, cuda=True) == RunCompute("cuda", "fp32", True)


def test_loading_fixes_the_class_into_the_spec_and_its_run_id(tmp_path: Path) -> None:
    auto = RunConfig()
    on_gpu, on_cpu = fix_run_compute(auto, cuda=True), fix_run_compute(auto, cuda=False)
    assert on_gpu.peer.verify_device == "cuda" and on_cpu.peer.verify_device == "cpu"
    assert fix_run_compute(on_gpu, cuda=False) == on_gpu  # fixed once, never again
    # a CPU machine's default spec hashes as the default did before "auto" existed
    assert (
        run_id_of(on_cpu, "ab" * 32) == run_id_of(auto, "ab" * 32) != run_id_of(on_gpu, "ab" * 32)
    )
    spec = tmp_path / "run.toml"
    spec.write_text("[model]\nsize = 'nano'\n")
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert load_spec(load_run_config, spec).peer.verify_device == here
    spec.write_text("[peer]\nverify_device = 'cuda'\n")
    assert load_spec(load_run_config, spec).peer.verify_device == "cuda"


def test_auto_left_in_a_spec_resolves_alike_in_every_check() -> None:
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert (
        verification_mismatch(
            "auto", "fp32" if here == "cpu" else "bf16", here, "fp32" if here == "cpu" else "bf16"
        )
        is None
    )
    ref = referee_compute("auto", "auto")
    assert ref.refusal is None and ref.device is not None and ref.device.type == here


def test_every_peer_says_what_it_uses() -> None:
    run = plan_run_compute("auto", "auto", True, cuda=False)
    line = peer_compute_line("worker", torch.device("cpu"), "fp32", run)
    assert (
        line
        == "worker computes on cpu in fp32, compiled; the run verifies on cpu in fp32, compiled"
    )
