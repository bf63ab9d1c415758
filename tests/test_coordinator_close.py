"""A round's close (covey.coordinator.rounds._next_state) consumes the current state's
tensors (one model size in memory), the state's blob standing in for it meanwhile: whatever fails, a
store write or the outer step half way, or the process itself, the coordinator goes on
from a usable current state, and every committed state is the one a peer computes with
`apply_round` from the round's start blob; the evaluator, on the weights it borrowed,
gives each state's loss as a loaded copy does. Every method, an in-process coordinator
driven by hand, contributions submitted as a worker submits them."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from covey.algorithms import Contribution, TrainState
from covey.algorithms.evaluate import evaluate
from covey.config import load_run_config
from covey.coordinator.service import Coordinator
from covey.protocol.checkpoint import state_from_file
from covey.protocol.content import content_id
from tests.test_evidence import Peer

SPEC = """
name = "close"
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
{algorithm}
[rounds]
min_peers = 2
deadline_min_s = 600
deadline_max_s = 600
dead_after_s = 600
heartbeat_s = 60
lease_s = 600
eval_every = 1
checkpoint_every = 100000
eval_batches = 1
[trust]
new_peer_contributions = 0
sample_rate = 0.0
"""
METHODS = {
    "diloco": 'method = "diloco"\ninner_steps = 4\nouter_momentum = 0.9',
    "streaming": 'method = "streaming"\ninner_steps = 4\nfragments = 2',
    "ddp": 'method = "ddp"',
    "demo": 'method = "demo"',
}


class Worker(Peer):
    """Submits a random update of the round's fragment, continuing its local-state chain
    where the method carries one."""

    start: str | None = None

    def end_state(self) -> bytes:
        n = self.coord.rounds.evidence_size  # a published end state's size
        seed = f"{self.id}/{self.coord.state.round}".encode()
        return (seed * (n // len(seed) + 1))[:n]

    def payload(self, k: int) -> bytes:
        rounds, r = self.coord.rounds, self.coord.state.round
        names = rounds.strategy.fragment_names(rounds.strategy.round_fragment(r))
        numel = sum(rounds.template.params[n].numel() for n in names)
        g = torch.Generator().manual_seed(int(self.id[:6], 16) + 1000 * r + k)
        return rounds.strategy.codec.encode(torch.randn(numel, generator=g) * 1e-3)

    def work(self) -> None:
        strategy = self.coord.rounds.strategy
        fragment = strategy.round_fragment(self.coord.state.round)
        body: dict[str, Any] = {"tokens": 10, "fragment": fragment}
        if strategy.carries_local_state:
            out = self.submit(0, self.start, **body)
            self.start = content_id(self.end_state())
        else:
            out = self.submit(0, end_state_cid=None, end_state_size=None, **body)
        assert isinstance(out, dict), out


def peers_new_state(coord: Coordinator, start_cid: str, round_: int) -> str:
    """What a peer computes: apply_round on the start blob and the round's contributions."""
    rows = coord.db.query(
        "SELECT c.* FROM contributions c JOIN rounds r ON r.round = c.round AND "
        "r.attempt = c.attempt WHERE c.round = ? ORDER BY c.peer_id",
        (round_,),
    )
    start = state_from_file(coord.blobs.path(start_cid), coord.rounds.template)
    got = [Contribution(coord.blobs.get(r["cid"]), r["tokens"], r["inner_steps"], r["fragment"])
           for r in rows]  # fmt: skip
    return coord.rounds.strategy.apply_round(start, got).digest()


@pytest.mark.parametrize("method", list(METHODS))
def test_a_failed_or_killed_close_leaves_a_usable_state(tmp_path: Path, method: str) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(algorithm=METHODS[method]))

    def start() -> Coordinator:
        coord = Coordinator(load_run_config(spec), tmp_path / "data")
        # the evaluator only: the test is the round driver
        coord.rounds.evaluator.start()
        return coord

    coord = start()
    workers = [Worker(coord, "a"), Worker(coord, "b")]
    try:
        for r in range(5):
            coord.tick(time.time())
            assert (rnd := coord.open_round()) is not None and rnd.round == r
            start_cid, start_hash = coord.state_cid, coord.state_hash
            for w in workers:
                w.work()
            rounds = coord.rounds
            if r == 1:  # the store write fails (a full disk)
                real_store = rounds._store_state

                def full(state: TrainState) -> tuple[str, int]:
                    raise OSError("no space left on device")

                rounds._store_state = full  # type: ignore[method-assign]
                with pytest.raises(OSError):
                    coord.tick(time.time())
                rounds._store_state = real_store  # type: ignore[method-assign]
            if r in (2, 3):  # the outer step dies half way through the start's tensors
                real_step = rounds.strategy.apply_round_consuming

                def dying(start: TrainState, contributions: Any) -> TrainState:
                    for d in (start.params, start.outer):
                        for name in list(d)[: len(d) // 2]:
                            del d[name]
                    raise RuntimeError("out of memory")

                rounds.strategy.apply_round_consuming = dying  # type: ignore[method-assign]
                with pytest.raises(RuntimeError):
                    coord.tick(time.time())
                rounds.strategy.apply_round_consuming = real_step  # type: ignore[method-assign]
            if r == 3:  # and then the process (as a SIGKILL: nothing runs after)
                coord.stop()
                coord = start()
                for w in workers:
                    w.coord = coord
            assert coord.state.round == r and coord.state_hash == start_hash
            assert coord.state.digest() == start_hash, "the current state is not its blob"
            want = peers_new_state(coord, start_cid, r)
            coord.tick(time.time())  # the close, retried
            assert coord.state.round == r + 1 and coord.state_hash == want, r
            assert coord.state.digest() == want
        deadline = time.time() + 60
        while coord.db.one("SELECT 1 FROM rounds WHERE val_loss IS NULL") is not None:
            assert time.time() < deadline, "the evaluator did not evaluate every round"
            time.sleep(0.1)
        model = copy.deepcopy(coord.rounds.strategy.model)
        for row in coord.db.query("SELECT round, new_cid, val_loss FROM rounds ORDER BY round"):
            state = state_from_file(coord.blobs.path(row["new_cid"]), coord.rounds.template)
            loss = evaluate(model, state, coord.rounds.evaluator._val, coord.rounds.loss_fn)
            assert row["val_loss"] == loss, row["round"]
    finally:
        coord.stop()
