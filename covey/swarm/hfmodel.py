"""Stages of a Hugging Face decoder (`model = "hf:DIR"`) for stage servers and referees.

A server loads only its own stage: the model is built on the meta device (no memory for
its weights), cut by the run's plan (covey.swarm.plan), and only the stage's parameters are
materialized and read from the directory's *.safetensors files by tensor name
(`safe_open`, which reads just those tensors). Without weights in the directory the run
starts from random init seeded by the run seed; that needs the whole model built once
(the same weights on every peer), then every tensor outside the stage is dropped.
Local files only; a config that names remote code is refused (covey.models.hf).

Tokens are the run's tokenizer's (SwarmConfig.tokenizer: by default the model's own
tokenizer.json when the directory has one where the spec is made; trainers check that it
fits the embedding), else covey's byte stream (ids < 256), and then the model's vocabulary
must have at least 256 rows; the run's seq_len must fit its positions.
Errors name the values.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from covey.models.hf import ModelSourceError, hf_config, max_positions, read_hf_config
from covey.swarm.plan import StageModule, plan_stages, stage_modules

BYTE_VOCAB = 256
# transformers' lazy imports are not thread-safe: two threads importing it for the first
# time at once get "cannot import name 'CONFIG_MAPPING'" (seen in the coordinator, whose
# request threads build stages for round checks). Building also seeds torch's global RNG.
# So a process builds one HF stage at a time.
_BUILD = threading.RLock()


def model_digest(directory: str | Path) -> str:
    """sha256 of `directory`'s config.json as canonical JSON and of each *.safetensors
    file's bytes (ModelSourceError if the config is bad). The weights are in it: a server
    loads them only when they are the run's, so a coordinator cannot have a server load a
    private model of the same architecture and publish it as its stage state."""
    raw = read_hf_config(directory)
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    files = _weights(Path(directory).expanduser())
    if not files:  # random init from the seed: the config alone (as before weights counted)
        return hashlib.sha256(canonical.encode()).hexdigest()
    h = hashlib.sha256(canonical.encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.name}|{_file_sha256(str(f), st.st_size, st.st_mtime_ns)}".encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """A weight file's sha256, once per (path, size, mtime): a server builds a stage at
    every move and resync, and big models' weights take seconds to hash."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def hf_stage_plan(config: Any, stages: int) -> list[list[int]]:
    """Blocks per stage: equal-cost blocks cut into `stages` contiguous stages."""
    n = int(config.num_hidden_layers)
    if stages > n:
        raise ValueError(f"stages ({stages}) cannot be greater than the model's layers ({n})")
    return plan_stages([1.0] * n, stages)


def check_fits(config: Any, seq_len: int, byte_tokens: bool = True) -> None:
    """ValueError naming the values when byte tokens or seq_len do not fit `config`."""
    if byte_tokens and int(config.vocab_size) < BYTE_VOCAB:
        raise ValueError(
            f"vocab_size ({config.vocab_size}) must be at least {BYTE_VOCAB}: SWARM trainers "
            "send covey's byte tokens"
        )
    positions = max_positions(config)
    if positions is not None and seq_len > positions:
        raise ValueError(f"seq_len ({seq_len}) exceeds the model's positions ({positions})")


