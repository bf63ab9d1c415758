"""The documentation: the site (mkdocs.yml, docs/) builds with --strict, so a broken link,
a missing anchor or a page left out of the navigation fails; and the generated reference
pages (docs/reference/) are what scripts/gen_reference.py writes from the code today."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _generator() -> ModuleType:  # scripts/ is not a package: load the script by its path
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts" / "gen_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_pages_are_what_the_generator_writes() -> None:
    for path, text in _generator().pages().items():
        assert path.exists() and path.read_text() == text, (
            f"{path.relative_to(ROOT)} is out of date: run `python scripts/gen_reference.py`"
        )


def test_the_references_name_every_command_and_every_config_field() -> None:
    from covey.config import RunConfig

    pages = _generator().pages()
    cli = next(t for p, t in pages.items() if p.name == "cli.md")
    for command in ("covey coordinator", "covey worker", "covey validator", "covey rl trainer",
                    "covey swarm server", "covey bench comms", "covey ledger verify"):  # fmt: skip
        assert f"`{command}`" in cli, command
    assert "`--coordinator <str>`" in cli
    config = next(t for p, t in pages.items() if p.name == "config.md")
    for name in RunConfig.model_fields:
        assert f"| `{name}` |" in config, name
    assert "| `sample_rate` |" in config and "`[algorithm.optim]`" in config


def test_the_site_builds_strictly_offline(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    index = (tmp_path / "site" / "index.html").read_text()
    assert "fonts.googleapis.com" not in index and "fonts.gstatic.com" not in index
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()


def test_no_page_names_an_issue_a_session_or_a_file_outside_the_repository() -> None:
    docs = ROOT / "docs"
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted(docs.glob("*.md"))]
    pages += sorted((docs / "reference").glob("*.md"))
    pattern = re.compile(r"\bissue \d|\bsession \d|\bDESIGN\.md|/work/", re.I)
    found = [f"{p.name}: {m.group(0)}" for p in pages for m in pattern.finditer(p.read_text())]
    assert not found, found
