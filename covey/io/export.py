"""Run directories in, Hugging Face directories out.

A run directory is what `covey sim --out` writes (summary.json with the config,
checkpoints/round-NNNNNN.safetensors, and copies of the model's config.json and the
tokenizer under model/ and tokenizer/) or a coordinator's --data-dir (coordinator.db holds
the run spec; checkpoints/ the certified states). `export_run` writes config.json,
model.safetensors, the tokenizer files and generation_config.json, which
`transformers.AutoModelForCausalLM.from_pretrained` loads without remote code.
A checkpoint is checked against the hash recorded when it was written (a sim run's
``<file>.sha256``, a coordinator's content id in coordinator.db) before it is read; one
written before hashes were kept loads unchecked. covey's own
GPT leaves as a GPT2LMHeadModel (exact GELU), with logits equal to covey's.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from covey.config import ModelConfig
from covey.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from covey.errors import UserError
from covey.guards import check_sha256, expected_sha256, sha256_file, write_sidecar
from covey.models.gpt import GPT
from covey.models.source import build_model, parse_source

STATE_FORMAT_PREFIX = "params/"  # covey.protocol.checkpoint's layout


@dataclass(frozen=True)
class RunArtifacts:
    """What a run directory says about its model: enough to rebuild and export it."""

    directory: Path
    model: ModelConfig
    tokenizer: str
    seed: int
    checkpoints: dict[int, Path]  # round -> file
    hashes: dict[int, str] = field(default_factory=dict)  # round -> sha256 when recorded

    def checkpoint(self, round: int | None = None) -> tuple[int, Path]:
        """The latest checkpoint, or round `round`'s; ValueError naming what exists."""
        if not self.checkpoints:
            raise ValueError(f"{self.directory} has no checkpoints/round-*.safetensors")
        r = max(self.checkpoints) if round is None else round
        if r not in self.checkpoints:
            raise ValueError(
                f"{self.directory} has no checkpoint of round {r}; "
                f"rounds: {sorted(self.checkpoints)}"
            )
        return r, self.checkpoints[r]

    def checked_checkpoint(self, round: int | None = None) -> tuple[int, Path]:
        """`checkpoint`, after its bytes are checked against the hash recorded for them;
        ValueError naming the file when they differ (a damaged file)."""
        r, path = self.checkpoint(round)
        try:
            check_sha256(path, self.hashes.get(r) or expected_sha256(path))
        except UserError as e:
            raise ValueError(str(e)) from None
        return r, path


def read_run(directory: str | Path) -> RunArtifacts:
    """The spec and checkpoints of a sim run dir or a coordinator data dir. The model and
    tokenizer copies a sim run keeps (model/, tokenizer/) win over the spec's paths, so a run
    dir moved to another machine still exports. ValueError when it is neither."""
    d = Path(directory)
    hashes: dict[int, str] = {}
    if (d / "summary.json").is_file():
        try:
            spec = json.loads((d / "summary.json").read_text()).get("config", {})
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{d}/summary.json is damaged ({e})") from None
    elif (d / "coordinator.db").is_file():
        try:
            db = sqlite3.connect(f"file:{d / 'coordinator.db'}?mode=ro", uri=True)
            try:
                row = db.execute("SELECT value FROM meta WHERE key = 'spec'").fetchone()
                # a coordinator's checkpoint is its state blob: the content id is its sha256
                tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
                if "checkpoints" in tables:
                    hashes = dict(db.execute("SELECT round, cid FROM checkpoints").fetchall())
            finally:
                db.close()
        except sqlite3.DatabaseError as e:
            raise ValueError(f"{d}/coordinator.db cannot be read ({e}): is it damaged?") from None
        if row is None:
            raise ValueError(f"{d}/coordinator.db holds no run spec yet")
        spec = json.loads(row[0])
    else:
        raise ValueError(f"{d} is not a run directory (no summary.json or coordinator.db)")
    model = ModelConfig.model_validate(spec.get("model", {}))
    tokenizer = spec.get("data", {}).get("tokenizer", "bytes")
    if (d / "model" / "config.json").is_file() and parse_source(model.spec)[0] == "hf":
        model = model.model_copy(update={"source": f"hf:{d / 'model'}", "init": None})
    if (d / "tokenizer" / "tokenizer.json").is_file() and tokenizer != "bytes":
        tokenizer = f"hf:{d / 'tokenizer'}"
    checkpoints = {
        int(p.stem.split("-")[1]): p for p in (d / "checkpoints").glob("round-*.safetensors")
    }
    return RunArtifacts(d, model, tokenizer, int(spec.get("seed", 0)), checkpoints, hashes)


def save_run_artifacts(
    directory: Path, model_cfg: ModelConfig, tokenizer: str, state_bytes: bytes, round: int
) -> Path:
    """What `covey sim` keeps for export: the final state (covey.protocol.checkpoint bytes)
    as a checkpoint, and copies of the model's config.json and the tokenizer's files.
    Returns the checkpoint's path."""
    (directory / "checkpoints").mkdir(parents=True, exist_ok=True)
    path = directory / "checkpoints" / f"round-{round:06d}.safetensors"
    path.write_bytes(state_bytes)
    write_sidecar(path, sha256_file(path))  # checked when the checkpoint is loaded
    kind, rest = parse_source(model_cfg.spec)
    if kind == "hf":
        (directory / "model").mkdir(exist_ok=True)
        shutil.copyfile(
            Path(rest).expanduser() / "config.json", directory / "model" / "config.json"
        )
    if tokenizer != "bytes":
        load_tokenizer(tokenizer).save(directory / "tokenizer")
    return path


