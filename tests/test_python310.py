"""covey declares Python >= 3.10 (pyproject's requires-python, ruff's target-version). There
is no CPU torch wheel for 3.10 here, so what runs under a 3.10 interpreter is what needs no
torch: every module byte-compiles, and, in a 3.10 venv holding only the light dependencies
(pydantic, typer, tomli and theirs, installed with no index), `covey --help` answers and
every shipped config loads through the config models.

The interpreter is `python3.10` on PATH or a pyenv 3.10; the wheels come from pip's own
find-links (pip.conf, PIP_FIND_LINKS) and, where set, the folder COVEY_PY310_WHEELS (e.g.
filled once by `pip download --python-version 3.10 --only-binary=:all: --dest DIR
'pydantic>=2.5,<3' 'typer>=0.12' 'tomli>=2.0'`). Nothing is downloaded here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
LIGHT = ("pydantic", "typer", "tomli")  # all that `covey --help` and covey.config import


def python310() -> Path | None:
    """A 3.10 interpreter that runs (a pyenv shim for a version not selected does not)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser() / "versions"
    candidates = [*sorted(pyenv.glob("3.10.*/bin/python3.10"), reverse=True)]
    on_path = shutil.which("python3.10")
    candidates += [Path(on_path)] if on_path else []
    for candidate in candidates:
        probe = subprocess.run(
            [str(candidate), "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == "(3, 10)":
            return candidate
    return None


PY310 = python310()
needs_310 = pytest.mark.skipif(
    PY310 is None, reason="no Python 3.10 interpreter (python3.10 on PATH or a pyenv 3.10.x)"
)


def _env(tmp_path: Path) -> dict[str, str]:
    """No PYTHONPATH but the checkout's, .pyc files kept out of the checkout, pip off every
    index."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {
        **env,
        "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache"),
        "PIP_NO_INDEX": "1",
        "PIP_NO_INPUT": "1",
    }


def _light_requirements() -> list[str]:
    """The light dependencies as pyproject pins them (markers dropped: this is 3.10)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    picked = [d.split(";")[0].strip() for d in deps if re.split(r"[<>=!~; ]", d)[0] in LIGHT]
    assert len(picked) == len(LIGHT), picked
    return picked


@needs_310
def test_every_module_byte_compiles_under_python_310(tmp_path: Path) -> None:
    assert PY310 is not None
    r = subprocess.run(
        [str(PY310), "-m", "compileall", "-q", str(ROOT / "covey"), str(ROOT / "tests"),
         str(ROOT / "scripts")],
        env=_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not list((ROOT / "covey").rglob("*.cpython-310.pyc"))  # went to the prefix


@pytest.mark.slow
@needs_310
def test_covey_help_and_every_shipped_config_under_python_310(tmp_path: Path) -> None:
    assert PY310 is not None
    env = _env(tmp_path)
    venv = tmp_path / "py310"
    r = subprocess.run(
        [str(PY310), "-m", "venv", "--without-pip", str(venv)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    python = venv / "bin" / "python"
    wheels = os.environ.get("COVEY_PY310_WHEELS")
    links = ["--find-links", wheels] if wheels else []
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
         "--no-cache-dir", "-q", *links, *_light_requirements()],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if install.returncode != 0:
        why = [line for line in install.stderr.splitlines() if line.startswith("ERROR")]
        pytest.skip(
            "the light dependencies have no Python 3.10 wheels reachable offline here "
            f"({(why or ['pip failed'])[-1]}); set COVEY_PY310_WHEELS to a folder of them"
        )
    env["PYTHONPATH"] = str(ROOT)  # the checkout's covey: pure Python, nothing to build
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def run(*args: str) -> str:
        r = subprocess.run(
            [str(python), *args], cwd=outside, env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return r.stdout

    version = run("-c", "import sys; print(sys.version_info[:2])")
    assert version.strip() == "(3, 10)"
    help_text = run("-m", "covey", "--help")
    for command in ("sim", "coordinator", "worker", "validator", "demo"):
        assert command in help_text
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from covey.config import load_run_config, load_sim_config\n"
        "root = Path(sys.argv[1])\n"
        "for p in sorted(root.glob('configs/*.toml')):\n"
        "    print(p.name, load_sim_config(p).config_hash())\n"
        "for p in sorted(root.glob('configs/network/*.toml')):\n"
        "    print(p.name, load_run_config(p).run_id)\n"
        "assert 'torch' not in sys.modules\n"
    )
    loaded = dict(line.split() for line in run("-c", probe, str(ROOT)).splitlines())
    shipped = [*ROOT.glob("configs/*.toml"), *ROOT.glob("configs/network/*.toml")]
    assert len(shipped) >= 7 and sorted(loaded) == sorted(p.name for p in shipped)
    # the same hashes as under this interpreter: the config models agree across versions
    from covey.config import load_run_config, load_sim_config

    for p in shipped:
        here = load_run_config(p).run_id if p.parent.name == "network" else None
        here = here or load_sim_config(p).config_hash()
        assert loaded[p.name] == here, p.name
