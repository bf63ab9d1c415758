"""Headless Chromium for testing the status page: render a URL after its JavaScript ran.

The page polls ``/v1/status`` with ``fetch()``, so a plain ``--dump-dom`` would serialize the
DOM before the first answer arrives. ``--virtual-time-budget=MS`` fixes that: Chromium runs
the page on a virtual clock that advances only while nothing is loading (its
"pause if network fetches pending" policy), and dumps once MS of virtual time have passed.
A poll loop with a 2 s period therefore completes at least ``MS // 2000`` round trips,
however slow the server is in real time, and timers cost no real time. What bounds the real
time is ``timeout_s``: a server that never answers stalls the virtual clock, and the whole
process group is then killed and reported.

    python tests/browser.py install          # apt-get chromium if root and missing
    python tests/browser.py dom URL          # print the DOM after JS ran
    python tests/browser.py shot URL PATH    # save a PNG
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Off: everything that would reach the internet, prompt, or need a GPU, a display or D-Bus.
FLAGS = (
    "--headless",
    "--no-sandbox",  # tests run as root in containers, where the sandbox cannot start
    "--disable-gpu",
    "--disable-dev-shm-usage",  # /dev/shm is 64 MiB in docker; use /tmp instead
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--mute-audio",
    "--hide-scrollbars",
)
APT_TIMEOUT_S = 900.0
STDERR_TAIL = 3000


def find_chromium() -> str | None:
    """Path of a Chromium or Chrome executable on PATH, or None."""
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def install_chromium() -> str | None:
    """Chromium's path, installing Debian's ``chromium`` package first if it is missing.

    Installs only when running as root with apt-get available; otherwise, or when apt-get
    fails or runs past APT_TIMEOUT_S, says why on stderr and returns None.
    """
    found = find_chromium()
    if found:
        return found
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("apt-get"):
        print(
            "chromium missing; install it (Debian: apt-get install chromium) as root",
            file=sys.stderr,
        )
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"],
    ):
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        try:
            rc = subprocess.run(cmd, env=env, timeout=APT_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            print(f"{cmd[1]} ran past {APT_TIMEOUT_S:.0f} s", file=sys.stderr)
            return None
        if rc != 0:
            print(f"{' '.join(cmd)} failed with exit status {rc}", file=sys.stderr)
            return None
    return find_chromium()


def _run_chromium(args: list[str], *, timeout_s: float) -> str:
    """Run Chromium with FLAGS + args in a fresh profile; its stdout, or RuntimeError."""
    exe = find_chromium()
    if exe is None:
        raise RuntimeError(f"no Chromium found on PATH (looked for {', '.join(CANDIDATES)})")
    tmp = tempfile.TemporaryDirectory(prefix="covey-chromium-", ignore_cleanup_errors=True)
    with tmp as profile:
        cmd = [exe, *FLAGS, f"--user-data-dir={profile}", *args]
        # Its own session, so that on a timeout the renderer, GPU and zygote children die
        # with the browser instead of outliving the test.
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            # Virtual time stands still while a request is pending or a JavaScript dialog
            # (alert(), confirm()) is open, and headless Chromium never closes dialogs.
            raise RuntimeError(
                f"chromium ran past {timeout_s:.0f} s on {args[-1]} (a request that never "
                f"finished, or a JavaScript dialog such as alert()); stderr tail:\n{_tail(err)}"
            ) from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(
            f"chromium exited with status {proc.returncode} on {args[-1]}; "
            f"stderr tail:\n{_tail(err)}"
        )
    return out.decode("utf-8", errors="replace")


def _tail(err: bytes) -> str:
    return err.decode("utf-8", errors="replace")[-STDERR_TAIL:]


def render_dom(url: str, *, wait_ms: int = 4000, timeout_s: float = 60.0) -> str:
    """The serialized DOM of ``url`` after ``wait_ms`` of virtual time (see module doc).

    RuntimeError, with the tail of Chromium's stderr, when Chromium is missing, fails, prints
    no DOM, or takes longer than ``timeout_s`` of real time.
    """
    dom = _run_chromium(
        [f"--virtual-time-budget={wait_ms}", "--dump-dom", url], timeout_s=timeout_s
    )
    if "<html" not in dom.lower():
        raise RuntimeError(f"chromium printed no DOM for {url}; stdout was {dom[:300]!r}")
    return dom


def screenshot(
    url: str,
    path: Path,
    *,
    wait_ms: int = 4000,
    size: tuple[int, int] = (1280, 900),
    timeout_s: float = 60.0,
) -> None:
    """Save a PNG of the first ``size`` pixels of ``url`` after ``wait_ms`` of virtual time.

    RuntimeError as for render_dom, or when no file appears at ``path``.
    """
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    width, height = size
    _run_chromium(
        [
            f"--virtual-time-budget={wait_ms}",
            f"--window-size={width},{height}",
            f"--screenshot={path}",
            url,
        ],
        timeout_s=timeout_s,
    )
    if not path.is_file() or path.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot to {path} for {url}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["install"]:
        path = install_chromium()
        print(path or "chromium not available")
        return 0 if path else 1
    if len(args) == 2 and args[0] == "dom":
        print(render_dom(args[1]))
        return 0
    if len(args) == 3 and args[0] == "shot":
        screenshot(args[1], Path(args[2]))
        return 0
    print(
        "usage: python tests/browser.py install | dom URL | shot URL PATH",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
