"""A POST whose answer waits on the coordinator pulling a big blob gets its own timeout
(CoordinatorClient.post(timeout_s=)): a pre-signed body cannot be retried (a replay)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from covey.peer.client import CoordinatorClient, CoordinatorLost

pytestmark = pytest.mark.network


@pytest.fixture
def slow_server() -> Iterator[tuple[str, list[float]]]:
    """Answers every POST after 0.6 s; records when each request arrived."""
    arrivals: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            arrivals.append(time.monotonic())
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            time.sleep(0.6)
            body = json.dumps({"ok": True}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.handle_error = lambda request, address: None  # the client hangs up on timeouts
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", arrivals
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def test_a_slow_answer_within_the_call_timeout_is_sent_once(
    slow_server: tuple[str, list[float]],
) -> None:
    url, arrivals = slow_server
    client = CoordinatorClient(url, timeout_s=0.2, lost_s=1.0)
    try:
        assert client.post("/v1/x", {"a": 1}, round=None, timeout_s=5.0) == {"ok": True}
        assert len(arrivals) == 1  # no retry: a signed body would be refused as a replay
        with pytest.raises(CoordinatorLost):  # the client's own 0.2 s: retried, then lost
            client.post("/v1/x", {"a": 1}, round=None)
        assert len(arrivals) >= 3
    finally:
        client.close()
