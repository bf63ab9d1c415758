"""A tiny served model (a 2-layer GPT-2 over a byte-level BPE trained in the test, random
weights, nothing downloaded) and the processes of a serving run on 127.0.0.1."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from covey.io.deposit import fund_key
from tests.rl_helpers import ROOT, free_port, stop, wait_for
from tests.tiny_hf import tiny_gpt2, tiny_tokenizer
from tests.treasury_helpers import fund

_MADE: dict[int, Path] = {}  # seed -> the first folder made in this process


def tiny_served_model(directory: Path, seed: int = 0) -> Path:
    """An exported-style folder: config.json, model.safetensors, tokenizer files. Made once
    per seed and process (training the tokenizer takes seconds); later calls copy it."""
    made = _MADE.get(seed)
    if made is not None and (made / "model.safetensors").is_file():
        shutil.copytree(made, directory, dirs_exist_ok=True)
        return directory
    _MADE[seed] = directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tiny_tokenizer(directory)
    from covey.data.tokenizer import HFTokenizer

    vocab = HFTokenizer(tok).vocab_size
    tiny_gpt2(directory, vocab_size=vocab, positions=128)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(directory)))
    model.config.eos_token_id = model.config.bos_token_id = HFTokenizer(tok).eos_id
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def start(cmd: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "covey", *cmd], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )


@contextlib.contextmanager
def server_process(
    tmp: Path, model: Path, sets: tuple[str, ...] = (), extra: tuple[str, ...] = ()
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`covey serve server` on a free port; `sets`: --set values, `extra`: more options."""
    port = free_port()
    cmd = ["serve", "server", "--data-dir", str(tmp / "server"), "--model", str(model)]
    cmd += ["--port", str(port), *extra]
    for s in sets:
        cmd += ["--set", s]
    log = tmp / "server.log"
    proc = start(cmd, log)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, f"server exited {proc.returncode}: {log.read_text()[-3000:]}"
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 90, "the server to serve")
        yield url, proc
    finally:
        stop(proc)


def funded(service: Any, peer: Any) -> Any:
    """An in-process worker or validator of `service`'s run, its stake deposited to its
    key by the run's owner first (a key bonds only credits it holds)."""
    fund(service, peer.identity.public_key, peer.stake)
    return peer


def peer_process(
    tmp: Path,
    url: str,
    model: Path,
    role: str,
    name: str,
    behavior: str = "honest",
    extra: tuple[str, ...] = (),
) -> subprocess.Popen:
    """`covey serve worker|validator` of the server_process at `url` (data dir
    tmp/server), under its own key, funded by the server's key with the 10 credits a
    peer stakes by default; with `--house-of` in `extra`, under the house keys it
    derives and funds itself."""
    cmd = ["serve", role, "--server", url, "--model", str(model), "--name", name, *extra]
    if "--house-of" not in extra:
        key = tmp / f"{name}.key"
        fund_key(url, tmp / "server" / "coordinator.key", key, 10.0)
        cmd += ["--identity", str(key)]
    if role == "worker":
        cmd += ["--behavior", behavior]
    return start(cmd, tmp / f"{name}.log")
