"""GRPO-family policy loss, with the choices INTELLECT-2 found stable (arXiv:2505.07291).

- Group-relative advantages A = r - mean(r) over the G samples of one prompt, with no
  division by the group's std (Dr. GRPO, arXiv:2503.20783); std division is an option.
- Token-level importance ratio rho = exp(logpi - logmu) against the rollout's logprobs mu
  (the policy that generated it may be up to `async_level` versions old).
- Two-sided clipping: PPO's clip(rho, 1 - eps_low, 1 + eps_high) (asymmetric, DAPO
  arXiv:2503.14476), and for negative advantages a bound delta on rho, so one token with a
  huge ratio cannot dominate the step (INTELLECT-2, section 3.3).
- The summed token loss is divided by a fixed token budget (sequences x max_tokens), not
  by the number of valid tokens, so long and short completions weigh the same per token.
- No KL term by default; `kl_coef` > 0 adds the k3 estimator against reference logprobs.
- `norm` picks the normalizer: "max_tokens" (the default above), "tokens" (the number of
  valid tokens in the batch, DAPO's token-level loss) or "sequence" (each sequence's mean
  over its tokens, then the mean over sequences: the original GRPO, arXiv:2402.03300).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NORMS = ("max_tokens", "tokens", "sequence")


@dataclass(frozen=True)
class LossConfig:
    eps_low: float = 0.2  # rho is clipped below at 1 - eps_low
    eps_high: float = 0.28  # ... and above at 1 + eps_high
    delta: float = 4.0  # bound on rho for negative advantages (INTELLECT-2)
    max_tokens: int = 64  # fixed per-sequence token budget the loss is divided by
    std_normalize: bool = False  # divide advantages by the group std (original GRPO)
    kl_coef: float = 0.0  # weight of the k3 KL estimate against ref_logprobs
    norm: str = "max_tokens"  # "max_tokens" | "tokens" | "sequence" (see the module doc)

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError(f"bad clip range eps_low={self.eps_low}, eps_high={self.eps_high}")
        if self.delta <= 1 + self.eps_high:
            raise ValueError(f"delta ({self.delta}) must exceed 1 + eps_high ({1 + self.eps_high})")
        if self.max_tokens <= 0 or self.kl_coef < 0:
            raise ValueError(f"bad max_tokens={self.max_tokens} or kl_coef={self.kl_coef}")
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r} is not one of {NORMS}")


def group_advantages(
    rewards: torch.Tensor, group_size: int, std_normalize: bool = False
) -> torch.Tensor:
    """(N,) rewards, N = prompts x group_size in prompt-major order -> (N,) advantages
    r - mean over the prompt's group (divided by std + 1e-6 if `std_normalize`)."""
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}"
        )
    groups = rewards.float().view(-1, group_size)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if std_normalize:
        adv = adv / (groups.std(dim=1, keepdim=True, unbiased=False) + 1e-6)
    return adv.reshape(-1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig = LossConfig(),
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss to minimize and stats.

    logprobs (N, L): the current policy's logprobs of the rollout tokens (with grad);
    old_logprobs (N, L): the rollout's logprobs mu; advantages (N,); mask (N, L) 1 on
    generated tokens. ValueError on mismatched shapes, on L > cfg.max_tokens, or when
    kl_coef > 0 without ref_logprobs."""
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"shapes differ: logprobs {tuple(logprobs.shape)}, old {tuple(old_logprobs.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    n, length = logprobs.shape
    if advantages.shape != (n,):
        raise ValueError(f"advantages shape {tuple(advantages.shape)} != ({n},)")
    if length > cfg.max_tokens:
        raise ValueError(f"sequence length {length} exceeds max_tokens {cfg.max_tokens}")
    mask = mask.float()
    adv = advantages.float()[:, None].expand_as(logprobs)
    rho = torch.exp(logprobs - old_logprobs.detach())
    clipped = torch.clamp(rho, 1 - cfg.eps_low, 1 + cfg.eps_high)
    obj = torch.minimum(rho * adv, clipped * adv)
    # For A < 0 the PPO objective is unbounded below as rho grows: bound it at delta * A.
    obj = torch.where(adv < 0, torch.maximum(obj, cfg.delta * adv), obj)
    per_token = -obj
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        diff = ref_logprobs.detach() - logprobs
        per_token = per_token + cfg.kl_coef * (torch.exp(diff) - diff - 1)  # k3 estimator
    if cfg.norm == "max_tokens":
        loss = (per_token * mask).sum() / (n * cfg.max_tokens)
    elif cfg.norm == "tokens":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    else:
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    with torch.no_grad():
        valid = mask.sum().clamp(min=1)
        lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
        clip_frac = (((rho < lo) | (rho > hi)).float() * mask).sum() / valid
        stats = {
            "loss": float(loss),
            "ratio_mean": float((rho * mask).sum() / valid),
            "clip_fraction": float(clip_frac),
            "tokens": float(mask.sum()),
        }
    return loss, stats
