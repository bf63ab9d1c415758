"""A SWARM trainer reads the data files the run's spec names and sends them, as token ids,
to stage 0's servers. Found as an attacker: a coordinator could name any file the trainer's
user can read (`data_paths = ["/home/me/.ssh/id_ed25519"]`) and receive it. Now the spec
carries the fingerprint of its data's corpus, filled in where the spec is made, and a
trainer sends nothing from files whose corpus has another fingerprint. A coordinator that
names a file gets nothing unless it knew the file's contents already."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from covey.cli import app
from covey.data.corpus import load_corpus
from covey.swarm.config import SwarmConfig
from covey.swarm.trainer import SwarmTrainer, training_tokens
from tests.tiny_hf import tiny_llama

pytestmark = pytest.mark.network


class FakeCoordinator:
    """A dishonest coordinator on 127.0.0.1: serves `spec` and records every request."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                outer.requests.append(f"{self.command} {self.path}")
                body = json.dumps({"run_id": "0" * 16, "spec": spec}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    f = tmp_path / "id_ed25519"
    f.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n" * 40)
    return f


@pytest.fixture
def evil(request: pytest.FixtureRequest, secret: Path) -> Iterator[FakeCoordinator]:
    spec = SwarmConfig().model_dump(mode="json") | {"data_paths": [str(secret)]}
    spec |= {"data_fingerprint": request.param}
    fake = FakeCoordinator(spec)
    yield fake
    fake.close()


@pytest.mark.parametrize("evil", ["", "0123456789abcdef"], indirect=True, ids=["none", "made-up"])
def test_a_coordinator_cannot_have_a_trainer_send_a_file_it_names(evil: FakeCoordinator) -> None:
    with pytest.raises(ValueError, match="sends only the data the run's spec was made with"):
        SwarmTrainer(evil.url, name="victim")
    assert evil.requests == ["GET /v1/swarm/spec"]  # nothing sent, nothing joined
    # the command line says why in one line
    result = CliRunner().invoke(
        app, ["swarm", "trainer", "--coordinator", evil.url, "--seconds", "1"]
    )
    assert result.exit_code == 2 and "error: the run's data_paths" in result.output


def test_the_spec_names_its_datas_fingerprint_and_a_trainer_checks_its_copy(
    tmp_path: Path, secret: Path
) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    cfg = SwarmConfig(data_paths=(str(data),))
    assert cfg.data_fingerprint == load_corpus([str(data)]).fingerprint
    assert training_tokens(cfg).equal(load_corpus([str(data)]).train)
    # peers receive it filled in, and fill in nothing themselves
    received = SwarmConfig.received(cfg.model_dump(mode="json"))
    assert received == cfg and received.run_id == cfg.run_id
    blank = SwarmConfig.received(cfg.model_dump(mode="json") | {"data_fingerprint": ""})
    assert blank.data_fingerprint == ""
    # the fingerprint is part of the run id; a run on the stdlib keeps its old id
    other = tmp_path / "other.txt"
    other.write_text("pack my box with five dozen liquor jugs\n" * 200)
    assert SwarmConfig(data_paths=(str(other),)).run_id != cfg.run_id
    assert "data_fingerprint" not in SwarmConfig().model_dump_json(exclude_defaults=True)
    # this machine's copy differs by one byte: refused before anything is sent
    data.write_text(data.read_text() + ".")
    with pytest.raises(ValueError, match=f"the run names {cfg.data_fingerprint}"):
        training_tokens(cfg)


def test_a_received_hf_model_or_tokenizer_without_its_digest_is_refused(tmp_path: Path) -> None:
    """A hole once open: a spec received with an hf: tokenizer or model and an empty
    digest matched anything, so a coordinator could name a private directory; a trainer
    then tokenized with its tokenizer.json (the vocabulary read out through the token
    ids), a server loaded its weights and published them as its stage state."""
    private = tiny_llama(tmp_path / "private-model")
    (private / "tokenizer.json").write_text('{"not": "known to the coordinator"}')
    with pytest.raises(ValueError, match="without its tokenizer_digest"):
        SwarmConfig.received({"tokenizer": f"hf:{private}"})
    with pytest.raises(ValueError, match="without its model_digest"):
        SwarmConfig.received({"model": f"hf:{private}", "tokenizer": "bytes"})


def test_the_model_digest_covers_the_weights(tmp_path: Path) -> None:
    """Same architecture, other weights: another digest, and a server refuses to build a
    stage from them (they would be published as its stage state)."""
    from safetensors.torch import save_file

    from covey.swarm.hfmodel import build_hf_stage

    run = tiny_llama(tmp_path / "run")
    cfg = SwarmConfig(model=f"hf:{run}", tokenizer="bytes")
    seeded = cfg.model_digest  # no weights: the config alone, as before weights counted
    mine = tiny_llama(tmp_path / "mine")
    emb = {"model.embed_tokens.weight": torch.zeros(320, 64)}
    save_file(emb, str(run / "model.safetensors"))
    save_file({k: v + 1 for k, v in emb.items()}, str(mine / "model.safetensors"))
    cfg = SwarmConfig(model=f"hf:{run}", tokenizer="bytes")
    assert cfg.model_digest != seeded
    assert SwarmConfig(model=f"hf:{mine}", tokenizer="bytes").model_digest != cfg.model_digest
    with pytest.raises(ValueError, match="the run names"):
        build_hf_stage(cfg.model_copy(update={"model": f"hf:{mine}"}), 0)
