"""Supervised warm-up before RL: teach a small covey GPT the task's answer format.

`sft(task, out_dir, steps=..., minutes=..., seed=...)` trains a byte-level covey GPT on
"prompt answer\\n" strings of the task's TRAINING problems (the loss is on the answer
tokens only), then writes a policy directory:

- policy.json          format, the GPTConfig, tokenizer "bytes", eos id, the task, the
                       steps run and held-out pass@1 at the end;
- policy.safetensors   covey GPT parameters by name (what `load_policy` reads);
- config.json, model.safetensors, tokenizer files: the same weights as a Hugging Face
  GPT-2 (covey.io.export.gpt_to_gpt2), so covey's `hf:<dir>` model source and
  `covey generate` load it too (skipped with hf=False).

Deterministic for a seed on one machine and thread count: the init, the batches and the
order are all seeded. SFT is deliberately short: RL should start from a policy that
knows the format but is often wrong.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from covey.models.gpt import GPT, GPTConfig, gpt_config
from covey.rl.batch import byte_encode
from covey.rl.learn import ANSWER_EOS, pass_at_1
from covey.rl.tasks import ArithmeticTask, Task

POLICY_FORMAT = "covey-rl-policy-1"
# A ~0.4M-parameter GPT: big enough to learn 2-digit addition, small enough for CPU RL.
RL_POLICY = GPTConfig(block_size=32, vocab_size=256, n_layer=3, n_head=4, n_embd=96)


def policy_config(model: str | GPTConfig) -> GPTConfig:
    """A GPTConfig from a preset name ("nano", "micro", ..., or "rl" for RL_POLICY)."""
    if isinstance(model, GPTConfig):
        return model
    return RL_POLICY if model == "rl" else gpt_config(model)


def _answer(task: Task, index: int) -> str:
    answer = getattr(task, "answer", None)
    if not callable(answer):
        raise TypeError(f"task {task.name!r} has no reference answers; SFT needs answer(index)")
    return str(answer(index))


def _batch(
    task: Task, indices: list[int], encode: Callable[[str], list[int]], block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs (B, L), targets (B, L)) with targets -100 outside the answer tokens."""
    rows = []
    for i in indices:
        prompt = encode(task.prompt(i))
        seq = prompt + encode(_answer(task, i)) + [ANSWER_EOS]
        if len(seq) > block + 1:
            raise ValueError(f"example of {len(seq)} tokens exceeds block_size {block} + 1")
        rows.append((seq, len(prompt)))
    width = max(len(s) for s, _ in rows) - 1
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.full((len(rows), width), -100, dtype=torch.long)
    for j, (seq, p) in enumerate(rows):
        x[j, : len(seq) - 1] = torch.tensor(seq[:-1])
        y[j, p - 1 : len(seq) - 1] = torch.tensor(seq[p:])
    return x, y


def save_policy(model: GPT, out_dir: str | Path, meta: dict[str, Any], hf: bool = True) -> Path:
    """Write a policy directory (see the module doc) and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    tensors.pop("lm_head.weight", None)  # tied to wte.weight; safetensors refuses shared memory
    save_file(tensors, str(out / "policy.safetensors"))
    doc = {
        "format": POLICY_FORMAT,
        "model": model.cfg.to_dict(),
        "tokenizer": "bytes",
        "eos_id": ANSWER_EOS,
        **meta,
    }
    (out / "policy.json").write_text(json.dumps(doc, indent=2) + "\n")
    if hf:
        from transformers.utils import logging as hf_logging

        from covey.data.tokenizer import ByteTokenizer
        from covey.io.export import gpt_to_gpt2

        hf_logging.disable_progress_bar()  # a bar per shard: noise under sft's own bar

        converted = gpt_to_gpt2(model)
        converted.config.eos_token_id = ANSWER_EOS  # type: ignore[union-attr]
        converted.save_pretrained(str(out), safe_serialization=True)  # type: ignore[operator]
        ByteTokenizer().save(out)
    return out


def load_policy(directory: str | Path) -> tuple[GPT, dict[str, Any]]:
    """(covey GPT in eval mode, policy.json) from a policy directory. ValueError naming the
    directory when it is not one or its weights do not fit its config."""
    d = Path(directory)
    try:
        doc = json.loads((d / "policy.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{d} is not a policy directory (policy.json: {exc})") from exc
    if doc.get("format") != POLICY_FORMAT:
        raise ValueError(f"{d}/policy.json: format {doc.get('format')!r}, not {POLICY_FORMAT!r}")
    model = GPT(GPTConfig(**doc["model"]))
    tensors = load_file(str(d / "policy.safetensors"))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ValueError(f"{d}: weights do not fit: missing {missing}, unexpected {unexpected}")
    return model.eval(), doc


def sft(
    task: Task,
    out_dir: str | Path,
    *,
    steps: int | None = 500,
    minutes: float | None = None,
    seed: int = 0,
    model: str | GPTConfig = "rl",
    batch_size: int = 64,
    lr: float = 3e-3,
    eval_prompts: int = 200,
    hf: bool = True,
    progress: bool = False,
) -> Path:
    """Train a fresh covey GPT on the task's training answers for `steps` optimizer steps
    (or until `minutes` pass, whichever comes first; at least one must be set), write the
    policy directory `out_dir` and return it. Learning rate: linear warm-up over 5% of the
    steps, then constant. TypeError for a task without reference answers."""
    if steps is None and minutes is None:
        raise ValueError("sft needs steps or minutes")
    if (steps is not None and steps < 1) or (minutes is not None and minutes <= 0):
        raise ValueError(f"bad steps={steps} or minutes={minutes}")
    cfg = policy_config(model)
    torch.manual_seed(seed)
    policy = GPT(cfg)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    rng = random.Random(seed)
    warmup = max(1, (steps or 1000) // 20)
    deadline = time.monotonic() + 60 * minutes if minutes is not None else float("inf")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="sft", unit="step")
    done, loss_value = 0, float("nan")
    policy.train()
    while (steps is None or done < steps) and time.monotonic() < deadline:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (done + 1) / warmup)
        x, y = _batch(
            task, [rng.randrange(len(task)) for _ in range(batch_size)], byte_encode, cfg.block_size
        )
        logits = policy(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        done += 1
        loss_value = float(loss.detach())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
    if bar is not None:
        bar.close()
    policy.eval()
    meta: dict[str, Any] = {
        "seed": seed,
        "sft_steps": done,
        "sft_loss": loss_value,
        "task": _task_doc(task),
    }
    if hasattr(task, "test_prompts"):
        meta["pass_at_1"] = pass_at_1(policy, task, eval_prompts)
    return save_policy(policy, out_dir, meta, hf=hf)


def _task_doc(task: Task) -> dict[str, Any]:
    if isinstance(task, ArithmeticTask):
        return {
            "kind": "arithmetic",
            "seed": task.seed,
            "max_operand": task.max_operand,
            "ops": task.ops,
            "test_fraction": task.test_fraction,
        }
    return {"kind": task.name}
