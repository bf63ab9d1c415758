"""The netns WAN testbed: real namespaces, real tbf, a real HTTP download between hosts.

Needs root and iproute2. Skipped (with the reason) where unusable, except under CI as root
with `ip` and `tc` present, where a testbed that cannot be built is a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from covey.bench import netns

pytestmark = pytest.mark.network

FILE_BYTES = 2_500_000
PORT = 8000  # every testbed's namespaces are fresh, so a fixed port cannot collide

# Runs inside host b: a bounded poll until the server accepts, then one timed download.
CLIENT = r"""
import socket, sys, time, urllib.request
url, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
deadline = time.monotonic() + 10.0
while True:
    try:
        socket.create_connection((ip, port), timeout=0.5).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)  # pacing between polls; the condition is the connect above
t0 = time.monotonic()
n = len(urllib.request.urlopen(url, timeout=30).read())
print(n, time.monotonic() - t0)
"""


def _ip_netns_list() -> list[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("served")
    (d / "blob.bin").write_bytes(os.urandom(FILE_BYTES))
    return d


def download(mbit: float, served: Path, log: Path) -> tuple[float, list[str]]:
    """Mbit/s of one HTTP download from host a to host b, and the testbed's namespaces."""
    with netns.Testbed(["a", "b"], mbit=mbit) as tb:
        a = tb.hosts["a"]
        namespaces = [h.netns for h in tb.hosts.values()] + [netns.switch_netns(tb.tag)]
        assert set(namespaces) <= set(_ip_netns_list())
        with log.open("wb") as server_log:
            server = [sys.executable, "-m", "http.server", "--bind", a.ip]
            server += ["--directory", str(served), str(PORT)]
            tb.popen("a", server, stdout=server_log, stderr=subprocess.STDOUT)
            url = f"http://{a.ip}:{PORT}/blob.bin"
            res = tb.run(
                "b",
                [sys.executable, "-c", CLIENT, url, a.ip, str(PORT)],
                timeout_s=30,
                capture_output=True,
                text=True,
            )
        assert res.returncode == 0, f"client: {res.stderr}\nserver: {log.read_text()}"
        n, seconds = res.stdout.split()
        assert int(n) == FILE_BYTES
    return int(n) * 8 / float(seconds) / 1e6, namespaces


@pytest.mark.usefixtures("testbed_support")
def test_rate_limit_holds_and_scales(served_dir: Path, tmp_path: Path) -> None:
    slow, slow_ns = download(10, served_dir, tmp_path / "server10.log")
    print(f"10 Mbit/s testbed: {slow:.2f} Mbit/s")
    # Goodput sits ~5% under the cap (Ethernet/IP/TCP headers count against tbf's rate).
    assert 5.0 <= slow <= 12.0, f"10 Mbit/s link measured {slow:.2f} Mbit/s"

    fast, fast_ns = download(100, served_dir, tmp_path / "server100.log")
    print(f"100 Mbit/s testbed: {fast:.2f} Mbit/s")
    assert fast >= 3 * slow, f"100 Mbit/s link {fast:.2f} vs 10 Mbit/s link {slow:.2f}"

    left = set(_ip_netns_list())
    assert not left & set(slow_ns + fast_ns), f"namespaces left behind: {left}"


@pytest.mark.usefixtures("testbed_support")
def test_teardown_after_error_and_loopback() -> None:
    with pytest.raises(ZeroDivisionError), netns.Testbed(["x"], mbit=10) as tb:
        ns = tb.hosts["x"].netns
        res = tb.run("x", ["ip", "-o", "addr", "show", "dev", "lo"], timeout_s=10,
                     capture_output=True, text=True, check=True)  # fmt: skip
        assert "127.0.0.1" in res.stdout
        1 / 0  # noqa: B018
    assert ns not in _ip_netns_list()
    assert netns.switch_netns(tb.tag) not in _ip_netns_list()


@pytest.mark.usefixtures("testbed_support")
def test_cleanup_stale_spares_live_runs() -> None:
    dead = "cvystale2147483646-abcdef-sw"  # above the largest pid_max (2**22): no such pid
    live = f"cvystale{os.getpid()}-abcdef-sw"
    for ns in (dead, live):
        subprocess.run(["ip", "netns", "add", ns], timeout=10, check=True)
    try:
        assert netns.cleanup_stale("cvystale") == 1
        left = _ip_netns_list()
        assert dead not in left
        assert live in left
    finally:
        for ns in (dead, live):
            if ns in _ip_netns_list():
                subprocess.run(["ip", "netns", "delete", ns], timeout=10, check=True)


def test_plan_is_pure() -> None:
    hosts = netns.plan_hosts(["coord", "w0"], "cvy1-000000", "10.231.0")
    assert hosts["coord"] == netns.Host("coord", "cvy1-000000-h-coord", "10.231.0.1")
    assert hosts["w0"].ip == "10.231.0.2"
    cmds = netns.plan_commands(hosts, "cvy1-000000", 10, 0)
    tbfs = [c for c in cmds if "tbf" in c]
    assert len(tbfs) == 4  # upload and download for each host
    assert all("10mbit" in c for c in tbfs)
    with pytest.raises(ValueError, match="unique"):
        netns.plan_hosts(["a", "a"], "t", "10.231.0")
