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

from covey.data.corpus import load_corpus
from covey.swarm.config import SwarmConfig
from covey.swarm.trainer import SwarmTrainer, training_tokens

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
