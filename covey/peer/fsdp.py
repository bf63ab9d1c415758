"""FSDP2 inside a torchrun group peer: inner steps on a fully sharded replica.

`covey/peer/group.py` runs a group with DDP by default: every rank holds the whole model,
its gradients and its inner optimizer. With `mode="fsdp"` each rank instead trains a
replica of the strategy's model that `torch.distributed.fsdp.fully_shard` (FSDP2) cuts
along dim 0: gradients are reduce-scattered and averaged, and the inner optimizer's
moments exist only as each rank's shard.

covey between peers still needs whole tensors for the round's start and its contribution,
so the strategy's own model stays the canonical copy: at BEGIN every rank loads its shards
from it (the leader's state, broadcast by the group), keeps its shards of the start
parameters in host memory, and parks the canonical parameters and inner-optimizer moments in
host memory (pinned beside a CUDA device; `_park`). Commitments to the local state every k
steps (verification) gather nothing: a count sketch is linear, so each rank sketches its own
shards at their global coordinates (`sketch`) and the leader sums the ranks' partial sketches
(`Leader.commitment` in covey/peer/group.py). At the round's end the shards are gathered once
into the leader's strategy (`gather`: parameters onto the training device, moments into host
memory), whose `make_contribution()` and end local state are then those of one device taking
the same steps (`Leader.sync_state`).

What a rank holds: between BEGIN and the round's end, on the training device, its shards of
the parameters, gradients and moments (plus FSDP2's all-gather of one block at a time); in
host memory the canonical copy and its start shards. From the round's end to the next BEGIN
the leader also holds the whole parameters on the device. A CPU peer's host is its training
device: parking moves nothing there and is only booked (`device_bytes`).

Only strategies whose inner step is DiLoCo's (AdamW or SGD, lr schedule, global-norm
clip) are supported; `ShardedReplica` refuses others with ValueError. Checked on gloo/CPU
with torch 2.13 (tests/test_multigpu_peer.py); never run on NCCL here (no GPU).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from covey.algorithms.base import Strategy
from covey.algorithms.host_memory import moved_to
from covey.algorithms.optim import has_schedule, make_inner_optimizer, scheduled_lr, set_lr
from covey.devices import autocast
from covey.trust.sketch import add_piece, sketch_groups

MODES = ("ddp", "fsdp")


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of `rank`'s dim-0 shard of a tensor of `rows` rows, as
    `Shard(0)` cuts it (torch.chunk's rule: ceil(rows / world) rows each, the last ranks
    short or empty)."""
    per = -(-rows // world)
    first = min(rank * per, rows)
    return first, min(per, rows - first)


def _supported(strategy: Strategy) -> bool:
    from covey.algorithms.diloco import DiLoCo

    return isinstance(strategy, DiLoCo) and type(strategy).inner_step is DiLoCo.inner_step


class ShardedReplica:
    """This rank's FSDP2 replica of `strategy.model` and its sharded inner optimizer. Every
    rank of the group must build it, and call `load`, `step` and `gather` in the same
    order (they are collectives). ValueError for a strategy without DiLoCo's inner step."""

    def __init__(self, strategy: Strategy) -> None:
        from torch.distributed.fsdp import fully_shard

        if not _supported(strategy):
            raise ValueError(
                f"group mode fsdp supports DiLoCo's inner step, not {type(strategy).__name__}; "
                f"use --group ddp"
            )
        self.strategy = strategy
        self.cfg = strategy.cfg  # type: ignore[attr-defined]
        replica = copy.deepcopy(strategy.model)
        for module in replica.modules():  # one FSDP unit per block: gathered one at a time
            if isinstance(module, nn.ModuleList):
                for block in module:
                    fully_shard(block)
        fully_shard(replica)
        self.replica = replica
        self.names = [n for n, _ in strategy.model.named_parameters()]
        self.shards = dict(replica.named_parameters())
        if sorted(self.shards) != sorted(self.names):
            raise ValueError("fully_shard renamed parameters: cannot map shards to the model")
        for n, shard in self.shards.items():
            place = tuple(shard.placements)  # type: ignore[attr-defined]
            if len(place) != 1 or not place[0].is_shard(0):
                raise ValueError(f"{n}: FSDP2 placed it {place}, not one dim-0 shard")
        self.opt = make_inner_optimizer(replica, self.cfg.optim)
        # this rank's shards of the round's start parameters, on the host: what the
        # commitments' parameter sketches are deltas from (loaded at BEGIN)
        self.start: dict[str, torch.Tensor] = {}
        self.gathers = 0  # whole states gathered: one per contribution
        self.sketches = 0  # partial sketches made: one per commitment after step 0
        # the storages of the canonical copy's tensors parked in host memory: booked at
        # BEGIN (`_park`), each let go of where a tensor is replaced or moved back
        self._parked: set[int] = set()

    # -- collectives ---------------------------------------------------------------------------

    def load(self) -> None:
        """Shards from the strategy's (full, identical on every rank) local state: the
        parameters and, when the state has taken steps, the inner optimizer's moments."""
        from torch.distributed.tensor import distribute_tensor

        local = self.strategy.local_state(copy=False)
        self.opt = make_inner_optimizer(self.replica, self.cfg.optim)
        host = torch.device("cpu")
        with torch.no_grad():
            for n in self.names:
                shard = self.shards[n]
                mesh, place = shard.device_mesh, shard.placements  # type: ignore[attr-defined]
                mine = shard.to_local()  # type: ignore[attr-defined]
                whole = local[f"param/{n}"].to(mine.device, shard.dtype)
                shard.copy_(distribute_tensor(whole, mesh, place))
                self.start[n] = moved_to(mine, host, mine.device, copy=True)
                step = local.get(f"optim/{n}/step")
                if step is not None and float(step) > 0:
                    self.opt.state[shard] = {
                        "step": step.detach().clone(),
                        **{
                            k: distribute_tensor(
                                local[f"optim/{n}/{k}"].to(mine.device), mesh, place
                            )
                            for k in ("exp_avg", "exp_avg_sq")
                        },
                    }
        self._park()

    def step(self, rows: torch.Tensor) -> torch.Tensor:
        """One inner step on this rank's rows, as DiLoCo.inner_step takes it on a whole
        batch: lr schedule, forward (autocast), backward (FSDP averages the gradients),
        global-norm clip, optimizer step. Counts tokens/steps in the strategy."""
        s, cfg = self.strategy, self.cfg
        if has_schedule(cfg.optim):
            step = s._schedule_round * s.steps_per_round + s.steps  # type: ignore[attr-defined]
            set_lr(self.opt, scheduled_lr(cfg.optim, step))
        self.replica.train()
        self.opt.zero_grad(set_to_none=True)
        batch = rows.to(s.device, non_blocking=True)
        with autocast(s.device, s.precision):
            loss = s._forward(self.replica, batch)
        loss.backward()
        if cfg.optim.grad_clip > 0:  # clip_grad_'s rule: scale when the norm exceeds it
            nn.utils.clip_grad_norm_(self.replica.parameters(), cfg.optim.grad_clip)
        self.opt.step()
        s.tokens += batch[:, 1:].numel()
        s.steps += 1
        return loss.detach()  # read on the host after the round's steps, as inner_step's

    def gather(self, leader: bool) -> None:
        """Whole parameters and moments from the shards; the leader writes them into its
        strategy (the parameters on the training device, in place of the parked host
        copies; the moments into its inner optimizer in host memory), the others only take
        part."""
        s = self.strategy
        params = dict(s.model.named_parameters())
        host = torch.device("cpu")
        self.gathers += 1
        with torch.no_grad():
            for n in self.names:
                shard = self.shards[n]
                full = shard.full_tensor()  # type: ignore[attr-defined]
                st: dict[str, Any] = self.opt.state.get(shard) or {}
                moments = {k: st[k].full_tensor() for k in ("exp_avg", "exp_avg_sq") if k in st}
                if not leader:
                    continue
                p = params[n]
                old = s.inner_opt.state.get(p) or {}  # type: ignore[attr-defined]
                self._parked -= {_storage(t) for t in [p, *old.values()]}
                if _same_storage(full, shard.to_local()):  # type: ignore[attr-defined]
                    full = full.clone()  # a group of one: the shard is the whole tensor
                p.data = full.to(s.device)
                if "step" in st:
                    s.inner_opt.state[p] = {  # type: ignore[attr-defined]
                        "step": st["step"].detach().clone(),
                        **{k: moved_to(v, host, s.device, copy=True) for k, v in moments.items()},
                    }
                    self._parked |= {_storage(v) for v in moments_of(s.inner_opt.state[p])}  # type: ignore[attr-defined]

    # -- where the canonical copy lives ----------------------------------------------------------

    def _park(self) -> None:
        """The strategy's canonical parameters and inner-optimizer moments to host memory
        (pinned beside a CUDA device), once its shards are loaded: between BEGIN and the
        round's end only the shards train and only they are sketched, so the training
        device holds the shards alone. On a CPU peer the host is the training device:
        nothing moves, and the tensors are only booked as parked (`device_bytes`)."""
        s, host = self.strategy, torch.device("cpu")
        self._parked.clear()
        with torch.no_grad():
            for p in s.model.parameters():
                p.data = moved_to(p.data, host, s.device)
                self._parked.add(_storage(p))
            for st in s.inner_opt.state.values():  # type: ignore[attr-defined]
                for k in [k for k, v in st.items() if v.dim() > 0]:
                    st[k] = moved_to(st[k], host, s.device)
                    self._parked.add(_storage(st[k]))

    def restore(self) -> None:
        """The parked parameters back on the training device, unchanged (a round that took
        no step: nothing to gather); the moments stay in host memory. Not a collective."""
        s = self.strategy
        with torch.no_grad():
            for p in s.model.parameters():
                if _storage(p) in self._parked:
                    self._parked.discard(_storage(p))
                    p.data = p.data.to(s.device)

    def device_bytes(self) -> dict[str, int]:
        """What this rank holds for training, in bytes: "canonical", the strategy's
        parameters and inner-optimizer moments not parked in host memory (0 between BEGIN
        and the round's end); "shards", this rank's shards of the replica's parameters and
        moments (about 1/world of them each); "start", its start shards (host memory)."""
        s = self.strategy
        canonical = [*s.model.parameters()]
        canonical += [v for st in s.inner_opt.state.values() for v in moments_of(st)]  # type: ignore[attr-defined]
        shards = [t.to_local() for t in self.shards.values()]  # type: ignore[attr-defined]
        shards += [v.to_local() for st in self.opt.state.values() for v in moments_of(st)]
        return {
            "canonical": sum(_nbytes(t) for t in canonical if _storage(t) not in self._parked),
            "shards": sum(_nbytes(t) for t in shards),
            "start": sum(_nbytes(t) for t in self.start.values()),
        }

    def sketch(self, buckets: int, leader: bool) -> torch.Tensor:
        """This rank's partial count sketches of the state a commitment sketches
        (`covey.trust.sketch.sketch_groups`): (groups, buckets) float64 on the training
        device. Each rank adds the coordinates of its own shards, parameters' deltas from
        their start and moments, at their global indices in the whole state's vectors; the
        leader adds the unsharded tensors too (error feedback's residuals, which inner
        steps do not change). Summed over the ranks they are the whole state's sketches:
        the count sketch is linear. Not a collective itself (`Leader.commitment` is)."""
        s = self.strategy
        layout = s.local_state_layout()
        whole = s.local_state(copy=False) if leader else {}
        groups = sketch_groups(layout)
        out = torch.zeros(len(groups), buckets, dtype=torch.float64, device=s.device)
        with torch.no_grad():
            for g, keys in enumerate(groups):
                offset = 0
                for key in keys:
                    piece = self._piece(key, whole)
                    if piece is not None:
                        add_piece(out[g], offset + piece[0], piece[1])
                    offset += layout[key].numel()
        self.sketches += 1
        return out

    def _piece(self, key: str, whole: dict[str, torch.Tensor]) -> tuple[int, torch.Tensor] | None:
        """(offset in the tensor, flat float32 values) of what this rank sketches of a
        local-state entry; None for nothing (another rank's, or a moment not made yet:
        zeros add nothing)."""
        prefix, _, rest = key.partition("/")
        if prefix == "param" and rest in self.shards:
            local = self.shards[rest].to_local()  # type: ignore[attr-defined]
            start = self.start[rest].to(local.device, non_blocking=True)
            return self._offset(rest), (local.float() - start.float()).reshape(-1)
        name, _, kind = rest.rpartition("/")
        if prefix == "optim" and name in self.shards:
            state: dict[str, Any] = self.opt.state.get(self.shards[name]) or {}
            if kind not in state:
                return None
            return self._offset(name), state[kind].to_local().float().reshape(-1)
        if key in whole:  # the leader's own, whole
            return 0, whole[key].detach().float().reshape(-1)
        return None

    def _offset(self, name: str) -> int:
        """Where this rank's shard of parameter `name` starts in its flat whole tensor."""
        shard = self.shards[name]
        mesh = shard.device_mesh  # type: ignore[attr-defined]
        rows = shard.shape[0]
        first, count = shard_rows(rows, mesh.size(), mesh.get_local_rank())
        if shard.to_local().shape[0] != count:  # type: ignore[attr-defined]
            raise RuntimeError(f"{name}: this rank holds rows FSDP2 did not cut as Shard(0)")
        return first * (shard.numel() // rows)


def moments_of(state: dict[str, Any]) -> list[torch.Tensor]:
    """An optimizer's per-parameter state without its scalars (AdamW's step count)."""
    return [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _storage(a) == _storage(b)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
