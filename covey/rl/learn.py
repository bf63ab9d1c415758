"""The trainer's learning step: GRPO-family updates from verified rollout batches.

`Learner.step(batches, version)` takes the verified batches the trainer has, each with the
policy version that generated it, drops those older than `version - async_level` (they are
counted, never trained on), recomputes the current policy's token logprobs at the rollouts'
temperature, and takes one optimizer step on `covey.rl.loss.grpo_loss` (group-relative
advantages, token-level ratio against the rollout's logprobs, two-sided clipping, a fixed
token budget as normalizer). Staleness is what the ratio corrects: a batch from version
v - k was sampled from mu = pi_{v-k}, and rho = pi_v / mu re-weights it (INTELLECT-2,
arXiv:2505.07291, section 3).

`pass_at_1(policy, task, n_prompts)` scores the policy on held-out prompts (greedy by
default), the number the learning benchmark and the RL status page report.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from covey.devices import autocast
from covey.rl import sampling
from covey.rl.batch import RolloutBatch, byte_decode, byte_encode, completion_text
from covey.rl.loss import LossConfig, group_advantages, grpo_loss
from covey.rl.tasks import Task

ANSWER_EOS = 10  # "\n": an arithmetic answer ends at the first newline (tasks.completion_answer)
# The one default GRPO learning rate: `covey bench rl`, `covey rl demo` and a trainer's
# RLSpec (covey.rl.runspec) all start from it. 2e-4 is what the recorded benchmark learned
# with (+45 held-out points in 16 CPU minutes); in that sweep 4e-4 learned slower and 1e-3
# destroyed the SFT start (17% -> 4% in 10 steps). The demo's former 3e-4 was never compared.
DEFAULT_LR = 2e-4


@dataclass(frozen=True)
class LearnConfig:
    """How the trainer learns. The loss fields go to `covey.rl.loss.LossConfig`."""

    lr: float = DEFAULT_LR  # AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    temperature: float = 1.0  # the rollouts' sampling temperature (their logprobs are at T)
    async_level: int = 2  # a batch from version v trains steps up to v + async_level
    epochs: int = 1  # optimizer steps per call on the same batches (PPO-style reuse)
    # sequences per forward/backward: memory, not math (with loss.norm="tokens" each
    # micro-batch divides by its own tokens, exact only when it holds the whole step)
    micro_batch: int = 64
    skip_uniform_groups: bool = False  # drop groups whose G rewards are all equal (A = 0)
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError(
                f"bad lr={self.lr}, grad_clip={self.grad_clip}, weight_decay={self.weight_decay}"
            )
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.async_level < 0 or self.epochs < 1 or self.micro_batch < 1:
            raise ValueError(
                f"bad async_level={self.async_level}, epochs={self.epochs}, "
                f"micro_batch={self.micro_batch}"
            )


@dataclass(frozen=True)
class _Rows:
    """The trainable rows of one step: prompt + completion ids with their rollout data."""

    seqs: list[list[int]]
    prompt_lens: list[int]
    old_logprobs: list[list[float]]
    advantages: torch.Tensor  # (N,)
    rewards: torch.Tensor  # (N,)
    staleness: torch.Tensor  # (N,) version - generating version


class Learner:
    """Owns the policy's optimizer; `step` is the only thing that changes the policy.

    `task` gives the prompt text of a batch's prompt indices (batches carry indices, not
    text); `encode` must be the tokenizer the workers used (bytes by default)."""

    def __init__(
        self,
        policy: nn.Module,
        cfg: LearnConfig,
        task: Task,
        *,
        encode: Callable[[str], list[int]] = byte_encode,
    ) -> None:
        self.policy = policy
        self.cfg = cfg
        self.task = task
        self.encode = encode
        self.optimizer = torch.optim.AdamW(
            policy.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.precision = "fp32"  # "bf16": the forward in bf16 autocast (covey.devices)
        self.steps = 0
        self.dropped_stale = 0  # batches dropped for staleness over the learner's life

    def _rows(self, batches: list[tuple[RolloutBatch, int]], version: int) -> tuple[_Rows, int]:
        seqs: list[list[int]] = []
        prompt_lens: list[int] = []
        old: list[list[float]] = []
        adv: list[torch.Tensor] = []
        rewards: list[torch.Tensor] = []
        stale: list[int] = []
        dropped = 0
        for batch, made_by in batches:
            if made_by > version:
                raise ValueError(f"batch from policy version {made_by} > current {version}")
            if made_by < version - self.cfg.async_level:
                dropped += 1
                continue
            g = batch.group_size
            if len(batch.samples) != len(batch.prompt_indices) * g:
                raise ValueError(
                    f"batch of {len(batch.samples)} samples is not "
                    f"{len(batch.prompt_indices)} prompts x G={g}"
                )
            r = torch.tensor([s.reward for s in batch.samples], dtype=torch.float32)
            a = group_advantages(r, g, self.cfg.loss.std_normalize)
            prompts = {p: self.encode(self.task.prompt(p)) for p in set(batch.prompt_indices)}
            for i, s in enumerate(batch.samples):
                group = r[(i // g) * g : (i // g + 1) * g]
                if self.cfg.skip_uniform_groups and bool((group == group[0]).all()):
                    continue
                if len(s.tokens) > self.cfg.loss.max_tokens:
                    raise ValueError(
                        f"sample of {len(s.tokens)} tokens exceeds max_tokens "
                        f"{self.cfg.loss.max_tokens}"
                    )
                prompt = prompts[batch.prompt_indices[i // g]]
                seqs.append(prompt + list(s.tokens))
                prompt_lens.append(len(prompt))
                old.append(list(s.logprobs))
                adv.append(a[i])
                rewards.append(r[i])
                stale.append(version - made_by)
        rows = _Rows(
            seqs,
            prompt_lens,
            old,
            torch.stack(adv) if adv else torch.zeros(0),
            torch.stack(rewards) if rewards else torch.zeros(0),
            torch.tensor(stale, dtype=torch.float32),
        )
        return rows, dropped

    def _token_logprobs(
        self, seqs: list[list[int]], prompt_lens: list[int], width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, width) logprobs at temperature T of each completion token under the current
        policy (with grad), and the (n, width) mask of real tokens."""
        device = next(self.policy.parameters()).device
        total = max(len(s) for s in seqs) - 1
        # built on the policy's device: nothing per token is computed on the host
        ids = torch.zeros(len(seqs), total, dtype=torch.long, device=device)
        targets = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        index = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(seqs), width, device=device)
        for j, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
            ids[j, : len(s) - 1] = torch.tensor(s[:-1])
            n = len(s) - p
            targets[j, :n] = torch.tensor(s[p:])
            # completion token t sits at position p + t and is predicted at p + t - 1
            index[j, :n] = torch.arange(p - 1, p - 1 + n, device=device)
            mask[j, :n] = 1.0
        with autocast(device, self.precision):
            logits, _ = sampling.forward_hidden(self.policy, ids)
        picked = logits.gather(1, index[:, :, None].expand(-1, -1, logits.size(-1)))
        logp = F.log_softmax(picked / self.cfg.temperature, dim=-1)
        return logp.gather(2, targets[:, :, None])[:, :, 0], mask

    def step(self, batches: list[tuple[RolloutBatch, int]], version: int) -> dict[str, float]:
        """One learning step at policy `version` on verified `batches` (each with the version
        that generated it). Stale batches (older than version - async_level) are dropped
        and counted in "dropped_stale"; when nothing trainable is left, the policy is not
        touched and "updated" is 0. ValueError on a batch from a future version, a malformed
        batch, or a completion longer than the loss's max_tokens."""
        rows, dropped = self._rows(batches, version)
        self.dropped_stale += dropped
        n = len(rows.seqs)
        stats: dict[str, float] = {
            "samples": float(n),
            "batches": float(len(batches) - dropped),
            "dropped_stale": float(dropped),
            "reward_mean": float(rows.rewards.mean()) if n else 0.0,
            "staleness_mean": float(rows.staleness.mean()) if n else 0.0,
            "updated": 0.0,
        }
        if n == 0:
            return stats
        device = next(self.policy.parameters()).device
        width = max(len(s) - p for s, p in zip(rows.seqs, rows.prompt_lens, strict=True))
        old = torch.zeros(n, width, device=device)
        for j, lp in enumerate(rows.old_logprobs):
            old[j, : len(lp)] = torch.tensor(lp)
        self.policy.train()
        totals = {"loss": 0.0, "ratio_mean": 0.0, "clip_fraction": 0.0, "tokens": 0.0}
        grad_norm = 0.0
        for _ in range(self.cfg.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for start in range(0, n, self.cfg.micro_batch):
                part = slice(start, min(n, start + self.cfg.micro_batch))
                logp, mask = self._token_logprobs(rows.seqs[part], rows.prompt_lens[part], width)
                loss, part_stats = grpo_loss(
                    logp,
                    old[part],
                    rows.advantages[part].to(device),
                    mask,
                    self.cfg.loss,
                )
                # grpo_loss divides by (its rows x max_tokens); re-weight to the whole step's
                # fixed budget (n x max_tokens) so micro-batching does not change the math.
                share = logp.shape[0] / n
                (loss * share).backward()
                totals["loss"] += part_stats["loss"] * share / self.cfg.epochs
                for key in ("ratio_mean", "clip_fraction"):
                    totals[key] += part_stats[key] * part_stats["tokens"]
                totals["tokens"] += part_stats["tokens"]
            if self.cfg.grad_clip > 0:
                norm = nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.grad_clip)
                grad_norm = float(norm)
            self.optimizer.step()
        self.policy.eval()
        self.steps += 1
        tokens = max(totals["tokens"], 1.0)
        stats.update(
            loss=totals["loss"],
            ratio_mean=totals["ratio_mean"] / tokens,
            clip_fraction=totals["clip_fraction"] / tokens,
            tokens=totals["tokens"] / self.cfg.epochs,
            grad_norm=grad_norm,
            updated=1.0,
        )
        return stats