def _weights(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _names_by_param(model: nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter (a tied weight has two)."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


def load_stage_module(directory: str | Path, seed: int, stages: int, k: int) -> StageModule:
    """Stage `k` of the decoder in `directory`, with its own copy of every tensor.

    Weights from *.safetensors by name when the directory has them (only this stage's
    tensors are read), else the seed's random init. ModelSourceError / ValueError name the
    directory, stage or tensor that does not fit.
    """
    with _BUILD:
        return _load_stage_module(directory, seed, stages, k)


def _load_stage_module(directory: str | Path, seed: int, stages: int, k: int) -> StageModule:
    from transformers import AutoModelForCausalLM

    d = Path(directory).expanduser()
    config = hf_config(d)
    plan = hf_stage_plan(config, stages)
    if not 0 <= k < stages:
        raise ValueError(f"stage {k}; this run has stages 0..{stages - 1}")
    files = _weights(d)
    if not files:  # random init must equal every other peer's: build it whole, seeded
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.config.use_cache = False
        module = stage_modules(model, plan)[k]
        _own_copies(module)
        return module.eval()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    names = _names_by_param(model)
    module = stage_modules(model, plan)[k]
    wanted = {id(p): names[id(p)] for p in module.parameters()}
    found: dict[int, torch.Tensor] = {}
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            keys = set(sf.keys())
            for pid, ns in wanted.items():
                if pid not in found and (hit := next((n for n in ns if n in keys), None)):
                    found[pid] = sf.get_tensor(hit).to(torch.float32)
    params = dict(module.named_parameters())
    for name, p in params.items():
        t = found.get(id(p))
        if t is None or t.shape != p.shape:
            raise ModelSourceError(
                f"{d}: stage {k} needs {names[id(p)][0]} of shape {tuple(p.shape)}; "
                f"the safetensors files hold {None if t is None else tuple(t.shape)}"
            )
        _set(module, name, nn.Parameter(t.clone()))
    # rotary frequencies are computed, not stored: rebuild them on the CPU
    if getattr(module, "rotary_emb", None) is not None:
        module.rotary_emb = type(module.rotary_emb)(config=config)  # type: ignore[assignment]
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise ModelSourceError(f"{d}: stage {k} could not materialize {left}")
    return module.eval()


def _own_copies(module: nn.Module) -> None:
    """Untie shared weights (lm_head/embedding): a server trains its own copy."""
    for name, p in list(module.named_parameters()):
        _set(module, name, nn.Parameter(p.detach().clone()))


def _set(module: nn.Module, name: str, p: nn.Parameter) -> None:
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    setattr(module, leaf, p)


def token_embedding(directory: str | Path, seed: int) -> torch.Tensor:
    """The model's input token embedding (vocab, hidden) at the run's start: read by name
    from the safetensors files (that tensor only), or the seed's random init. The subspace
    codec's fixed token term (covey.swarm.subspace)."""
    with _BUILD:
        return _token_embedding(Path(directory).expanduser(), seed)


def _token_embedding(d: Path, seed: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    config = hf_config(d)
    files = _weights(d)
    if not files:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return model.get_input_embeddings().weight.detach().clone()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ns = _names_by_param(model)[id(model.get_input_embeddings().weight)]
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            if hit := next((n for n in ns if n in set(sf.keys())), None):
                return sf.get_tensor(hit).to(torch.float32)
    raise ModelSourceError(f"{d}: no tensor {ns[0]} (the token embedding) in {len(files)} files")


def build_hf_stage(cfg: Any, k: int, device: torch.device | str = "cpu") -> Any:
    """Stage `k` of the run's `hf:DIR` model on `device` as a Stage with AdamW, the
    same as covey.swarm.wire.build_stage makes for covey's GPT. ValueError when the
    directory's config.json is not the one the run names (`model_digest`), or the model
    does not fit byte tokens and seq_len."""
    directory = str(cfg.model)[3:]
    with _BUILD:
        return _build_hf_stage(cfg, k, directory, device)


def _build_hf_stage(cfg: Any, k: int, directory: str, device: torch.device | str) -> Any:
    from covey.swarm.optim import AdamW
    from covey.swarm.stage import Stage

    if cfg.model_digest and (got := model_digest(directory)) != cfg.model_digest:
        raise ValueError(
            f"{directory} (config.json and weights) has digest {got[:12]}, the run names "
            f"{cfg.model_digest[:12]}"
        )
    bytes_ = not cfg.tokenizer.startswith("hf:")
    check_fits(hf_config(directory), cfg.seq_len, byte_tokens=bytes_)
    module = load_stage_module(directory, cfg.seed, cfg.stages, k).to(device)
    lr = cfg.lr
    return Stage(
        module,
        lambda ps: AdamW(ps, lr=lr),  # type: ignore[arg-type,return-value]
        target_samples=cfg.target_samples,
        last=k == cfg.stages - 1,
    )
