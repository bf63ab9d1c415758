"""A run's model and tokenizer files as one blob, so a worker needs no model files.

The coordinator packs the JSON files that define an `hf:<dir>` model (config.json) and an
`hf:<dir>` tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json) into
one canonical JSON document and publishes it on the blob plane by content id; a peer that
lacks the directories fetches the blob (verified against its id by the blob client),
checks it, and writes the files to a local directory. Only allow-listed JSON file names are
accepted and every file must parse as JSON: nothing received is code, and nothing is ever
executed (transformers loads them without trust_remote_code). Initial weights travel as
the run's initial state blob, like every other state.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

FORMAT = "covey-model-files-1"
MODEL_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_BUNDLE_BYTES = 64 << 20


def _dir_of(source: str) -> Path | None:
    return Path(source[3:]).expanduser() if source.startswith("hf:") else None


def bundle_model_files(model_source: str, tokenizer_source: str) -> bytes | None:
    """The bundle of a run's hf: model and tokenizer files, or None when neither is hf:."""
    parts: dict[str, dict[str, Any]] = {}
    for section, source, names in (
        ("model", model_source, MODEL_FILES),
        ("tokenizer", tokenizer_source, TOKENIZER_FILES),
    ):
        d = _dir_of(source)
        if d is None:
            continue
        parts[section] = {n: json.loads((d / n).read_text()) for n in names if (d / n).is_file()}
    if not parts:
        return None
    doc = {"format": FORMAT, **parts}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def unpack_model_files(data: bytes, dest: Path) -> dict[str, Path]:
    """Check a bundle and write its files under dest/model and dest/tokenizer. Returns the
    directories written, by section. ValueError for anything but allow-listed JSON files."""
    if len(data) > MAX_BUNDLE_BYTES:
        raise ValueError(f"model files bundle of {len(data)} bytes exceeds {MAX_BUNDLE_BYTES}")
    try:
        doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model files bundle is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"model files bundle: format is not {FORMAT!r}")
    allowed = {"model": MODEL_FILES, "tokenizer": TOKENIZER_FILES}
    unknown = sorted(set(doc) - {"format", *allowed})
    if unknown:
        raise ValueError(f"model files bundle: unexpected sections {unknown}")
    written: dict[str, Path] = {}
    for section, names in allowed.items():
        files = doc.get(section)
        if files is None:
            continue
        if not isinstance(files, dict) or not set(files) <= set(names):
            raise ValueError(
                f"model files bundle: {section} files must be among {list(names)}, "
                f"got {sorted(files) if isinstance(files, dict) else type(files).__name__}"
            )
        out = dest / section
        out.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            (out / name).write_text(json.dumps(content))
        written[section] = out
    return written


def missing_locally(model_source: str, tokenizer_source: str) -> bool:
    """Whether this machine lacks an hf: directory the run names (then it fetches them)."""
    m, t = _dir_of(model_source), _dir_of(tokenizer_source)
    return (m is not None and not (m / "config.json").is_file()) or (
        t is not None and not (t / "tokenizer.json").is_file()
    )


def publish_model_files(
    put: Callable[[bytes], str], model_source: str, tokenizer_source: str
) -> str | None:
    """The coordinator's side: store the bundle (`put` returns its content id), if any."""
    bundle = bundle_model_files(model_source, tokenizer_source)
    return put(bundle) if bundle is not None else None


def local_sources(
    model_cfg: Any, tokenizer: str, cid: str | None, fetch: Callable[[str], bytes]
) -> tuple[Any, str]:
    """The peer's side: (ModelConfig, tokenizer source) that build on this machine. When an
    hf: directory the run names is missing here, the run's bundle `cid` is fetched (bytes
    verified by `fetch`), checked and unpacked to a fresh local directory; a pretrained
    `init` is dropped there, since the initial weights arrive as the run's initial state.
    RuntimeError when files are missing and the coordinator publishes none."""
    if not missing_locally(model_cfg.spec, tokenizer):
        return model_cfg, tokenizer
    if cid is None:
        raise RuntimeError(
            f"model {model_cfg.spec} / tokenizer {tokenizer} are not on this machine and the "
            "coordinator publishes no model files"
        )
    written = unpack_model_files(fetch(cid), Path(tempfile.mkdtemp(prefix="covey-model-")))
    if "model" in written and model_cfg.spec.startswith("hf:"):
        model_cfg = model_cfg.model_copy(update={"source": f"hf:{written['model']}", "init": None})
    if "tokenizer" in written and tokenizer.startswith("hf:"):
        tokenizer = f"hf:{written['tokenizer']}"
    return model_cfg, tokenizer
