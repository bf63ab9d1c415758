"""One pipeline stage's compute, transport-free: forward, recomputing backward, step.

Backward keeps no state from forward: it recomputes the stage's forward from the input it
is handed (activation recomputation, SWARM arXiv 2301.11913 sec. 3), so any server holding
the stage's weights can run the backward of a microbatch another server forwarded, and a
microbatch survives losing the server that ran its forward. Parameter gradients accumulate
across microbatches, weighted by their sample counts, until `step()` applies them as the
mean over the samples seen with the stage's own optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Stage:
    """A stage module with its optimizer and gradient accumulator.

    `target_samples`: `maybe_step()` steps once at least this many samples were backwarded.
    The last stage computes the next-token loss itself (`backward_loss`), so logits never
    travel; other stages take `grad_outputs` from the next stage (`backward`).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerFactory,
        *,
        target_samples: int = 1,
        last: bool = False,
    ) -> None:
        if target_samples < 1:
            raise ValueError(f"target_samples ({target_samples}) must be at least 1")
        # Recomputation must reproduce the forward exactly; a dropout mask drawn anew in
        # backward would differ from the one the next stage saw.
        for name, m in module.named_modules():
            if isinstance(m, nn.Dropout) and m.p > 0 and m.training:
                raise ValueError(
                    f"stage module {name} is Dropout(p={m.p}) in training mode: backward "
                    "recomputes forward, so dropout must be 0 (or the module in eval mode)"
                )
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = optimizer(self.params)
        self.target_samples = target_samples
        self.last = last
        self.samples = 0  # backwarded since the last step
        self.steps = 0
        # per-parameter gradient norms of the last backward: what a duplicated microbatch
        # is compared on when the stage has no input gradient to return (stage 0)
        self.last_sketch: list[float] = []

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Stage output for `inputs` (token ids for stage 0, hidden states otherwise)."""
        return self.module(inputs)

    def _recompute(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = inputs.detach()
        if x.is_floating_point():
            x.requires_grad_(True)
        with torch.enable_grad():
            return x, self.module(x)

    def backward(self, inputs: torch.Tensor, grad_outputs: torch.Tensor) -> torch.Tensor | None:
        """Recompute forward from `inputs`, backpropagate `grad_outputs` (d loss / d output,
        loss a mean over the microbatch), accumulate parameter grads. Returns d loss /
        d inputs, or None when the inputs are token ids. ValueError on a shape mismatch."""
        if self.last:
            raise ValueError("the last stage takes targets: call backward_loss")
        x, out = self._recompute(inputs)
        if grad_outputs.shape != out.shape:
            raise ValueError(
                f"grad_outputs shape {tuple(grad_outputs.shape)} != output {tuple(out.shape)}"
            )
        return self._backprop(x, out, grad_outputs.to(out.dtype))

    def backward_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[float, torch.Tensor | None]:
        """Last stage: recompute logits, next-token cross-entropy against `targets` (B, T),
        accumulate grads. Returns (mean loss, d loss / d inputs)."""
        if not self.last:
            raise ValueError("backward_loss is for the last stage only")
        x, logits = self._recompute(inputs)
        if targets.shape != logits.shape[:2]:
            raise ValueError(f"targets shape {tuple(targets.shape)} != {tuple(logits.shape[:2])}")
        with torch.enable_grad():
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        grad_x = self._backprop(x, loss, None)
        return float(loss.detach()), grad_x

    def _backprop(
        self, x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        n = x.shape[0]
        # Gradients are summed weighted by samples; step() divides by the total, so
        # microbatches of unequal size average like one big batch.
        weight = float(n)
        wants_x = x.requires_grad
        inputs = [*self.params, x] if wants_x else list(self.params)
        grads = torch.autograd.grad(
            out, inputs, grad_outputs=None if grad is None else grad, allow_unused=True
        )
        self.last_sketch = [
            0.0 if g is None else float(g.norm()) for g in grads[: len(self.params)]
        ]
        for p, g in zip(self.params, grads, strict=False):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g * weight
            else:
                p.grad.add_(g, alpha=weight)
        self.samples += n
        return grads[-1].detach() if wants_x else None

    def mean_grads(self) -> list[torch.Tensor | None]:
        """The accumulated gradient of each parameter as a mean over the samples seen."""
        if self.samples == 0:
            return [None for _ in self.params]
        return [None if p.grad is None else p.grad / self.samples for p in self.params]

    def maybe_step(self) -> bool:
        """Step when `target_samples` were reached; True if it stepped."""
        if self.samples < self.target_samples:
            return False
        self.step()
        return True

    def step(self) -> None:
        """Apply the mean accumulated gradient with the stage's optimizer, then clear it.
        ValueError when no sample was backwarded since the last step."""
        if self.samples == 0:
            raise ValueError("step() with no accumulated samples")
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(self.samples)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples = 0
        self.steps += 1