def load_checkpoint_into(model: nn.Module, path: Path) -> None:
    """Copy a covey state file's parameters into `model`; ValueError on any name or shape
    mismatch (the run dir does not belong to this model) or a file that is not one."""
    from safetensors import SafetensorError

    try:
        tensors = load_file(str(path))
    except SafetensorError as e:
        raise ValueError(f"{path} is damaged or truncated ({e}); use another round") from None
    params = {
        k[len(STATE_FORMAT_PREFIX) :]: v
        for k, v in tensors.items()
        if k.startswith(STATE_FORMAT_PREFIX)
    }
    names = dict(model.named_parameters())
    if set(params) != set(names):
        missing = sorted(set(names) - set(params))[:3]
        extra = sorted(set(params) - set(names))[:3]
        raise ValueError(f"{path}: parameters differ: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for name, p in names.items():
            if params[name].shape != p.shape:
                raise ValueError(
                    f"{path}: {name} is {tuple(params[name].shape)}, not {tuple(p.shape)}"
                )
            p.copy_(params[name])


def gpt_to_gpt2(model: GPT) -> nn.Module:
    """covey's GPT as a transformers GPT2LMHeadModel with the same function: Conv1D weights
    are covey's Linear weights transposed, and GELU is exact (`gelu`, not GPT-2's tanh)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.cfg
    config = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = GPT2LMHeadModel(config)
    src = dict(model.named_parameters())
    mapping: dict[str, tuple[str, bool]] = {
        "transformer.wte.weight": ("wte.weight", False),
        "transformer.wpe.weight": ("wpe.weight", False),
        "transformer.ln_f.weight": ("ln_f.weight", False),
        "transformer.ln_f.bias": ("ln_f.bias", False),
    }
    for i in range(c.n_layer):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for hf_name, ours in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
            mapping[f"{h}{hf_name}.weight"] = (f"{b}{ours}.weight", False)
            mapping[f"{h}{hf_name}.bias"] = (f"{b}{ours}.bias", False)
        for hf_name, ours in (
            ("attn.c_attn", "attn.qkv"),
            ("attn.c_proj", "attn.proj"),
            ("mlp.c_fc", "mlp.fc"),
            ("mlp.c_proj", "mlp.proj"),
        ):
            mapping[f"{h}{hf_name}.weight"] = (f"{b}{ours}.weight", True)  # Conv1D: (in, out)
            mapping[f"{h}{hf_name}.bias"] = (f"{b}{ours}.bias", False)
    dst = dict(hf.named_parameters())
    with torch.no_grad():
        for name, (ours, transpose) in mapping.items():
            t = src[ours].t() if transpose else src[ours]
            dst[name].copy_(t)
    return hf


def export_run(run_dir: str | Path, out: str | Path, round: int | None = None) -> dict[str, Any]:
    """Write a Hugging Face directory for a run's checkpoint (latest, or `round`).
    Returns what was exported. ValueError for a py: model (no standard form) or a
    checkpoint that does not match the run's model."""
    run = read_run(run_dir)
    r, path = run.checked_checkpoint(round)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per shard: noise for a CLI
    tok = load_tokenizer(run.tokenizer)
    kind, _ = parse_source(run.model.spec)
    if kind == "py":
        raise ValueError(
            f"model {run.model.spec}: a Python factory has no Hugging Face form; load "
            f"{path} (params/<name> tensors) into your module instead"
        )
    vocab = tok.vocab_size if kind == "covey" and tok.vocab_size != 256 else None
    model, _, info = build_model(run.model.spec, run.seed, vocab_size=vocab)
    load_checkpoint_into(model, path)
    hf = gpt_to_gpt2(model) if isinstance(model, GPT) else model
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf.config.use_cache = True  # type: ignore[union-attr]  # inference wants the KV cache
    hf.config.eos_token_id = tok.eos_id  # type: ignore[union-attr]
    hf.save_pretrained(str(out), safe_serialization=True)  # type: ignore[operator]
    tok.save(out)
    _generation_config(hf, tok).save_pretrained(str(out))
    return {"round": r, "checkpoint": str(path), "source": info.source, "out": str(out)}


def _generation_config(model: nn.Module, tok: ByteTokenizer | HFTokenizer) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        eos_token_id=tok.eos_id,
        pad_token_id=tok.eos_id,
        do_sample=True,
        temperature=1.0,
        max_new_tokens=64,
    )


def save_sim_run(directory: Path, cfg: Any, state: Any) -> Path:
    """`covey sim`'s hook: keep a SimConfig run's final TrainState for export."""
    from covey.protocol.checkpoint import state_to_bytes

    return save_run_artifacts(
        Path(directory), cfg.model, cfg.data.tokenizer, state_to_bytes(state), state.round
    )
