"""Guards a command runs before it creates or serves anything, each failing with a
`UserError` (one line: what is wrong, what to do):

- `lock_dir`: one process per run directory (a coordinator's --data-dir, a sim's --out).
  An exclusive `fcntl.flock` on DIR/.covey.lock, held while the process lives: the kernel
  drops it when the process exits or is killed, so a lock left by a SIGKILLed process is
  not a lock (no stale pid files to clean up).
- `check_port_free`: the port a server is about to listen on is free, checked before the
  banner and before the run directory is made.
- `prepare_out`: a run directory holding another run is refused unless resumed or
  overwritten.
- `sha256_file` / `check_sha256` / the ``<file>.sha256`` sidecar: checkpoints written by
  covey carry their content hash and are checked on load; one written before hashes were
  kept has no sidecar and loads unchecked.

Imports neither torch nor the network stack (``--help`` stays instant).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
from pathlib import Path
from typing import IO

from covey.errors import UserError

LOCK_NAME = ".covey.lock"
# open lock files by directory: closing one (or exiting) releases its lock; a directory this
# process already holds is not locked again (a second command run in one process, as tests
# and library users do, must not find its own lock)
_held: dict[Path, IO[str]] = {}

# what `covey sim --out` leaves in its run directory (covey.sim.report, covey.io.export)
SIM_RUN_ENTRIES = (
    "checkpoint",
    "checkpoints",
    "metrics.jsonl",
    "summary.json",
    "plot.png",
    "model",
    "tokenizer",
)


def lock_dir(directory: Path, what: str) -> None:
    """Create `directory` and lock it for this process (released when the process ends);
    `UserError` when another live process holds it."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    key = directory.resolve()
    if key in _held:
        return
    f = (directory / LOCK_NAME).open("a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise UserError(f"cannot lock {directory}: {e}") from None
        raise UserError(
            f"{directory} is in use by another {what} (it holds {directory / LOCK_NAME}); "
            "stop that one first, or use another directory"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _held[key] = f


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """`UserError` when `host:port` cannot be listened on (in use, or not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind((host, port))
        except OSError as e:
            why = "already in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise UserError(
                f"cannot listen on {host}:{port}: {why}; pick another {flag} "
                "(or stop what listens there)"
            ) from None


def prepare_out(out: Path, *, resume: bool, overwrite: bool, command: str) -> None:
    """Refuse an `out` that holds another run unless `resume` (go on with it) or
    `overwrite` (its run files are deleted first)."""
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other: pick one")
    present = [name for name in SIM_RUN_ENTRIES if (out / name).exists()]
    if present == ["checkpoint"] and not (out / "checkpoint" / "sim.json").exists():
        present = []  # only the config of a run that stopped before its first round
    if not present or resume:
        return
    if not overwrite:
        raise UserError(
            f"{out} holds another run ({', '.join(present)}); pass --resume to go on with "
            f"it, --overwrite to replace it, or another --out ({command})"
        )
    for name in present:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


# --- content hashes -----------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def sidecar(path: Path) -> Path:
    """Where the content hash of a checkpoint file is kept: ``<file>.sha256``."""
    return path.with_name(path.name + ".sha256")


def write_sidecar(path: Path, digest: str) -> None:
    side = sidecar(path)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(digest + "\n")
    tmp.replace(side)


def expected_sha256(path: Path) -> str | None:
    """The hash recorded beside `path`, or None (a checkpoint written without one)."""
    side = sidecar(path)
    return side.read_text().strip() if side.is_file() else None


def check_sha256(path: Path, expected: str | None) -> None:
    """`UserError` when `path`'s bytes do not hash to `expected` (None: nothing to check)."""
    if expected is None:
        return
    actual = sha256_file(path)
    if actual != expected:
        raise UserError(
            f"{path} is damaged: its bytes hash to {actual[:16]}..., not the "
            f"{expected[:16]}... recorded when it was written; restore it or use an "
            "earlier checkpoint"
        )
