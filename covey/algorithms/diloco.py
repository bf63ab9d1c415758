"""DiLoCo (Douillard et al., arXiv 2311.08105).

Each worker takes H inner AdamW steps from the round's start weights. Its contribution is
the pseudo-gradient start - local, encoded by the codec. The canonical update averages the
pseudo-gradients weighted by tokens and takes one outer Nesterov SGD step (paper defaults:
lr 0.7, momentum 0.9). Inner optimizer states never leave the worker.

With `error_feedback`, what the codec dropped is kept locally and added to the next
round's pseudo-gradient (as DeMo does for its momentum, arXiv 2411.19870): covey's
combination of DiLoCo with DCT top-k / int4 compression. The new residual waits as
"optim/pending" until the round's certificate: `adopt(state, accepted=True)` makes it the
residual, a rejected contribution keeps the old one (its bytes never reached the model).

With `inner_state = "reset"` the inner optimizer starts fresh whenever the worker takes a
canonical state (`load_state`, `adopt`): every round then starts from (W_r, fresh AdamW).
"keep" carries the moments across rounds, as the paper does. Either way a round is
re-executable (covey/trust/verify.py): what it carries is the worker's committed end state
of its previous round (`Strategy.begin_round`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from covey.algorithms.aggregation import Aggregator
from covey.algorithms.base import (
    Contribution,
    LossFn,
    RoundError,
    Strategy,
    TrainState,
    clip_grad_,
    flatten,
)
from covey.algorithms.codecs import Codec
from covey.algorithms.optim import (
    has_schedule,
    make_inner_optimizer,
    nesterov_sgd,
    scheduled_lr,
    set_lr,
)
from covey.config import DiLoCoConfig


class DiLoCo(Strategy):
    flexible_steps = True

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        cfg: DiLoCoConfig,
        codec: Codec,
        aggregator: Aggregator | None = None,
    ) -> None:
        super().__init__(model, loss_fn, codec, aggregator)
        self.cfg = cfg
        self.steps_per_round = cfg.inner_steps
        self.inner_opt = make_inner_optimizer(model, cfg.optim)
        self._start: torch.Tensor | None = None  # flat start weights of the current round
        self._start_params: list[torch.Tensor] | None = None  # or the state's own tensors
        self._start_round = 0  # its round: with inner steps, the lr schedule's position
        numel = sum(p.numel() for p in model.parameters()) if cfg.error_feedback else 0
        # error feedback, on the model's device: carried into the next round / pending
        self._residual = torch.zeros(numel, device=self.device)
        self._pending = torch.zeros(numel, device=self.device)  # until certified

    @property
    def reexecutable(self) -> bool:
        return True

    @property
    def carries_local_state(self) -> bool:
        return self.cfg.inner_state == "keep" or self.cfg.error_feedback

    def load_state(self, state: TrainState) -> None:
        super().load_state(state)
        start = [state.params[n] for n in self.names]
        if all(t.device == self.device and t.dtype == torch.float32 for t in start):
            # the state's tensors, not a flat copy: a model size less (issue 13.3); a
            # state's tensors are never changed in place (outer_step makes new ones)
            self._start, self._start_params = None, start
        else:
            self._start = flatten(start).to(self.device)
            self._start_params = None
        self._start_round = state.round
        if self.cfg.inner_state == "reset":
            self.reset_inner_optimizer()

    def adopt(self, state: TrainState, accepted: bool = True) -> None:
        self.load_state(state)
        if self.cfg.error_feedback:
            if accepted:
                self._residual = self._pending
            self._pending = torch.zeros_like(self._residual)

    def reset_local(self) -> None:
        self.reset_inner_optimizer()
        self._residual = torch.zeros_like(self._residual)
        self._pending = torch.zeros_like(self._pending)

    def reset_inner_optimizer(self) -> None:
        """A fresh inner optimizer: no moments, step count 0."""
        self.inner_opt = make_inner_optimizer(self.model, self.cfg.optim)

    def _fresh_inner_state(
        self, p: torch.Tensor, device: str | None = None
    ) -> dict[str, torch.Tensor]:
        """What torch.optim puts in a parameter's state on its first step, before updating
        it: zero moments and a float step count (none for SGD without momentum). A fresh
        optimizer and one holding exactly these tensors take bit-identical steps.
        `device="meta"`: their shapes only."""
        if self.cfg.optim.name == "sgd":
            return {}
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        like = {"memory_format": torch.preserve_format, "device": device}
        return {
            "step": torch.tensor(0.0, dtype=scalar, device=device),
            "exp_avg": torch.zeros_like(p, **like),
            "exp_avg_sq": torch.zeros_like(p, **like),
        }

    def _local_extras(self, fresh_device: str | None = None) -> dict[str, torch.Tensor]:
        """Each inner optimizer tensor as "optim/<name>/<key>"; zeros before the first step."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            fresh = self._fresh_inner_state(p, fresh_device)
            have = self.inner_opt.state.get(p) or fresh  # .get: the state is a defaultdict
            if set(have) != set(fresh):
                raise RuntimeError(
                    f"inner optimizer state of {name} has keys {sorted(have)}, covey knows "
                    f"{sorted(fresh)}: a torch version covey does not support?"
                )
            out.update({f"optim/{name}/{k}": t.detach() for k, t in have.items()})
        if self.cfg.error_feedback:
            out["optim/ef/residual"] = self._residual
            out["optim/ef/pending"] = self._pending
        return out

    def _load_local_extras(self, extras: dict[str, torch.Tensor]) -> None:
        self.reset_inner_optimizer()
        for name, p in self.model.named_parameters():
            fresh = self._fresh_inner_state(p, "meta")  # its keys
            if fresh:
                self.inner_opt.state[p] = {
                    k: _to_state_device(extras[f"optim/{name}/{k}"], p) for k in fresh
                }
        if self.cfg.error_feedback:
            self._residual = extras["optim/ef/residual"].to(self.device, copy=True)
            self._pending = extras["optim/ef/pending"].to(self.device, copy=True)

    def inner_step(self, batch: torch.Tensor) -> float:
        if has_schedule(self.cfg.optim):  # a pure function of (round, step): re-executable
            step = self._schedule_round * self.steps_per_round + self.steps
            set_lr(self.inner_opt, scheduled_lr(self.cfg.optim, step))
        loss = self.forward_backward(batch)
        clip_grad_([p.grad for p in self.model.parameters()], self.cfg.optim.grad_clip)
        self.inner_opt.step()
        return loss

    @property
    def _schedule_round(self) -> int:
        """The round these inner steps belong to: the canonical state's round."""
        return self._start_round

    def pseudo_gradient(self) -> torch.Tensor:
        """start - local, flat float32, plus the carried residual under error feedback."""
        delta = flatten(list(self.model.parameters()))
        if self._start is not None:  # in place, element by element: the same bits
            torch.sub(self._start, delta, out=delta)
        elif self._start_params is not None:
            at = 0
            for t in self._start_params:
                part = delta[at : at + t.numel()]
                torch.sub(t.reshape(-1), part, out=part)
                at += t.numel()
        else:
            raise RuntimeError("load_state must run before the first round")
        if self.cfg.error_feedback:
            delta += self._residual
        return delta

    def encode_work(self) -> tuple[bytes, int | None]:
        delta = self.pseudo_gradient()
        payload = self.codec.encode(delta)
        if self.cfg.error_feedback:  # becomes the residual once the round accepts it
            self._pending = delta - self.codec.decode(payload, device=delta.device)
        return payload, None

    def apply_round(
        self, start_state: TrainState, contributions: Sequence[Contribution]
    ) -> TrainState:
        return outer_step(start_state, self.aggregate(start_state, contributions), self.cfg)


def _to_state_device(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A copy of an optimizer tensor where torch.optim keeps it: moments on the
    parameter's device, the step count (0-dim) on the host, as non-capturable AdamW does."""
    return t.clone() if t.dim() == 0 else t.to(p.device, copy=True)


def outer_step(
    start_state: TrainState, outer_grads: dict[str, torch.Tensor], cfg: DiLoCoConfig
) -> TrainState:
    """Nesterov SGD on the named parameters in outer_grads; the others are carried over."""
    params = dict(start_state.params)
    outer = dict(start_state.outer)
    for name, g in outer_grads.items():
        if not torch.isfinite(g).all():
            raise RoundError(f"aggregated outer gradient for {name} is not finite")
        params[name], buf = nesterov_sgd(
            start_state.params[name],
            g,
            start_state.outer.get(f"momentum/{name}"),
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            nesterov=cfg.nesterov,
        )
        if buf is not None:
            outer[f"momentum/{name}"] = buf
    return TrainState(params, outer, start_state.round + 1)
