"""What a worker publishes of its local state for verification, its evidence: only what a
validator cannot recompute (docs/trust.md, "Verification off the critical path").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from covey.algorithms.base import Strategy
from covey.algorithms.state import TrainState
from covey.trust.sketch import Commitment, commitment_of


def evidence_of(strategy: Strategy, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The part of a local state that is published as a contribution's end state: all of
    it, or without the parameters when the strategy does not carry them into its next round
    (`Strategy.local_params_carried`: the round's start stands in for them, and a validator
    has it). Nothing public or recomputable travels: DiLoCo's evidence is its inner moments
    and residuals, none at all for a strategy that carries no local state."""
    if strategy.local_params_carried:
        return dict(state)
    return {k: v for k, v in state.items() if not k.startswith("param/")}


def evidence_commitment(
    strategy: Strategy,
    state: Mapping[str, torch.Tensor],
    start_state: TrainState,
    steps: int,
) -> Commitment:
    """The commitment to a round's end state as it is published (`evidence_of`), the
    parameters it leaves out standing at the round's start: what a validator compares a
    worker's published end state with."""
    published = evidence_of(strategy, state)
    if not strategy.local_params_carried:
        published.update({f"param/{n}": t for n, t in start_state.params.items()})
    return commitment_of(published, start_state.params, steps)
