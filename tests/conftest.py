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
