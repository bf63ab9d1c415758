"""A peer made of many devices: a `torchrun` group that is one peer.

As in INTELLECT-1, parallelism inside a peer is the peer's business and covey sits between
peers: the group trains with DistributedDataParallel (NCCL on GPUs, gloo on CPUs), or with
FSDP2 (`mode="fsdp"`, covey/peer/fsdp.py: sharded gradients and optimizer moments), and only
rank 0, the leader, talks to the coordinator. It has the peer's one identity, publishes the
peer's one contribution and applies certified rounds; the other ranks follow it over the
group's own collectives and never open a connection.

The protocol is a command tensor that the leader broadcasts and every rank acts on:

    BEGIN      the leader's local state (parameters, optimizer state, residuals) is
               broadcast; every rank loads it, so all start the round identical
    STEP B T   the leader's (B, T) batch is broadcast; each rank trains on its rows
               (rank, rank + world, ...) and DDP averages the gradients: every rank takes
               the same optimizer step, the step a single device takes on the whole batch
    SKETCH K   (fsdp) each rank sketches its shards of the state into K buckets and the
               partial sketches are all-gathered; the leader sums them in rank order into
               the commitment (`Leader.commitment`): nothing whole is gathered
    GATHER     (fsdp) the shards are gathered into the leader's strategy: at the round's end
    END        the ranks' token counts are summed into the leader's (one contribution)
    STOP       followers return

Commands and tensors travel only inside the group (its own process group, set up by
torchrun on the same machine or cluster); nothing is pickled.

A rank that dies does not hang the group: every collective has a deadline (the process
group's timeout, `GROUP_TIMEOUT_S`; a SIGKILLed rank's closed connections fail sooner),
and a failed collective raises `GroupLost` naming the lost rank(s), found by their
heartbeats in the group's store (each follower bumps a counter every `BEAT_S`). The leader
then leaves the run without a contribution (the worker exits 1 after its deathrattle): the
coordinator sees a no-show, never a contribution of part of a group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from covey.algorithms.base import Strategy
from covey.algorithms.state import TrainState
from covey.devices import resolve_device
from covey.models.randomness import active_dropout, dropout_fields
from covey.peer.fsdp import MODES, ShardedReplica
from covey.trust.committer import Committer
from covey.trust.sketch import (
    BUCKETS,
    NO_HASH,
    Commitment,
    commitment_from_sketches,
    commitment_of,
)

BEGIN, STEP, END, STOP, GATHER, SKETCH = 1, 2, 3, 4, 5, 6
_NAMES = {
    BEGIN: "BEGIN",
    STEP: "STEP",
    END: "END",
    STOP: "STOP",
    GATHER: "GATHER",
    SKETCH: "SKETCH",
}
GROUP_TIMEOUT_S = 120.0  # a collective waits this long for a rank that is alive but stuck
BEAT_S = 1.0  # a follower bumps its heartbeat counter this often
LOST_AFTER_S = 8.0  # a rank whose counter did not move for this long is lost
log = logging.getLogger("covey.peer.group")


class GroupLost(RuntimeError):
    """A rank of the group died or stopped answering: the group cannot finish its round."""


@dataclass(frozen=True)
class Group:
    """This process's place in a torchrun group."""

    rank: int
    world: int
    device: torch.device

    @property
    def leader(self) -> bool:
        return self.rank == 0


def group_from_env(device: str = "auto", timeout_s: float = GROUP_TIMEOUT_S) -> Group | None:
    """The group torchrun started this process in (WORLD_SIZE > 1), its process group
    initialized: NCCL with one GPU per local rank on CUDA, gloo on the CPU, every
    collective bounded by `timeout_s`; a follower starts its heartbeat. None when not
    under torchrun (a one-device peer). ValueError for a group on CUDA with more local
    ranks than GPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    where = resolve_device(device)
    if where.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local} has no GPU: {torch.cuda.device_count()} visible; start "
                f"torchrun with --nproc-per-node <= the GPU count"
            )
        where = torch.device("cuda", local)
        torch.cuda.set_device(where)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if where.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s)
        )
    if rank > 0:
        _start_heartbeat(rank)
    return Group(rank, world, where)


# -- liveness: heartbeats in the group's store -------------------------------------------------


def _store() -> dist.TCPStore:
    """A client of the store torchrun (or rank 0) serves at MASTER_ADDR:MASTER_PORT: it
    outlives any follower, so the leader can read who stopped beating."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=10),
    )


