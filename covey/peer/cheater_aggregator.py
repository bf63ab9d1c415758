"""An aggregator that lies, for tests and benches: sharded aggregation's adversary.

`LyingAggregator` is the honest `covey.peer.aggregator.ShardAggregator` with its shard
computation overridden. It reads every input's byte ranges as the honest one does, so the
publish it signs names the true board and the true digest of what it read (else the
coordinator refuses it, covey.coordinator.sharding.ShardBoard.publish), and then publishes a
slightly wrong shard, by `mode`:

- "drop": the shard aggregated without one worker's payload (the first on the board), as an
  aggregator paid to leave a rival out would;
- "noise": small Gaussian noise added to a few coordinates of the honest shard (1 in 100,
  at least one; 1e-4 times the shard's own spread), a nudge no norm bound notices;
- None: honest (a test picks its liar after the board opens).

Only what it publishes is wrong: its checks of others' shards are honest, so the referee
convicts it for its own lies and nothing else -- unless `agree_blindly` is set: then, as
a lazy or colluding checker, it reports every shard it is drawn to check with the hash
its aggregator published (what a late check makes it pay for,
covey.coordinator.shard_audit). The honest aggregator imports nothing of this
(tests/test_layers.py).
"""

from __future__ import annotations

from typing import Any

import torch

from covey.algorithms.shards import shard_hash
from covey.algorithms.state import TrainState
from covey.peer.aggregator import ShardAggregator

MODES = ("drop", "noise")


def without_first_input(board: dict[str, Any]) -> dict[str, Any]:
    """The board with its first input (contribution, weight, norm) left out."""
    inputs = dict(board["inputs"])
    inputs["contributions"] = inputs["contributions"][1:]
    inputs["weights"] = inputs["weights"][1:]
    if inputs.get("norms") is not None:
        inputs["norms"] = inputs["norms"][1:]
    return {**board, "inputs": inputs}


def nudged(params: torch.Tensor, seed: int) -> torch.Tensor:
    """`params` with noise of 1e-4 of their spread on 1 in 100 coordinates (at least 1)."""
    g = torch.Generator().manual_seed(seed)
    n = params.numel()
    where = torch.randperm(n, generator=g)[: max(1, n // 100)]
    out = params.clone()
    spread = float(params.float().std()) if n > 1 else 1.0
    noise = torch.randn(len(where), generator=g) * 1e-4 * (spread or 1.0)
    out[where] += noise.to(out.dtype)
    return out


class LyingAggregator(ShardAggregator):
    """A `ShardAggregator` that publishes wrong shards while `mode` is set (see the module)."""

    def __init__(
        self, *args: Any, mode: str | None = None, agree_blindly: bool = False, **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self.agree_blindly = agree_blindly
        if mode is not None and mode not in MODES:
            raise ValueError(f"lying aggregator mode {mode!r} must be one of {MODES}")
        self.mode = mode
        self._publishing = False
        self._wrong: set[tuple[int, int]] = set()  # (round, shard) computed wrong
        self.lies = 0  # wrong shards the coordinator took (publishes accepted)

    def work(self, round: int, start_state: TrainState) -> list[str]:
        self._publishing = True  # `compute` is called for publishes and checks alike
        try:
            return super().work(round, start_state)
        finally:
            self._publishing = False

    def _post(self, round: int, action: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = super()._post(round, action, body)
        if action == "publish" and answer.get("ok") and (round, body["index"]) in self._wrong:
            self.lies += 1
        return answer

    def compute(
        self, board: dict[str, Any], index: int, start_state: TrainState
    ) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        honest = super().compute(board, index, start_state)
        me = board["shards"][index].get("aggregator") == self.identity.peer_id
        published = board["shards"][index].get("published")
        if self.agree_blindly and not me and published:  # a check: say what was published
            return honest[0], honest[1], published["hash"]
        if self.mode is None or (self._publishing and not me):
            return honest  # a check of another's shard: honest
        reads = self.last_reads  # what it signs it read: the true ranges
        p, m = honest[0], honest[1]
        if self.mode == "drop" and len(board["inputs"]["contributions"]) > 1:
            p, m, _ = super().compute(without_first_input(board), index, start_state)
        else:
            p = nudged(p, seed=board["round"] * 1009 + index)
        self.last_reads = reads
        self._wrong.add((board["round"], index))
        start = board["shards"][index]["start"]
        return p, m, shard_hash(board["round"], index, start, p, m)
