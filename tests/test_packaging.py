"""Packaging: version, license, extras a worker can leave out, the built wheel's contents,
the sdist and wheel built offline and the wheel installed in a fresh venv running `covey`,
the README's links, and the Dockerfile + compose.yaml (built where a docker engine runs).
Python 3.10: tests/test_python310.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

import covey

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_version_license_and_classifiers() -> None:
    project = pyproject()["project"]
    assert covey.__version__ == project["version"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    classifiers = project["classifiers"]
    assert "License :: OSI Approved :: Apache Software License" in classifiers
    oldest = re.fullmatch(r">=3\.(\d+)", project["requires-python"])
    assert oldest, project["requires-python"]
    here = sys.version_info.minor
    for minor in range(int(oldest.group(1)), max(here, 13) + 1):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers


def test_a_worker_installs_no_plotting_tracking_or_crosscheck_packages() -> None:
    project = pyproject()["project"]
    base = names(project["dependencies"])
    extras = project["optional-dependencies"]
    for optional in ("matplotlib", "torchft", "tensorboard", "wandb"):
        assert optional not in base
    assert names(extras["plots"]) == {"matplotlib"}
    assert names(extras["crosscheck"]) == {"torchft"}
    assert names(extras["tensorboard"]) == {"tensorboard"}
    assert names(extras["wandb"]) == {"wandb"}
    assert {"matplotlib", "torchft", "tensorboard", "pytest", "ruff", "build"} <= names(
        extras["test"]
    )


def test_worker_and_coordinator_import_without_matplotlib() -> None:
    probe = (
        "import sys; sys.modules['matplotlib'] = None\n"  # None: `import matplotlib` fails
        "import covey.cli, covey.peer.worker, covey.peer.validator, covey.coordinator.app\n"
        "import covey.sim.simulator, covey.local.demo_report\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_plots_are_skipped_with_one_note_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from covey.sim import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(report, "_noted", False)
    records = [{"round": 1, "val_loss": 3.0, "bytes_sent_per_worker": 1, "sim_time_s": 1.0}]
    assert report.save_run(tmp_path, "diloco", records, {"method": "diloco"}) is False
    assert report.save_run(tmp_path, "diloco", records, {"method": "diloco"}) is False
    assert (tmp_path / "metrics.jsonl").is_file() and (tmp_path / "summary.json").is_file()
    assert not (tmp_path / "plot.png").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["note: plots skipped, matplotlib is not installed (pip install 'covey[plots]')"]


def test_browser_helper_lives_in_tests_not_in_the_package() -> None:
    import importlib.util

    assert importlib.util.find_spec("covey.dashboard.browser") is None
    assert (ROOT / "tests" / "browser.py").is_file()
    assert 'tests" / "browser.py' in (ROOT / "scripts" / "dev.py").read_text()


def test_the_wheel_holds_the_package_and_license_only(tmp_path: Path) -> None:
    """Built from a copy (the shared checkout gets no build/ folder), without isolation:
    the venv's setuptools, no network."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "covey", src / "covey", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("covey-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    assert "covey/cli/__init__.py" in files and "covey/dashboard/static/index.html" in files
    assert not any(f.startswith("tests/") or f.endswith("/browser.py") for f in files)
    assert any(f.endswith(".dist-info/licenses/LICENSE") or f.endswith("/LICENSE") for f in files)
    metadata = next(f for f in files if f.endswith(".dist-info/METADATA"))
    meta = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Requires-Python: >=3.10" in meta
    assert "Provides-Extra: plots" in meta and "Provides-Extra: tensorboard" in meta
    assert not re.search(r"^Requires-Dist: matplotlib[^;]*$", meta, re.M)


LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|^\[[^\]]+\]:\s*(\S+)|src=\"([^\"]+)\"", re.M)