def _beat_key(rank: int) -> str:
    return f"covey/group/beat/{rank}"


def _start_heartbeat(rank: int) -> None:
    def beat() -> None:
        try:
            store = _store()
            while True:
                store.add(_beat_key(rank), 1)
                time.sleep(BEAT_S)
        except Exception as e:  # the store's host is gone: the group is over anyway
            log.debug("[group/%d] heartbeat stopped: %s", rank, e)

    threading.Thread(target=beat, name=f"group-beat-{rank}", daemon=True).start()


def lost_ranks(world: int, wait_s: float = LOST_AFTER_S) -> list[int]:
    """The followers (ranks 1..world-1) whose heartbeat did not move within `wait_s`;
    every follower when the store cannot be reached."""
    followers = list(range(1, world))
    try:
        store = _store()
        first = {r: store.add(_beat_key(r), 0) for r in followers}
        alive: set[int] = set()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and len(alive) < len(followers):
            time.sleep(0.25)
            alive |= {r for r in followers if store.add(_beat_key(r), 0) != first[r]}
    except Exception as e:
        log.warning("[group/0] the group's store is unreachable (%s): all followers lost", e)
        return followers
    return [r for r in followers if r not in alive]


def attach(strategy: Strategy, group: Group, mode: str = "ddp") -> ShardedReplica | None:
    """Train `strategy` as one rank of `group`. "ddp": its loss runs through DDP (gradients
    averaged over the ranks in backward); returns None. "fsdp": inner steps run on an FSDP2
    replica (covey/peer/fsdp.py), returned for Leader/follow. The model must already be on
    `group.device`. ValueError for another mode, a strategy fsdp does not support, or a
    model with active dropout: the ranks split each batch by rows, so their masks are not
    the single process's a validator re-executes (covey.models.randomness)."""
    if dropped := active_dropout(strategy.model):
        fields = dropout_fields(strategy.model)
        named = f" ({', '.join(fields)})" if fields else ""
        raise ValueError(
            f"a torchrun group of {group.world} ranks cannot train a model with dropout "
            f"({len(dropped)} modules, e.g. {dropped[0]}){named}: each rank draws masks for "
            "its own rows, which no validator reproduces; set the model's dropout to 0"
        )
    if mode == "fsdp":
        return ShardedReplica(strategy)
    if mode != "ddp":
        raise ValueError(f"group mode {mode!r} is not one of {', '.join(MODES)}")
    ids = [group.device.index] if group.device.type == "cuda" else None
    strategy.forward_module = DistributedDataParallel(strategy.model, device_ids=ids)
    return None


