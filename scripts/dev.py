#!/usr/bin/env python3
"""Set up covey in ./.venv and run the demo or the tests. Needs only Python >= 3.10.

    python3 scripts/dev.py demo     # set up, then `covey demo`
    python3 scripts/dev.py test     # set up with test extras, then ruff + pytest
    python3 scripts/dev.py test --all   # ... including the long end-to-end tests
    python3 scripts/dev.py setup    # set up only

PyTorch is installed first, as the CPU build (`torch==2.13.0`, which the package index
here serves as a CPU wheel; elsewhere, PyTorch's CPU index), so that resolving covey's
`torch>=2.4` never pulls the multi-GB CUDA wheels. Re-running skips what is installed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
TORCH = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def run(*cmd: str | Path, check: bool = True) -> int:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(list(map(str, cmd)), cwd=ROOT, check=check).returncode


def pip(*args: str, check: bool = True) -> int:
    return run(PY, "-m", "pip", "install", "--disable-pip-version-check", *args, check=check)


def has_torch() -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.__version__ >= '2.4' else 1)"
    return subprocess.run([PY, "-c", probe], capture_output=True).returncode == 0


def setup(extras: str) -> None:
    if sys.version_info < (3, 10):  # noqa: UP036 - this script runs before any check
        sys.exit(f"covey needs Python >= 3.10; this is {sys.version.split()[0]}")
    if not PY.exists():
        print(f"creating virtual environment {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp = VENV / ".covey-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + extras.encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == want and has_torch():
        return
    if not has_torch() and pip("-q", TORCH, check=False) != 0:
        print(f"{TORCH} not available here; trying PyTorch's CPU index", flush=True)
        pip("-q", "torch>=2.4", "--index-url", TORCH_CPU_INDEX)
    pip("-q", "-e", f".{extras}")
    stamp.write_text(want)


def main() -> None:
    task = sys.argv[1] if len(sys.argv) > 1 else "demo"
    rest = sys.argv[2:]
    if task == "setup":
        setup("[test]")
    elif task == "demo":
        setup("[plots]")  # the demo's loss.png needs matplotlib
        sys.exit(run(BIN / "covey", "demo", *rest, check=False))
    elif task == "test":
        setup("[test]")
        # tests/test_dashboard.py drives headless Chromium; as root with apt-get, install it.
        run(PY, ROOT / "tests" / "browser.py", "install", check=False)
        if run(PY, "-m", "ruff", "check", "covey", "tests", "scripts", check=False):
            sys.exit("ruff found problems (see above)")
        if "--all" in rest:  # also the long end-to-end tests (marked `long`)
            rest = ["-m", "", *(a for a in rest if a != "--all")]
        sys.exit(run(PY, "-m", "pytest", "-q", *rest, check=False))
    else:
        sys.exit(f"usage: python3 scripts/dev.py [demo|test|setup] [args...]; got {task!r}")


if __name__ == "__main__":
    main()
