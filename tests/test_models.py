"""The reference GPT: named sizes have the parameter counts the docs state."""

from __future__ import annotations

import math

import pytest
import torch

from covey.models.gpt import GPT, gpt_config, lm_loss


@pytest.mark.parametrize(
    ("size", "millions"),
    [("nano", 0.121), ("micro", 1.04), ("mini", 10.8), ("small", 48.3), ("gpt2", 124.5)],
)
def test_named_sizes(size: str, millions: float) -> None:
    with torch.device("meta"):  # no memory: only shapes
        model = GPT(gpt_config(size))
    assert model.num_parameters() / 1e6 == pytest.approx(millions, rel=0.01)


def test_unknown_size_and_long_input_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        gpt_config("huge")
    model = GPT(gpt_config("nano"))
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_loss_starts_near_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_config("nano"))
    batch = torch.randint(0, 256, (4, 65))
    assert float(lm_loss(model, batch).detach()) == pytest.approx(math.log(256), abs=0.1)
