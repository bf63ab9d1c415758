"""Streaming DiLoCo's overlap in the worker loop (arXiv 2501.18512; the pieces are in
covey.peer.overlap): round r+1's first tau steps train while round r's transfer runs, the
result is merged before step tau, and steps trained ahead that cannot stand are dropped.
Mixed into covey.peer.worker.Worker, whose attributes and round methods it uses.
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from typing import Any

from covey.algorithms import TrainState
from covey.algorithms.tensors import host_sum
from covey.peer.client import CoordinatorLost
from covey.peer.lease import LeaseLapsed
from covey.peer.overlap import SideCommitter, Transfer, TransferTimeout, speculation_fails
from covey.peer.worker_types import Finished, LocalStates, Stopped
from covey.protocol import schemas
from covey.protocol.rounds import data_key

log = logging.getLogger("covey.worker")


class Overlapping:
    """The overlap half of a worker (see the module docstring)."""

    # set by Worker
    state: TrainState | None
    state_hash: str | None
    _transfer: Transfer[Finished] | None
    _train_ended: float | None
    _waited_s: float
    _local: LocalStates | None
    _chain: LocalStates | None
    _trained_since_adopt: bool
    name: str
    opts: Any
    strategy: Any
    leader: Any
    rounds_done: int
    heartbeat_s: float

    def _overlaps(self) -> bool:
        """Whether the next round's first tau steps train while this round's bytes move:
        Streaming DiLoCo with tau > 0, a single-process peer with rounds to go."""
        last = self.opts.max_rounds and self.rounds_done + 1 >= self.opts.max_rounds
        return bool(
            self.strategy.overlap_steps > 0
            and hasattr(self.strategy, "merge_late")
            and self._local is not None
            and self.leader is None
            and not last
        )

    def _overlapped_round(self) -> str:
        """Round r+1 while round r's transfer runs (Streaming DiLoCo, arXiv 2501.18512):
        its first tau steps train from round r's end state on round r+1's data key, round
        r's weights are merged before step tau, the rest trains as usual. Steps trained
        ahead that cannot stand (covey.peer.overlap.speculation_fails) are discarded and
        the round starts over from its committed start."""
        transfer = self._transfer
        assert transfer is not None and self._train_ended is not None
        started = self._train_ended
        prev = self._local
        assert prev is not None
        nxt = prev.round + 1
        assigned = data_key(self.run_id, nxt, self.peer_id)  # what round nxt will assign
        key = self._data_key_ahead(nxt, assigned)
        tau = self.strategy.overlap_steps
        committer = SideCommitter(self.strategy, None, self.cfg.trust.commit_every)
        self._trained_since_adopt = True
        compute_s = 0.0
        losses: list[Any] = []  # tensors on the device: read once, after the steps
        try:
            for step in range(tau):
                self._check_standing()
                loss, seconds = self._timed_step(
                    self.strategy.inner_step,
                    partial(self._batch, nxt, key, step),
                    self._step_seed(nxt, key, step),
                )
                losses.append(loss)
                compute_s += seconds
                committer.after_step(step + 1)
        except LeaseLapsed:  # round r still finishes (or fails) first; a signal leaves it
            self._settle(self._await_transfer(transfer), adopt=False)
            raise
        loss_sum = host_sum(losses)
        waited = time.monotonic()
        f = self._await_transfer(transfer)
        self._waited_s = time.monotonic() - waited
        if self._settle(f, adopt=False) == "aborted":
            return "aborted"
        why = "no next round"
        if f.next_info is not None:
            why = speculation_fails(
                f.next_info,
                round_=nxt,
                data_key=assigned,
                state_hash=self.state_hash or "",
                steps_ahead=tau,
                chained=self._chain is prev,
            )
        if why:
            log.info(
                "[%s - round %d] %d steps trained ahead discarded: %s", self.name, nxt, tau, why
            )
            return "done"
        info, chain = f.next_info, self._chain
        assert info is not None and chain is not None and self.state is not None
        self.strategy.merge_late(self.state, chain.accepted)  # before step tau, as simulated
        self._local = LocalStates(chain.end_cid, round=nxt)
        committer.start(self.state, self._start_digest(info.start_hash))
        deadline = time.monotonic() + (info.deadline_in_s or 0.0)
        return self._train_and_finish(
            info, deadline, started, committer, (tau, compute_s, loss_sum)
        )

    def _data_key_ahead(self, round_: int, assigned: str) -> str:
        """The data key round `round_`'s steps trained ahead use, `assigned` being the one
        its assignment will name: that one. (The training that follows takes its key from
        `_work`; a house worker's canary round trains on other data from its first step,
        covey.peer.house.)"""
        return assigned

    def _await_transfer(self, transfer: Transfer[Finished]) -> Finished:
        """The transfer's outcome (its exception re-raised). Every wait inside it is bounded
        (request timeouts, the certificate's deadline plus coordinator_lost_s); this waits
        their sum with room to spare, then CoordinatorLost: never a hang."""
        limits = self.cfg.limits
        limit = 3 * limits.coordinator_lost_s + 4 * limits.request_timeout_s + 600.0
        try:
            return transfer.result(limit, self.stop)
        except TransferTimeout as e:
            if self.stop.is_set():
                raise Stopped() from None
            raise CoordinatorLost(str(e)) from None
        finally:
            self._transfer = None

    def _next_round_info(self, after: int) -> schemas.RoundInfo:
        """The round after `after` once it is open (or the run is finished or halted), at
        most a few heartbeats: then whatever /v1/round says (the steps ahead are dropped)."""
        give_up = time.monotonic() + 2 * self.heartbeat_s
        info = self._round_view()
        while True:
            if info.phase in ("finished", "halted") or (
                info.phase == "open" and info.round > after
            ):
                return info
            left = give_up - time.monotonic()
            if left <= 0:
                return info
            if not info.tag:  # a coordinator without the round long-poll
                self._pause(0.05)
            info = self._round_view(info.tag, left)  # held until the view changes

    def _note_round(self, round_: int, compute_s: float, wall_s: float, ahead: int) -> None:
        """The worker's own utilization: compute seconds over wall seconds from the end of
        its previous round's training (or from seeing the round) to the end of this one's;
        logged and appended to <store>/rounds.jsonl."""
        waited, self._waited_s = self._waited_s, 0.0
        util = compute_s / wall_s if wall_s > 0 else 1.0
        log.info(
            "[%s - round %d] compute %.2f s of %.2f s wall (%.0f%%), %d steps ahead, waited "
            "%.2f s for the network",
            self.name, round_, compute_s, wall_s, 100 * util, ahead, waited,
        )  # fmt: skip
        line = {"round": round_, "compute_s": compute_s, "wall_s": wall_s, "ahead": ahead,
                "waited_s": waited, "ended_at": time.time()}  # fmt: skip
        with open(self.store_dir / "rounds.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
