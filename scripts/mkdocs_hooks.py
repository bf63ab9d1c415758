"""MkDocs hook: publishes the repository's BENCHMARKS.md as the site's benchmarks/index.md.

BENCHMARKS.md stays at the repository root (where a reader of the source finds it) and is
the one copy; its links are written from the root (`docs/benchmarks/2026-11-27.md`), so
they are rewritten here to be relative to `docs/benchmarks/`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = "benchmarks/index.md"


def site_markdown(text: str) -> str:
    """BENCHMARKS.md's text with its repository-root links made relative to benchmarks/."""
    text = re.sub(r"\]\(docs/benchmarks/", "](", text)
    return re.sub(r"\]\(docs/", "](../", text)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    content = site_markdown((ROOT / "BENCHMARKS.md").read_text())
    files.append(File.generated(config, PAGE, content=content))
    return files
