"""One logging setup for every entrypoint: each line says when (date and time, UTC), how
bad, who (the peer's name) and where (the logger), as text or as one JSON object a line.

    2026-11-23 13:40:01.250Z INFO  alice covey.worker: round 3 committed
    {"time": "2026-11-23T13:40:01.250Z", "level": "INFO", "peer": "alice", ...}

The peer's name is known only once its identity is loaded (a worker's default name is
the start of its id), so `set_peer` may rename it later; lines logged before that carry
the provisional name the entrypoint passed. Children of `covey demo` inherit JSON output
through the COVEY_LOG_JSON environment variable (a presentation setting: it changes no run).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, TextIO

JSON_ENV = "COVEY_LOG_JSON"
# Libraries whose one line per request drowns the round log.
NOISY = ("httpx", "httpcore", "urllib3", "matplotlib", "PIL")
_peer = "-"


def set_peer(name: str) -> None:
    """Name the peer in every later line (its identity may be known only after setup)."""
    global _peer
    _peer = name


def _utc(record: logging.LogRecord) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


class _PeerFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.peer = _peer
        return True


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{_utc(record).replace('T', ' ')} {record.levelname:<5} "
            f"{getattr(record, 'peer', _peer)} {record.name}: {record.getMessage()}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, peer, logger, message, and the
    traceback as `exc` when there is one. Never raises on odd messages (repr fallback)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _utc(record),
            "level": record.levelname,
            "peer": getattr(record, "peer", _peer),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=repr)


def setup_logging(
    peer: str,
    *,
    verbose: bool = False,
    json_lines: bool | None = None,
    stream: TextIO | None = None,
) -> logging.Handler:
    """Configure the root logger for this process (replacing earlier handlers) and return
    its handler. `json_lines` None reads COVEY_LOG_JSON; True also sets it, so child
    processes log the same way."""
    if json_lines is None:
        json_lines = os.environ.get(JSON_ENV, "") not in ("", "0")
    elif json_lines:
        os.environ[JSON_ENV] = "1"
    set_peer(peer)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    handler.addFilter(_PeerFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return handler
