"""What a worker publishes of its local state for verification, its evidence: only what a
validator cannot recompute (docs/trust.md, "Verification off the critical path").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import BinaryIO, cast

import torch

from covey.algorithms.base import Strategy
from covey.algorithms.state import TrainState
from covey.trust.sketch import Commitment, commitment_of

LOCAL_STATE_FORMAT = "covey-local-state-1"


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
    worker's published end state with. Its hash is the published bytes' content id
    (`local_state_cid`, the end_state_cid a worker names): the end state is hashed once,
    and equal hashes mean the very bytes the worker named."""
    published = evidence_of(strategy, state)
    digest = local_state_cid(published)
    if not strategy.local_params_carried:
        published.update({f"param/{n}": t for n, t in start_state.params.items()})
    return commitment_of(published, start_state.params, steps, digest=digest)


def local_state_metadata() -> dict[str, str]:
    """The safetensors metadata of a local state on the wire (its format tag)."""
    return {"covey": json.dumps({"format": LOCAL_STATE_FORMAT}, sort_keys=True)}


def local_state_cid(state: Mapping[str, torch.Tensor]) -> str:
    """The content id of `verify.local_state_to_bytes(state)`, hashed tensor by tensor: the
    bytes are never held (a local state is 1.5 GB at 124M). A worker's end_state_cid is
    this of what it publishes (`evidence_of`; covey.peer.worker_train), and a validator's
    re-execution computes it of its own end state to tie the two without a fetch."""
    from covey.protocol.checkpoint import write_safetensors

    cid, _ = write_safetensors(state, local_state_metadata(), cast(BinaryIO, _Discard()))
    return cid


class _Discard:
    """A sink that keeps nothing: write_safetensors only hashes through it."""

    def write(self, piece: bytes | memoryview) -> int:
        return len(piece)
