"""Real infrastructure for the tests, started from packages on the package index: a
PostgreSQL server (pgserver bundles its binaries) and an S3-compatible HTTP server (moto's,
a separate process on 127.0.0.1). One of each per test session (tests/conftest.py); each
test gets its own database and its own bucket. Where a server cannot start here, the tests
that need it skip with the reason."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_names = itertools.count()


class Postgres:
    """A PostgreSQL server in `root` (its data directory and Unix socket); `database()`
    creates an empty database and returns its URL."""

    def __init__(self) -> None:
        import pgserver

        # its own directory, readable by the user the server runs as (pgserver runs it as
        # an unprivileged user when we are root; pytest's directories are private)
        self.root = Path(tempfile.mkdtemp(prefix="covey-pg-")) / "data"
        self.root.parent.chmod(0o755)
        self._server = pgserver.get_server(self.root, cleanup_mode="stop")

    def database(self, name: str | None = None) -> str:
        name = name or f"covey_{os.getpid()}_{next(_names)}"
        self._server.psql(f"CREATE DATABASE {name};")
        return str(self._server.get_uri(name))

    def pause(self) -> None:
        """Stop the server (a fast shutdown: sessions are cut, as in a restart of a managed
        database); `resume()` starts it again on the same socket and data."""
        from pgserver._commands import pg_ctl

        # postmaster.pid's fifth line: the directory of the server's Unix socket
        self._socket_dir = (self.root / "postmaster.pid").read_text().splitlines()[4]
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.root, user=self._server.system_user)

    def resume(self) -> None:
        from pgserver._commands import pg_ctl

        pg_ctl(
            ["-w", "-o", '-h ""', "-o", f"-k {self._socket_dir}", "-l",
             str(self.root / "resume.log"), "start"],
            pgdata=self.root, user=self._server.system_user, timeout=30,
        )  # fmt: skip

    def stop(self) -> None:
        # the data is thrown away: an immediate shutdown (no checkpoint, no waiting for
        # the sessions a test left open)
        from pgserver._commands import pg_ctl

        pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=self.root, user=self._server.system_user)
        self._server._postmaster_info = None  # stopped: nothing left for pgserver to stop
        # its ~40 MB of files go in the background: seconds on a busy disk, at no one's cost
        subprocess.Popen(["rm", "-rf", str(self.root.parent)], start_new_session=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nano_diloco_spec(
    name: str,
    *,
    seed: int = 3,
    deadline_min_s: int = 3,
    eval_batches: int = 1,
    checkpoint_every: int = 1000,
) -> str:
    """The run spec of the scale-out tests: DiLoCo on the nano GPT, short rounds."""
    return f"""
name = "{name}"
seed = {seed}
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 4
outer_momentum = 0.5
[rounds]
target_compute_s = 30
deadline_min_s = {deadline_min_s}
deadline_max_s = 60
eval_batches = {eval_batches}
checkpoint_every = {checkpoint_every}
"""


def stop_all(procs: dict[object, subprocess.Popen[bytes]] | list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process still running, wait up to 20 s for each, SIGKILL the rest."""
    ps = list(procs.values()) if isinstance(procs, dict) else list(procs)
    for p in ps:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in ps:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(20)


class S3Server:
    """moto's S3-compatible server as its own process on 127.0.0.1; `env` is what a
    client needs (AWS_ENDPOINT_URL and made-up credentials); `bucket()` creates one."""

    def __init__(self, log: Path, timeout_s: float = 60.0) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.env = {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "covey-test",
            "AWS_SECRET_ACCESS_KEY": "covey-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.log_path = log  # moto logs each request: presigned GETs carry X-Amz-Signature
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited ({self.proc.returncode}); see {log}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server did not listen on {port} within {timeout_s} s")

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_DEFAULT_REGION"],
        )

    def bucket(self) -> str:
        name = f"covey-{os.getpid()}-{next(_names)}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class FailoverProxy:
    """One address in front of several coordinator replicas, as a TCP load balancer with
    health checks is in production: each connection goes to the first backend that
    accepts it (a standby replica does not listen until it holds the run's lease), and
    its bytes are relayed both ways until either side closes."""

    def __init__(self, backends: list[int]) -> None:
        import threading

        self.backends = backends
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        self._server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                continue
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        import threading

        upstream = None
        for port in self.backends:
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=1.0)
                break
            except OSError:
                continue
        if upstream is None:
            client.close()
            return
        upstream.settimeout(None)

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
        pipe(client, upstream)
        client.close()
        upstream.close()

    def close(self) -> None:
        self._stop.set()
        self._server.close()
