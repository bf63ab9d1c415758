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
    """The part of a local state that is published as a contribution's end state: the
    entries its next round depends on (`Strategy.carries_entry`): no parameters when
    `adopt` loads the round's start over them (a validator has it), no inner moments when
    the next round resets them. Nothing public or recomputable travels: DiLoCo's evidence
    is its kept inner moments and residuals, none at all for a strategy that carries no
    local state."""
    return {k: v for k, v in state.items() if strategy.carries_entry(k)}


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