def test_readme_links_resolve_inside_the_repository() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = [next(g for g in m.groups() if g) for m in LINK.finditer(readme)]
    local = [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]
    broken = []
    for target in local:
        path = (ROOT / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(target)
    assert not broken, f"README.md links to missing or outside files: {broken}"


def test_compose_starts_a_coordinator_and_two_workers_of_the_dockerfile_image() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    coordinator = services["coordinator"]
    assert coordinator["build"] == "."
    spec = coordinator["command"][1].replace("/configs/", "configs/")
    assert (ROOT / spec).is_file(), spec
    assert "--host=0.0.0.0" in coordinator["command"]
    workers = [s for name, s in services.items() if name.startswith("worker")]
    assert len(workers) == 2
    for w in workers:
        assert w["image"] == coordinator["image"]
        assert w["command"][0] == "worker"
        assert "--coordinator=http://coordinator:8470" in w["command"]
        assert w["depends_on"]["coordinator"]["condition"] == "service_healthy"
    # every flag the services pass is one the CLI has
    from typer.main import get_command

    from covey.cli import app

    cli = get_command(app)
    for s in [coordinator, *workers]:
        command = cli.commands[s["command"][0]]  # type: ignore[attr-defined]
        known = {opt for p in command.params for opt in p.opts}
        for flag in s["command"][1:]:
            if flag.startswith("--"):
                assert flag.split("=", 1)[0] in known, (s["command"][0], flag)
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["covey"]' in dockerfile and "USER covey" in dockerfile


def _docker_engine() -> str | None:
    """Why the image cannot be built here, or None where a docker engine answers."""
    if shutil.which("docker") is None:
        return "no `docker` command on PATH: the image build needs a docker engine"
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`docker info` finds no running docker engine ({last})"
    return None


NO_DOCKER = _docker_engine()


@pytest.mark.slow
@pytest.mark.skipif(NO_DOCKER is not None, reason=str(NO_DOCKER))
def test_the_image_builds_and_runs_covey() -> None:
    build = subprocess.run(
        ["docker", "build", "-t", "covey:test", str(ROOT)],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run(
        ["docker", "run", "--rm", "covey:test", "--version"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == f"covey {covey.__version__}"


def _copy_source(dest: Path) -> Path:
    """What a source release is built from: the package, pyproject, README and LICENSE (a
    copy: the shared checkout gets no build/ or egg-info folder)."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "covey", dest / "covey", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _offline_env() -> dict[str, str]:
    """This environment without PYTHONPATH (the checkout must not be importable) and with
    pip kept off every index."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, "PIP_NO_INDEX": "1", "PIP_NO_INPUT": "1"}


def _run(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=_offline_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert r.returncode == 0, f"{' '.join(map(str, args))}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
@pytest.mark.long  # a wheel built and installed in a new venv: `scripts/dev.py test --all`
def test_the_built_wheel_installs_in_a_fresh_venv_and_runs_covey(tmp_path: Path) -> None:
    """`python -m build` makes the sdist and, from the sdist, the wheel (so the sdist holds
    what a build needs), without isolation: the build requirements come from this venv and
    nothing is downloaded. The wheel goes into a new venv with no index; that venv borrows
    only the third-party dependencies (torch, pydantic, ...) from this one through a .pth
    file, written after the install so pip never sees the editable covey. Its `covey`
    then runs from a folder outside the checkout."""
    src = _copy_source(tmp_path / "src")
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src, cwd=tmp_path)
    (sdist,) = dist.glob("covey-*.tar.gz")
    (wheel,) = dist.glob("covey-*.whl")
    with tarfile.open(sdist) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    for needed in ("pyproject.toml", "README.md", "LICENSE", "PKG-INFO", "covey/cli/__init__.py"):
        assert needed in members, needed
    static = {p.relative_to(ROOT).as_posix() for p in (ROOT / "covey/dashboard/static").iterdir()}
    assert static and static <= members, static - members

    venv = tmp_path / "fresh"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--no-cache-dir", "-q", wheel, cwd=tmp_path)  # fmt: skip
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    fresh_site = Path(_run(python, "-c", purelib, cwd=tmp_path).stdout.strip())
    deps_site = Path(sysconfig.get_path("purelib"))
    assert fresh_site != deps_site
    (fresh_site / "covey_test_dependencies.pth").write_text(f"{deps_site}\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = (
        "import sys, importlib.metadata as m, covey.cli, covey.sim.simulator\n"
        "print(m.distribution('covey').locate_file('covey/cli/__init__.py'))\n"
        "print(*(x.__file__ for n, x in sys.modules.items() if n.split('.')[0] == 'covey'))"
    )
    where = _run(python, "-c", probe, cwd=outside).stdout.split()
    assert len(where) > 20, where
    for path in where:
        assert Path(path).resolve().is_relative_to(fresh_site.resolve()), path
    covey_bin = venv / "bin" / "covey"
    assert _run(covey_bin, "--version", cwd=outside).stdout.strip() == f"covey {covey.__version__}"
    sim = _run(covey_bin, "sim", "--method", "diloco", "--workers", "2", "--steps", "1", "-H", "1",
               "--no-progress", "--out", outside / "run", cwd=outside)  # fmt: skip
    assert "covey sim: diloco, 2 workers, 1 rounds" in sim.stdout + sim.stderr
    summary = json.loads((outside / "run" / "summary.json").read_text())
    assert summary["method"] == "diloco"
