from __future__ import annotations

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
