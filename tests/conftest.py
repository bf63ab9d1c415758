from __future__ import annotations

import os
import shutil

import pytest
import torch

from covey.data.corpus import Corpus, load_corpus
from covey.models.gpt import GPT, GPTConfig

TINY = GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    """A small random byte stream: fast, and enough to take real gradient steps on."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (50_000,), generator=g, dtype=torch.uint8)


@pytest.fixture(scope="session")
def stdlib_corpus() -> Corpus:
    return load_corpus()


@pytest.fixture(scope="session")
def testbed_support() -> None:
    """Network namespaces + tc usable here; else skip, except under CI as root with ip/tc,
    where a missing testbed is a failure (the netns tests must not silently vanish)."""
    from covey.bench import netns

    reason = netns.check_support()
    if reason is None:
        return
    forced = (
        os.environ.get("CI")
        and hasattr(os, "geteuid")
        and os.geteuid() == 0
        and shutil.which("ip")
        and shutil.which("tc")
    )
    if forced:
        pytest.fail(f"CI is set and we are root with ip/tc, yet no testbed: {reason}")
    pytest.skip(f"needs root and iproute2: {reason}")


@pytest.fixture(scope="session")
def postgres():  # type: ignore[no-untyped-def]
    """One real PostgreSQL server for the session (tests/services.py); call
    `postgres.database()` for a new empty database's URL."""
    try:
        from tests.services import Postgres

        server = Postgres()
    except Exception as e:  # any reason it cannot start here is the skip's
        pytest.skip(f"no PostgreSQL here (pip install pgserver 'psycopg[binary]'): {e}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One real S3-compatible HTTP server (moto's, its own process on 127.0.0.1) for the
    session; `s3.bucket()` makes a new bucket, `s3.env` is what a client needs."""
    try:
        from tests.services import S3Server

        server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log")
    except Exception as e:  # any reason it cannot start here is the skip's
        pytest.skip(f"no S3-compatible server here (pip install 'moto[server]' boto3): {e}")
    yield server
    server.stop()
