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
from covey.algorithms.base import LossFn, Strategy
from covey.algorithms.codec_base import Codec
from covey.algorithms.device_round import HostCopies, to_round_device
from covey.algorithms.host_memory import add_from_host, home_of, moved_to, pinned, zeros_at
from covey.algorithms.optim import (
    has_schedule,
    make_inner_optimizer,
    nesterov_sgd,
    scheduled_lr,
    set_lr,
)
from covey.algorithms.state import Contribution, RoundError, TrainState
from covey.algorithms.tensors import clip_grad_, flatten
from covey.config import DiLoCoConfig


class DiLoCo(Strategy):
    flexible_steps = True
    device_round = True  # the outer step follows its gradients onto the training device

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
        # the round's start weights: the state's own tensors, on the model's device or
        # on the host (pinned there next to a GPU); never a copy on the device
        self._start_params: list[torch.Tensor] | None = None
        self._start_round = 0  # its round: with inner steps, the lr schedule's position
        numel = sum(p.numel() for p in model.parameters()) if cfg.error_feedback else 0
        # error feedback, on the host (pinned next to a GPU) unless the canonical state is
        # on the device: the device holds the model, its gradients and the two AdamW
        # moments only (tests/test_device_memory.py); `_ef_home` is set by load_state
        self._ef_home = torch.device("cpu")
        self._residual = zeros_at(numel, self._ef_home, self.device)  # into the next round
        self._pending = zeros_at(numel, self._ef_home, self.device)  # until certified

    @property
    def reexecutable(self) -> bool:
        return True

    @property
    def carries_local_state(self) -> bool:
        return self.cfg.inner_state == "keep" or self.cfg.error_feedback

    @property
    def local_params_carried(self) -> bool:
        return False  # `adopt` loads the round's start over the worker's own weights

    def carries_entry(self, name: str) -> bool:
        if name.startswith("param/"):
            return self.local_params_carried
        # the residual always; the inner optimizer only when it is kept between rounds
        return name.startswith("optim/ef/") or self.cfg.inner_state == "keep"

    def load_state(self, state: TrainState) -> None:
        super().load_state(state)
        # the state's tensors, not a copy: a state's tensors are never changed in place
        # (outer_step makes new ones); host tensors are pinned for the GPU to read
        self._start_params = [pinned(state.params[n], self.device) for n in self.names]
        home = home_of(self._start_params, self.device)
        if home != self._ef_home:  # the residuals follow the canonical state
            self._ef_home = home
            self._residual = moved_to(self._residual, home, self.device)
            self._pending = moved_to(self._pending, home, self.device)
        self._start_round = state.round
        if self.cfg.inner_state == "reset":
            self.reset_inner_optimizer()

    def adopt(self, state: TrainState, accepted: bool = True) -> None:
        self.load_state(state)
        if self.cfg.error_feedback:
            if accepted:
                self._residual = self._pending
            self._pending = zeros_at(self._residual.numel(), self._ef_home, self.device)

    def reset_local(self) -> None:
        self.reset_inner_optimizer()
        self._residual = zeros_at(self._residual.numel(), self._ef_home, self.device)
        self._pending = zeros_at(self._pending.numel(), self._ef_home, self.device)

    def reset_inner_optimizer(self) -> None:
        """A fresh inner optimizer: no moments, step count 0."""
        self.inner_opt = make_inner_optimizer(self.model, self.cfg.optim)

    def _free_local_extras(self) -> None:
        self.reset_inner_optimizer()

    def _free_round_start(self) -> None:
        self._start_params = None

    def end_local_state(self) -> dict[str, torch.Tensor]:
        """`local_state()`, the inner optimizer's moments handed over rather than copied
        (the optimizer is reset: `Strategy.end_local_state`); parameters and residuals
        are copied (the model and the residuals move on when the round is adopted)."""
        state = self.local_state(copy=False)
        moments = {
            t.data_ptr()
            for per_param in self.inner_opt.state.values()
            for t in per_param.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        }
        out = {
            k: v if v.dim() > 0 and v.data_ptr() in moments else v.clone() for k, v in state.items()
        }
        self.free_round_memory(optimizer=True)
        return out

    def _fresh_inner_state(
        self, p: torch.Tensor, device: str | None = None
    ) -> dict[str, torch.Tensor]:
        """What torch.optim puts in a parameter's state on its first step, before updating
        it: zero moments and a float step count (none for SGD without momentum). A fresh
        optimizer and one holding copies of these tensors take bit-identical steps (the
        moments are broadcast views: `_zeros`). `device="meta"`: their shapes only."""
        if self.cfg.optim.name == "sgd":
            return {}
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return {
            "step": torch.tensor(0.0, dtype=scalar, device=device),
            "exp_avg": _zeros(p, device),
            "exp_avg_sq": _zeros(p, device),
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
            home, device = self._ef_home, self.device
            self._residual = moved_to(extras["optim/ef/residual"], home, device, copy=True)
            self._pending = moved_to(extras["optim/ef/pending"], home, device, copy=True)

    def inner_step(self, batch: torch.Tensor) -> torch.Tensor:
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
        """start - local, flat float32 on the model's device, plus the carried residual
        under error feedback. Start weights and residual on the host come over a
        parameter (or chunk) at a time: one model size on the device, the result."""
        if self._start_params is None:
            raise RuntimeError("load_state must run before the first round")
        delta = flatten(list(self.model.parameters()))
        at = 0
        for t in self._start_params:  # in place, element by element: the same bits
            part = delta[at : at + t.numel()]
            start = t.reshape(-1).to(delta.device, non_blocking=True).float()
            torch.sub(start, part, out=part)
            at += t.numel()
        if self.cfg.error_feedback:
            add_from_host(delta, self._residual)
        return delta

    def encode_work(self) -> tuple[bytes, int | None]:
        delta = self.pseudo_gradient()
        if not self.cfg.error_feedback:
            return self.codec.encode(delta), None
        # what the codec dropped becomes the residual once the round accepts it
        payload, decoded = self.codec.roundtrip(delta)
        self._pending = moved_to(delta.sub_(decoded), self._ef_home, self.device)
        return payload, None

    def apply_round(
        self, start_state: TrainState, contributions: Sequence[Contribution]
    ) -> TrainState:
        return outer_step(start_state, self.aggregate(start_state, contributions), self.cfg)

    def apply_round_consuming(
        self, start_state: TrainState, contributions: Sequence[Contribution]
    ) -> TrainState:
        if type(self).apply_round is not DiLoCo.apply_round:  # a subclass's own update
            return super().apply_round_consuming(start_state, contributions)
        grads = self.aggregate(start_state, contributions)
        return outer_step(start_state, grads, self.cfg, consume=True)


def _zeros(p: torch.Tensor, device: str | None) -> torch.Tensor:
    """Zeros shaped like `p`: on the meta device a layout; else a broadcast view of one
    zero, which holds no memory (a fresh AdamW's two moments would be two model sizes)
    and is copied into a real tensor wherever it is installed."""
    if device == "meta":
        return torch.empty_like(p, device="meta")
    return torch.zeros((), dtype=p.dtype, device=device or p.device).expand(p.shape)


def _to_state_device(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A copy of an optimizer tensor where torch.optim keeps it: moments on the
    parameter's device, the step count (0-dim) on the host, as non-capturable AdamW does."""
    return t.clone() if t.dim() == 0 else t.to(p.device, copy=True)


def outer_step(
    start_state: TrainState,
    outer_grads: dict[str, torch.Tensor],
    cfg: DiLoCoConfig,
    consume: bool = False,
) -> TrainState:
    """Nesterov SGD on the named parameters in outer_grads; the others are carried over.
    `consume`: take each tensor out of start_state's dicts as its replacement is made, so
    that a tensor no one else holds is freed at once (one tensor's old and new values in
    memory, not two states); the same new state, bit for bit, and start_state
    is left empty. RoundError for a non-finite outer gradient, before anything is taken.

    Outer gradients on another device than the state's (the round result on the training
    device, covey.algorithms.device_round): each parameter's start and momentum go there,
    the step is taken there, and only the new tensors come back to the state's device."""
    for name, g in outer_grads.items():
        if not torch.isfinite(g).all():
            raise RoundError(f"aggregated outer gradient for {name} is not finite")
    devices = {g.device for g in outer_grads.values()}
    back = HostCopies(devices.pop() if len(devices) == 1 else torch.device("cpu"))
    old_params, old_outer = start_state.params, start_state.outer
    take = (lambda d, k: d.pop(k, None)) if consume else (lambda d, k: d.get(k))
    param_order, outer_order = list(old_params), list(old_outer)
    params: dict[str, torch.Tensor] = {}
    outer: dict[str, torch.Tensor] = {}
    for name, g in outer_grads.items():
        key = f"momentum/{name}"
        p, old_buf = take(old_params, name), take(old_outer, key)
        home = p.device
        new_p, buf = nesterov_sgd(
            to_round_device(p, g.device),  # type: ignore[arg-type]
            g,
            to_round_device(old_buf, g.device),
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            nesterov=cfg.nesterov,
        )
        params[name], buf = back(new_p, home), None if buf is None else back(buf, home)
        if buf is not None or old_buf is not None:
            outer[key] = buf if buf is not None else old_buf  # type: ignore[assignment]
        del p, old_buf, buf, new_p
    back.done()
    for name in param_order:  # the others, carried over, in the start state's order
        if name not in params:
            params[name] = take(old_params, name)  # type: ignore[assignment]
    params = {n: params[n] for n in param_order}
    for key in outer_order:
        if key not in outer:
            outer[key] = take(old_outer, key)  # type: ignore[assignment]
    # the start's keys in its order, then new momentum buffers as they were made
    outer = {k: outer[k] for k in [*outer_order, *(k for k in outer if k not in outer_order)]}
    return TrainState(params, outer, start_state.round + 1)
