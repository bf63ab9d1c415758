"""Batches as a pure function of (seed, round, worker, step).

Verification re-executes a worker's contribution from the round's start weights, so the
data a worker trains on must be recomputable anywhere, bit for bit. Window offsets come
from BLAKE2b over the arguments (no RNG library whose stream could change between
versions), and the tokens are gathered from the corpus by plain indexing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from covey.data.corpus import Corpus

if TYPE_CHECKING:
    from covey.config import RunConfig


def window_offsets(
    n_tokens: int, window: int, count: int, *, seed: int, round: int, worker: int | str, step: int
) -> torch.Tensor:
    """`count` start offsets in [0, n_tokens - window], identical on every machine."""
    span = n_tokens - window + 1
    if span <= 0:
        raise ValueError(f"corpus split has {n_tokens} tokens, fewer than one window ({window})")
    key = f"covey-batch/{seed}/{round}/{worker}/{step}".encode()
    offsets = []
    counter = 0
    while len(offsets) < count:
        digest = hashlib.blake2b(key + counter.to_bytes(4, "little"), digest_size=64).digest()
        for i in range(0, 64, 8):
            offsets.append(int.from_bytes(digest[i : i + 8], "little") % span)
        counter += 1
    return torch.tensor(offsets[:count], dtype=torch.int64)


def sample_batch(
    tokens: torch.Tensor,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    round: int,
    worker: int | str,
    step: int,
) -> torch.Tensor:
    """A (batch_size, seq_len + 1) int64 batch of windows: inputs are [:, :-1], targets [:, 1:]."""
    offsets = window_offsets(
        len(tokens), seq_len + 1, batch_size, seed=seed, round=round, worker=worker, step=step
    )
    index = offsets[:, None] + torch.arange(seq_len + 1)[None, :]
    return tokens[index].long()


def validation_batches(
    corpus: Corpus, *, n_batches: int, batch_size: int, seq_len: int
) -> list[torch.Tensor]:
    """A fixed set of held-out batches; the same for every method, worker and run."""
    return [
        sample_batch(
            corpus.val,
            batch_size=batch_size,
            seq_len=seq_len,
            seed=0,
            round=0,
            worker="validation",
            step=i,
        )
        for i in range(n_batches)
    ]


def step_seed(*, seed: int, round: int, worker: int | str, step: int) -> int:
    """The 63-bit seed of one inner step's randomness (dropout), a pure function of the
    same (seed, round, worker, step) as its batch: a validator re-executing the round, or a
    referee recomputing one segment from step k, draws exactly the worker's masks for every
    step without replaying the steps before it. Host-side integer math, no tensor read."""
    key = f"covey-step-rng/{seed}/{round}/{worker}/{step}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True, eq=False)
class AssignmentBatches:
    """Inner step -> batch of one assignment (callable), and `step_seed(step)`, the seed of
    that step's randomness: both pure functions of (run seed, round, data key, step), so
    that a validator or a referee sees exactly the worker's data and dropout masks."""

    cfg: RunConfig
    corpus: Corpus
    seq_len: int
    round: int
    data_key: str

    def __call__(self, step: int) -> torch.Tensor:
        return sample_batch(
            self.corpus.train,
            batch_size=self.cfg.data.batch_size,
            seq_len=self.seq_len,
            seed=self.cfg.seed,
            round=self._round,
            worker=self.data_key,
            step=step,
        )

    def step_seed(self, step: int) -> int:
        return step_seed(seed=self.cfg.seed, round=self._round, worker=self.data_key, step=step)

    @property
    def _round(self) -> int:
        return self.round + self.cfg.data.round_offset  # past a warm start's batches


def assignment_batches(
    cfg: RunConfig, corpus: Corpus, seq_len: int, round: int, data_key: str
) -> AssignmentBatches:
    """Inner step -> batch of an assignment (with its steps' seeds: `AssignmentBatches`)."""
    return AssignmentBatches(cfg, corpus, seq_len, round, data_key)
