"""FSDP2 inside a torchrun group peer: inner steps on a fully sharded replica.

`covey/peer/group.py` runs a group with DDP by default: every rank holds the whole model,
its gradients and its inner optimizer. With `mode="fsdp"` each rank instead trains a
replica of the strategy's model that `torch.distributed.fsdp.fully_shard` (FSDP2) cuts
along dim 0: gradients are reduce-scattered and averaged, and the inner optimizer's
moments exist only as each rank's shard.

covey between peers still needs whole tensors: the round's start comes in as a full local
state, and the contribution and the commitments to the local state every k steps
(verification) are computed from full parameters and moments. So the strategy's own model
stays the canonical copy: at BEGIN every rank loads its shards from it (the leader's state,
broadcast by the group), and when the state is read (a commitment every `commit_every`
steps, the contribution at the round's end) the shards are gathered back into the
leader's strategy, whose `local_state()`, `make_contribution()` and commitments are then
those of one device taking the same steps (`Leader.sync_state` in covey/peer/group.py).
Memory: parameters are held twice on the leader (canonical + shard) and once per follower;
gradients and optimizer moments are sharded. A gather costs one all-gather of parameters
and moments; inner steps between commitments gather nothing.

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
from covey.algorithms.optim import has_schedule, make_inner_optimizer, scheduled_lr, set_lr
from covey.devices import autocast

MODES = ("ddp", "fsdp")


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
        self.opt = make_inner_optimizer(replica, self.cfg.optim)
        self.gathers = 0  # whole states gathered: one per commitment and per contribution

    # -- collectives ---------------------------------------------------------------------------

    def load(self) -> None:
        """Shards from the strategy's (full, identical on every rank) local state: the
        parameters and, when the state has taken steps, the inner optimizer's moments."""
        from torch.distributed.tensor import distribute_tensor

        local = self.strategy.local_state(copy=False)
        self.opt = make_inner_optimizer(self.replica, self.cfg.optim)
        with torch.no_grad():
            for n in self.names:
                shard = self.shards[n]
                mesh, place = shard.device_mesh, shard.placements  # type: ignore[attr-defined]
                shard.copy_(distribute_tensor(local[f"param/{n}"].to(shard.dtype), mesh, place))
                step = local.get(f"optim/{n}/step")
                if step is not None and float(step) > 0:
                    self.opt.state[shard] = {
                        "step": step.detach().clone(),
                        **{
                            k: distribute_tensor(local[f"optim/{n}/{k}"], mesh, place)
                            for k in ("exp_avg", "exp_avg_sq")
                        },
                    }

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
        strategy (model and inner optimizer), the others only take part."""
        s = self.strategy
        params = dict(s.model.named_parameters())
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
                p.copy_(full)
                if "step" in st:
                    s.inner_opt.state[p] = {  # type: ignore[attr-defined]
                        "step": st["step"].detach().clone(),
                        **{k: v.to(p.device).clone() for k, v in moments.items()},
                    }
