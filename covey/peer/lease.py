"""A worker's participation lease (docs/operations.md, "Stopping a run").

The coordinator grants a lease of `lease_s` seconds with the join and with every accepted
heartbeat. A worker trains only while it holds one: when its heartbeats stop being
accepted (the coordinator is gone, partitioned away, or halted the run without the worker
hearing of it), the lease runs out and the worker stops training within `lease_s`, instead
of burning compute for a run that may be over. The lease is measured from when the renewing
request was sent, on the worker's monotonic clock, so a slow reply never extends it.
"""

from __future__ import annotations

import threading
import time


class LeaseLapsed(Exception):
    """No heartbeat has been accepted for longer than the lease: stop training."""


class Lease:
    def __init__(self) -> None:
        self._until: float | None = None  # monotonic; None before the first grant
        self._lock = threading.Lock()
        self._renewed = threading.Condition(self._lock)

    def renew(self, sent_at: float, lease_s: float) -> None:
        """A grant of `lease_s` for a request sent at `sent_at` (time.monotonic())."""
        with self._lock:
            until = sent_at + lease_s
            if self._until is None or until > self._until:
                self._until = until
            self._renewed.notify_all()

    def check(self) -> None:
        """LeaseLapsed, saying for how long, when the lease ran out (never before a grant)."""
        with self._lock:
            until = self._until
        now = time.monotonic()
        if until is not None and now > until:
            raise LeaseLapsed(
                f"participation lease lapsed {now - until:.1f} s ago: no heartbeat accepted"
            )

    def wait_renewed(self, timeout_s: float, stop: threading.Event) -> bool:
        """Wait (at most `timeout_s`, checking `stop` twice a second) until the lease is
        held again. True if it is, False on timeout or stop."""
        give_up = time.monotonic() + timeout_s
        with self._lock:
            while not stop.is_set():
                now = time.monotonic()
                if self._until is not None and now <= self._until:
                    return True
                if now >= give_up:
                    return False
                self._renewed.wait(min(0.5, give_up - now))
        return False
