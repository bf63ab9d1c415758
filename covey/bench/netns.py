"""An emulated WAN in one Linux machine: network namespaces, veth links, tbf rate limits.

`covey bench network` runs the coordinator and every worker as real processes, each in its
own network namespace, and caps every host's link at a few Mbit/s so that the bytes an
algorithm sends cost wall-clock time the way they would across the internet.

Topology (one testbed; ``<tag>`` is unique per testbed, e.g. ``cvy4242-3fa9c1``)::

        ns <tag>-h-coord        ns <tag>-h-w0           ns <tag>-h-w1
      +------------------+    +------------------+    +------------------+
      | lo   127.0.0.1   |    | lo   127.0.0.1   |    | lo   127.0.0.1   |
      | eth0 10.231.0.1  |    | eth0 10.231.0.2  |    | eth0 10.231.0.3  |
      |   tbf: upload    |    |   tbf: upload    |    |   tbf: upload    |
      +--------+---------+    +--------+---------+    +--------+---------+
               | veth                  | veth                  | veth
      +--------+-----------------------+-----------------------+---------+
      |        p0                      p1                      p2        |
      |  tbf: coord download     tbf: w0 download      tbf: w1 download  |
      |        |                       |                       |         |
      |        +-----------------------+-----------------------+         |
      |                                |                                 |
      |                       br0 (Linux bridge)                         |
      |                                          ns <tag>-sw, the switch |
      +------------------------------------------------------------------+

Nothing is created in the root namespace: each veth pair is made inside the switch
namespace with its far end moved straight into the host's namespace, so interface names
never collide between testbeds, and traffic between hosts never leaves the namespaces.
Every testbed may therefore use the same subnet.

Why tbf on both ends of each veth. A qdisc shapes only what a device *sends* (Linux can
police ingress, i.e. drop, but not queue it). The host-side ``eth0`` egress is the host's
upload. Its download is what the switch sends down the port, so a second tbf sits on the
switch-side egress ``pN``. Without it a coordinator receiving from N workers would take
N x rate at once; with it, fan-in converges on one capped link, as on a real last mile.

The optional one-way delay (``delay_ms``) is a netem qdisc on the host's upload, with the
tbf as its child: a packet from a to b is delayed ``delay_ms`` once, so the round trip
between two hosts is ``2 * delay_ms``. Some kernels are built without netem (the
Firecracker VM this was written on was); `check_support(delay=True)` says so up front.

tbf parameters (see `tbf_args`): ``burst`` is the token bucket depth, i.e. how many bytes
may leave back to back at line rate. It must hold at least one full frame and the tokens
earned in one timer tick; we use ~4 ms of traffic, at least 16 KiB. Bigger is not
harmless: a full bucket is free bandwidth at the start of every transfer, and with 256 KiB
a 2.5 MB download on a 10 Mbit/s link measured 10.6 Mbit/s, above the cap (2 frames to
64 KiB all gave 9.5-9.8). ``latency`` bounds the queue (tbf turns it into a byte limit);
it must cover a round trip or TCP cannot keep the link full, so it is 50 ms plus the
emulated RTT. The rate counts whole Ethernet frames, so TCP goodput is ~95% of it.

Inspecting a live testbed (as root)::

    ip netns list                                   # cvy<pid>-<hex>-sw, ...-h-<name>
    ip netns exec cvy4242-3fa9c1-h-w0 ip addr
    ip netns exec cvy4242-3fa9c1-h-w0 tc -s qdisc show dev eth0   # upload: sent/dropped
    ip netns exec cvy4242-3fa9c1-sw tc -s qdisc show                # downloads, per port
    ip netns exec cvy4242-3fa9c1-h-w0 ping 10.231.0.1

Namespaces left by a crashed run (its pid is gone) are removed by `cleanup_stale`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

# Every `ip` / `tc` call is local and takes milliseconds; this only bounds a wedged one.
COMMAND_TIMEOUT_S = 10.0
# How long close() lets a process started with popen() exit after SIGTERM before SIGKILL.
TERMINATE_TIMEOUT_S = 5.0

_NAME_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")
_HOST_IFACE = "eth0"
_BRIDGE = "br0"


class TestbedUnavailable(RuntimeError):
    """The testbed cannot be built here; the message says exactly what is missing."""

    __test__ = False  # not a pytest test class, despite the name


@dataclass(frozen=True)
class Host:
    name: str  # "coord", "w0", ...
    netns: str  # namespace name, prefixed with the testbed's unique tag
    ip: str  # e.g. 10.231.0.1


# ---------------------------------------------------------------- plan (pure functions)


def make_tag(prefix: str = "cvy") -> str:
    """A per-testbed namespace prefix: ``<prefix><pid>-<6 hex>``; the pid lets
    `cleanup_stale` tell a crashed run's namespaces from a live parallel run's."""
    return f"{prefix}{os.getpid()}-{secrets.token_hex(3)}"


def switch_netns(tag: str) -> str:
    return f"{tag}-sw"


def plan_hosts(names: Sequence[str], tag: str, subnet: str) -> dict[str, Host]:
    """Namespace and address of every host: ``<subnet>.1`` for the first name, and so on."""
    if not names:
        raise ValueError("a testbed needs at least one host name, got none")
    if len(set(names)) != len(names):
        raise ValueError(f"host names must be unique, got {list(names)}")
    if len(names) > 253:
        raise ValueError(f"a /24 holds at most 253 hosts, got {len(names)}")
    for name in names:
        if not _NAME_RE.match(name):
            raise ValueError(f"host name {name!r} must match {_NAME_RE.pattern}")
    octets = subnet.split(".")
    if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
        raise ValueError(f"subnet must be three octets like '10.231.0', got {subnet!r}")
    return {
        name: Host(name=name, netns=f"{tag}-h-{name}", ip=f"{subnet}.{i + 1}")
        for i, name in enumerate(names)
    }


def tbf_args(mbit: float, delay_ms: float) -> list[str]:
    """``rate/burst/latency`` for one tbf; see the module docstring for the choices."""
    if mbit <= 0:
        raise ValueError(f"rate must be positive, got {mbit} Mbit/s")
    if delay_ms < 0:
        raise ValueError(f"delay must be >= 0, got {delay_ms} ms")
    bytes_per_s = mbit * 1e6 / 8
    burst = max(16 * 1024, int(bytes_per_s * 0.004))
    latency_ms = 50 + 2 * delay_ms
    return ["rate", f"{mbit:g}mbit", "burst", str(burst), "latency", f"{latency_ms:g}ms"]


def plan_commands(
    hosts: dict[str, Host], tag: str, mbit: float, delay_ms: float
) -> list[list[str]]:
    """Every `ip` / `tc` command that builds the testbed, in order (namespaces first)."""
    sw = switch_netns(tag)
    shape = tbf_args(mbit, delay_ms)
    cmds: list[list[str]] = [["ip", "netns", "add", sw]]
    cmds += [["ip", "netns", "add", h.netns] for h in hosts.values()]
    cmds += [
        ["ip", "-n", sw, "link", "set", "lo", "up"],
        ["ip", "-n", sw, "link", "add", _BRIDGE, "type", "bridge"],
        ["ip", "-n", sw, "link", "set", _BRIDGE, "up"],
    ]
    for i, h in enumerate(hosts.values()):
        port = f"p{i}"
        cmds += [
            ["ip", "-n", sw, "link", "add", port, "type", "veth",
             "peer", "name", _HOST_IFACE, "netns", h.netns],
            ["ip", "-n", sw, "link", "set", port, "master", _BRIDGE],
            ["ip", "-n", sw, "link", "set", port, "up"],
            ["ip", "-n", h.netns, "link", "set", "lo", "up"],
            ["ip", "-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", _HOST_IFACE],
            ["ip", "-n", h.netns, "link", "set", _HOST_IFACE, "up"],
            # download: what the switch sends down this host's port
            ["tc", "-n", sw, "qdisc", "add", "dev", port, "root", "tbf", *shape],
        ]  # fmt: skip
        up = ["tc", "-n", h.netns, "qdisc", "add", "dev", _HOST_IFACE]
        if delay_ms > 0:
            # netem delays, then its child tbf shapes (the netem-wiki recipe). The netem
            # queue holds everything in flight for delay_ms; 1000 packets (the default)
            # is too few at 100 Mbit/s and 100 ms.
            cmds += [
                [*up, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms",
                 "limit", "100000"],
                [*up, "parent", "1:1", "handle", "10:", "tbf", *shape],
            ]  # fmt: skip
        else:
            cmds.append([*up, "root", "tbf", *shape])
    return cmds


# ---------------------------------------------------------------- execute


def _run_cmd(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run one setup/teardown command; raise with the command and its stderr on failure."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"`{' '.join(argv)}` timed out after {COMMAND_TIMEOUT_S} s") from e
    if proc.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}"
        )
    return proc


def _hint(error: str) -> str:
    if "netem" in error and "unknown" in error:
        return (
            " -- this kernel lacks netem (CONFIG_NET_SCH_NETEM / module sch_netem),"
            " which delay_ms > 0 needs; use delay_ms=0 here"
        )
    if "unknown" in error:
        return " -- this kernel lacks a qdisc or link type the testbed needs (tbf, veth, bridge)"
    return ""


def _basic_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root: creating network namespaces needs uid 0"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH (install iproute2)"
    return None


def list_netns() -> list[str]:
    """Names from `ip netns list` (whose lines read ``name`` or ``name (id: N)``)."""
    out = _run_cmd(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def check_support(*, delay: bool = False) -> str | None:
    """None when a testbed can be built here, else why not. Never raises.

    Beyond root and the tools, it builds and removes a one-port probe (namespace, bridge,
    veth, tbf, and with ``delay=True`` netem), so a kernel without one of them shows up
    here rather than halfway through a bench.
    """
    reason = _basic_reason()
    if reason is not None:
        return reason
    ns = f"{make_tag()}-probe"
    probe = [
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
        ["ip", "-n", ns, "link", "add", _BRIDGE, "type", "bridge"],
        ["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", "tbf", *tbf_args(10, 0)],
    ]
    if delay:
        probe.append(["tc", "-n", ns, "qdisc", "add", "dev", "pb", "root", "netem", "delay", "1ms"])
    built: str | None = None
    try:
        for argv in probe:
            _run_cmd(argv)
    except (RuntimeError, OSError) as e:
        built = f"netns testbed probe failed: {e}{_hint(str(e))}"
    try:
        if ns in list_netns():
            _run_cmd(["ip", "netns", "delete", ns])
    except (RuntimeError, OSError) as e:
        return built or f"could not delete probe namespace {ns}: {e}"
    return built


class Testbed:
    """Hosts in their own namespaces on one rate-limited bridge; a context manager.

    Entering builds everything (see the module docstring); on any failure it removes
    what it built and raises `TestbedUnavailable` naming the command and its stderr.
    Leaving always tears down: processes started with `popen` still running are
    terminated, and every namespace this testbed created is deleted.
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        mbit: float,
        delay_ms: float = 0.0,
        subnet: str = "10.231.0",
        prefix: str = "cvy",
    ) -> None:
        self.tag = make_tag(prefix)
        self.mbit = mbit
        self.delay_ms = delay_ms
        self.hosts: dict[str, Host] = plan_hosts(names, self.tag, subnet)
        self.commands = plan_commands(self.hosts, self.tag, mbit, delay_ms)
        self._created: list[str] = []  # namespaces that exist and are ours to delete
        self._procs: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> Testbed:
        reason = _basic_reason()
        if reason is not None:
            raise TestbedUnavailable(reason)
        try:
            for argv in self.commands:
                _run_cmd(argv)
                if argv[:3] == ["ip", "netns", "add"]:
                    self._created.append(argv[3])
        except (RuntimeError, OSError) as e:
            msg = f"building testbed {self.tag} failed: {e}{_hint(str(e))}"
            try:
                self.close()
            except RuntimeError as cleanup:
                msg += f" (and cleaning up: {cleanup})"
            raise TestbedUnavailable(msg) from e
        except BaseException:  # e.g. Ctrl-C halfway: still remove what was built
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        if host not in self.hosts:
            raise KeyError(f"no host {host!r} in testbed {self.tag}; hosts: {list(self.hosts)}")
        if self.hosts[host].netns not in self._created:
            raise RuntimeError(f"testbed {self.tag} is not built (use it as a context manager)")
        # `ip netns exec` execs argv in place, so the Popen's pid is argv's process.
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start argv inside host's namespace; close() terminates it if still running."""
        proc = subprocess.Popen(self._exec_argv(host, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, host: str, argv: Sequence[str], timeout_s: float, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run argv inside host's namespace to completion; killed and TimeoutExpired raised
        after timeout_s (subprocess.run semantics, kwargs passed through)."""
        return subprocess.run(self._exec_argv(host, argv), timeout=timeout_s, **kwargs)

    def close(self) -> None:
        """Terminate our processes, delete our namespaces. Idempotent; tries every
        namespace even if one fails, then raises naming those it could not delete."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=TERMINATE_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=TERMINATE_TIMEOUT_S)
        self._procs.clear()
        failures: list[str] = []
        # Hosts first, the switch last: deleting a namespace deletes its veth ends.
        for ns in reversed(self._created):
            try:
                _run_cmd(["ip", "netns", "delete", ns])
            except (RuntimeError, OSError) as e:
                failures.append(str(e))
        self._created.clear()
        if failures:
            raise RuntimeError(f"testbed {self.tag} teardown: " + "; ".join(failures))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = "cvy") -> int:
    """Delete namespaces left by crashed runs; return how many were deleted.

    A namespace is stale when its name is ``<prefix><pid>-<6 hex>-...`` (see `make_tag`)
    and no process with that pid exists, so a parallel run's live testbed is left alone.
    (A recycled pid keeps a stale namespace until that pid is gone; that errs safe.)
    """
    if _basic_reason() is not None:
        return 0
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)-[0-9a-f]{{6}}-")
    deleted = 0
    for ns in list_netns():
        m = pattern.match(ns)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        _run_cmd(["ip", "netns", "delete", ns])
        deleted += 1
    return deleted