def held_out(task: Task, n_prompts: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n_prompts` (prompt, answer) pairs drawn (seeded, without replacement) from the
    task's held-out split, in a fixed order. TypeError for a task without one."""
    test = getattr(task, "test_prompts", None)
    if not callable(test):
        raise TypeError(f"task {task.name!r} has no held-out prompts (test_prompts)")
    pairs: list[tuple[str, str]] = test()
    if n_prompts <= 0:
        raise ValueError(f"n_prompts must be > 0, got {n_prompts}")
    if n_prompts >= len(pairs):
        return list(pairs)
    return sorted(random.Random(seed).sample(pairs, n_prompts))


@torch.no_grad()
def greedy_completions(
    policy: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None = ANSWER_EOS,
) -> list[list[int]]:
    """Greedy (argmax) completions, batched over prompts of equal length (covey's GPT has
    absolute positions, so prompts are never padded); each stops after `eos_id`."""
    device = next(policy.parameters()).device
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for members in by_len.values():
        ids = torch.tensor([prompts[i] for i in members], device=device)
        done = torch.zeros(len(members), dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            logits, _ = sampling.forward_hidden(policy, ids)
            nxt = logits[:, -1].argmax(dim=-1)
            for row, i in enumerate(members):
                if not done[row]:
                    out[i].append(int(nxt[row]))
            if eos_id is not None:
                done |= nxt == eos_id
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    return out


def pass_at_1(
    policy: nn.Module,
    task: Task,
    n_prompts: int,
    temperature: float = 0.0,
    *,
    seed: int = 0,
    max_new_tokens: int = 6,
    eos_id: int | None = ANSWER_EOS,
    encode: Callable[[str], list[int]] = byte_encode,
    decode: Callable[[list[int]], str] = byte_decode,
) -> float:
    """The fraction of `n_prompts` held-out prompts (see `held_out`) answered exactly:
    greedy when temperature is 0, else one seeded Gumbel sample per prompt at that
    temperature. A prompt counts when the task scores its completion 1.0."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    pairs = held_out(task, n_prompts, seed)
    prompts = [encode(p) for p, _ in pairs]
    was_training = policy.training
    policy.eval()
    try:
        if temperature == 0:
            outs = greedy_completions(policy, prompts, max_new_tokens, eos_id)
        else:
            outs = [
                sampling.generate(
                    policy,
                    p,
                    max_new_tokens,
                    temperature,
                    sampling.sample_seed("covey-pass-at-1", seed, "eval", i, 0),
                    eos_id,
                ).tokens
                for i, p in enumerate(prompts)
            ]
    finally:
        policy.train(was_training)
    score = getattr(task, "score", None)
    correct = 0
    for (_, answer), tokens in zip(pairs, outs, strict=True):
        text = completion_text(tokens, eos_id, decode)
        ok = score(answer, text) >= 1.0 if callable(score) else text.strip() == answer
        correct += int(ok)
    return correct / len(pairs)