def shard(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of a batch: rank, rank + world, ... ValueError when the batch has
    fewer rows than the group has ranks (a rank would train on nothing)."""
    if batch.shape[0] < world:
        raise ValueError(f"a batch of {batch.shape[0]} rows cannot feed {world} ranks")
    return batch[rank::world]


class Leader:
    """Rank 0's side: call `begin` once the strategy is at the round's start, `inner_step`
    for each step, `end` before `make_contribution`, `stop` when leaving."""

    def __init__(
        self, strategy: Strategy, group: Group, replica: ShardedReplica | None = None
    ) -> None:
        if not group.leader:
            raise ValueError(f"rank {group.rank} is not the group's leader (rank 0)")
        self.strategy, self.group, self.replica = strategy, group, replica
        self.lost: str | None = None  # why the group broke: no collective is tried again
        self.stale = False  # the replica stepped since its shards were gathered (fsdp)

    @contextlib.contextmanager
    def _collectives(self, what: str) -> Iterator[None]:
        """GroupLost naming the lost rank(s) when a collective inside fails (a dead rank's
        connection closes, or the group's timeout passes). A failure with every follower
        still beating and no distributed error is the step's own bug: raised as it is."""
        if self.lost is not None:
            raise GroupLost(self.lost)
        try:
            yield
        except RuntimeError as e:
            lost = lost_ranks(self.group.world)
            if not lost and not isinstance(e, dist.DistError):
                raise
            who = f"rank {', '.join(map(str, lost))} lost" if lost else "no rank stopped beating"
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            self.lost = f"the group broke during {what}: {who} ({first})"
            log.error("[group/0] %s", self.lost)
            raise GroupLost(self.lost) from None

    def _command(self, *words: int) -> None:
        cmd = torch.tensor([*words, 0, 0, 0][:3], dtype=torch.int64, device=self._wire)
        dist.broadcast(cmd, 0)

    @property
    def _wire(self) -> torch.device:
        return self.group.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def begin(self) -> None:
        with self._collectives("BEGIN"):
            self._command(BEGIN)
            _broadcast_local_state(self.strategy, self._wire)
            if self.replica is not None:
                self.replica.load()

    def inner_step(self, batch: torch.Tensor) -> torch.Tensor:
        with self._collectives("STEP"):
            self._command(STEP, *batch.shape)
            full = batch.to(self._wire, torch.int64).contiguous()
            dist.broadcast(full, 0)
            rows = shard(full, 0, self.group.world)
            if self.replica is None:
                return self.strategy.inner_step(rows)
            self.stale = True  # gathered when the state is read: `sync_state`
            return self.replica.step(rows)

    def commitment(
        self,
        step: int,
        start_params: dict[str, torch.Tensor],
        buckets: int = BUCKETS,
        digest: str | None = None,
    ) -> Commitment:
        """The commitment to the group's state after `step` inner steps (`commitment_of`'s
        contract; its hash `digest`, else none past step 0). With fsdp, once the replica
        stepped: every rank sketches its own shards (SKETCH: the parameters' deltas from
        the start shards loaded at BEGIN, which are `start_params`' rows) and the leader
        sums the all-gathered partial sketches in rank order; only `buckets` numbers per
        group per rank move and nothing is gathered whole. The sums equal the whole
        state's sketches to float64 rounding (another order of the same additions: about
        1e-16 relative, far below the tolerance commitments are compared with); for a
        given group size they are deterministic. Else the strategy's own state."""
        if self.replica is None or not self.stale:
            local = self.strategy.local_state(copy=False)
            return commitment_of(local, start_params, step, buckets, digest=digest)
        with self._collectives("SKETCH"):
            self._command(SKETCH, buckets)
            sums = _sum_sketches(self.replica.sketch(buckets, leader=True), self._wire)
        return commitment_from_sketches(step, NO_HASH if digest is None else digest, sums)

    def sync_state(self) -> None:
        """Make the strategy's state the group's: with fsdp, gather the replica's shards
        into it (parameters and moments, one all-gather each) when it stepped since the
        last gather, else move its parked parameters back to the device. Call before
        reading the whole state (the contribution, the round's end state); commitments need
        none (`commitment`)."""
        if self.replica is None:
            return
        if not self.stale:  # the parked copy is the state: back on the device as it is
            self.replica.restore()
            return
        with self._collectives("GATHER"):
            self._command(GATHER)
            self.replica.gather(leader=True)
        self.stale = False

    def end(self) -> None:
        """Sum the ranks' tokens into the leader's strategy: its contribution counts the
        whole group's work."""
        self.sync_state()
        with self._collectives("END"):
            self._command(END)
            tokens = torch.tensor([self.strategy.tokens], dtype=torch.int64, device=self._wire)
            dist.all_reduce(tokens)
            self.strategy.tokens = int(tokens.item())

    def stop(self) -> None:
        """Release the followers; nothing to release (no collective tried) once the group
        broke."""
        if self.lost is None:
            with self._collectives("STOP"):
                self._command(STOP)


def follow(strategy: Strategy, group: Group, replica: ShardedReplica | None = None) -> int:
    """A follower's whole life: act on the leader's commands until STOP; returns the
    number of inner steps taken. Nothing here talks to the coordinator. GroupLost when a
    collective fails (the leader or another rank is gone, or the group's timeout passed)."""
    if group.leader:
        raise ValueError("rank 0 leads; follow() is for the other ranks")
    try:
        return _follow(strategy, group, replica)
    except RuntimeError as e:
        if isinstance(e, GroupLost) or not isinstance(e, dist.DistError):
            raise
        raise GroupLost(f"rank {group.rank}: the group broke ({str(e)[:300]})") from None


def _follow(strategy: Strategy, group: Group, replica: ShardedReplica | None) -> int:
    wire = group.device if dist.get_backend() == "nccl" else torch.device("cpu")
    steps = 0
    while True:
        cmd = torch.zeros(3, dtype=torch.int64, device=wire)
        dist.broadcast(cmd, 0)
        op, rows, cols = (int(v) for v in cmd.tolist())
        if op == BEGIN:
            _broadcast_local_state(strategy, wire)
            if replica is not None:
                replica.load()
        elif op == STEP:
            full = torch.empty(rows, cols, dtype=torch.int64, device=wire)
            dist.broadcast(full, 0)
            rows = shard(full, group.rank, group.world)
            if replica is None:
                strategy.inner_step(rows)
            else:
                replica.step(rows)
            steps += 1
        elif op == GATHER and replica is not None:
            replica.gather(leader=False)
        elif op == SKETCH and replica is not None:
            _sum_sketches(replica.sketch(rows, leader=False), wire)
        elif op == END:
            tokens = torch.tensor([strategy.tokens], dtype=torch.int64, device=wire)
            dist.all_reduce(tokens)
            strategy.tokens = strategy.steps = 0  # the leader's contribution holds them
        elif op == STOP:
            return steps
        else:
            raise RuntimeError(f"unknown group command {op} (known: {_NAMES})")


def _sum_sketches(partial: torch.Tensor, wire: torch.device) -> list[torch.Tensor]:
    """Every rank's partial sketches (groups, buckets), all-gathered, summed in rank order
    on the host: one float64 row per group."""
    mine = partial.to(wire).contiguous()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    total = torch.zeros(mine.shape, dtype=torch.float64)
    for part in every:  # rank 0, 1, ...: the same order on every call
        total += part.cpu()
    return list(total)


class GroupCommitter(Committer):
    """A group leader's `Committer`: commitment 0 from the strategy's state at the round's
    start (taken before BEGIN, as a single device's), the later ones the group's
    (`Leader.commitment`: under fsdp sketched shard by shard, no gather). Synchronous: a
    commitment is a collective, made in the training loop on every rank at once."""

    def __init__(
        self,
        leader: Leader,
        start_state: TrainState,
        commit_every: int,
        buckets: int = BUCKETS,
        start_digest: str | None = None,
    ) -> None:
        self.leader = leader
        super().__init__(leader.strategy, start_state, commit_every, buckets, start_digest)

    def _commit(self, step: int) -> Commitment:
        if step == 0:
            return super()._commit(0)
        return self.leader.commitment(step, self.start_params, self.buckets)


def _broadcast_local_state(strategy: Strategy, wire: torch.device) -> None:
    """Rank 0's local state into every rank's strategy, tensor by tensor in name order.
    Followers receive into buffers shaped like their own state and load it, so optimizer
    moments not created yet on a follower arrive too."""
    leader = dist.get_rank() == 0
    state = strategy.local_state(copy=not leader)
    for name in sorted(state):
        t = state[name]
        buf = t.detach().to(wire).contiguous()
        dist.broadcast(buf, 0)
        if not leader:
            state[name] = buf.to(t.device)
    if not leader:
        strategy.load_local_state(state)


# -- `covey worker` under torchrun -------------------------------------------------------------


def rank_from_env() -> int:
    """This process's rank under torchrun (0 when not under it)."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def share_info(group: Group, info: dict[str, Any] | None) -> dict[str, Any]:
    """The leader's GET /v1/run answer, handed to every rank as JSON bytes (never pickled):
    the followers build the same run from it without a connection of their own."""
    wire = group.device if dist.get_backend() == "nccl" else torch.device("cpu")
    data = json.dumps(info).encode() if group.leader else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=wire)
    dist.broadcast(size, 0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=wire)
    if group.leader:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return info if group.leader else json.loads(bytes(buf.cpu().tolist()))  # type: ignore[return-value]


class _RunInfo:
    """What `set_up_run` asks of a coordinator client, answered from the leader's copy."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info, self.base_url = info, "(the group's leader)"

    def get(self, path: str) -> dict[str, Any]:
        if path != "/v1/run":
            raise RuntimeError(f"a follower asks the coordinator nothing ({path})")
        return self.info

    def configure(self, *_: Any) -> None:
        return None


def run_follower(device: str | None, threads: int | None, mode: str = "ddp") -> int:
    """`covey worker` on a rank > 0: join the group, take the run from the leader, follow
    its commands until STOP (`mode`: ddp or fsdp, as the leader's). 0 on a clean stop."""
    from covey.peer.runsetup import set_up_run

    group = group_from_env(device or "auto")
    if group is None or group.leader:
        raise RuntimeError("run_follower needs a torchrun rank > 0")
    info = share_info(group, None)
    run = set_up_run(_RunInfo(info), threads, None, str(group.device))  # type: ignore[arg-type]
    replica = attach(run.strategy, group, mode)
    try:
        follow(run.strategy, group, replica)
    except GroupLost as e:
        log.error("[group/%d] %s: exiting", group.rank, e)
        return 1
    dist.destroy_process_group()
    return 0
