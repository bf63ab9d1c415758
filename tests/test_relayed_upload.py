"""A worker without a blob server uploads its payloads to the coordinator
(covey.peer.worker_publish.Publishing._upload). A coordinator that is restarting refuses
connections for a while: the upload is tried again until a server answers on the port, and
a coordinator that stays away ends in CoordinatorLost (the worker's clean exit), never in
a traceback. Real sockets on 127.0.0.1: nothing listens, then a server does."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from covey.blobs import BlobClient
from covey.peer.client import CoordinatorLost
from covey.peer.worker_publish import Publishing
from covey.protocol.content import content_id
from covey.trust.identity import Identity


class Stored(BaseHTTPRequestHandler):
    got: ClassVar[dict[str, bytes]] = {}

    def do_PUT(self) -> None:  # http.server's name for a PUT handler
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Stored.got[self.path] = body
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def uploader(
    port: int, patience_s: float, on_pause: Callable[[], None] = lambda: None
) -> Publishing:
    pub = Publishing()
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        on_pause()

    pub.__dict__.update(
        cfg=SimpleNamespace(limits=SimpleNamespace(coordinator_lost_s=patience_s)),
        blobs=BlobClient(timeout_s=30.0, retries=1, backoff_s=0.05),
        opts=SimpleNamespace(coordinator=f"http://127.0.0.1:{port}"),
        identity=Identity.generate(),
        run_id="r" * 16,
        name="w",
        _pause=pause,
        pauses=pauses,
    )
    return pub


def test_an_upload_waits_for_a_restarting_coordinator() -> None:
    port = free_port()
    data = b"a payload" * 100
    cid = content_id(data)
    # the coordinator is down: nothing listens on its port until the upload has failed
    # (a refused connection) and the worker pauses before trying again
    server = ThreadingHTTPServer(("127.0.0.1", port), Stored, bind_and_activate=False)
    serving: list[threading.Thread] = []

    def come_back() -> None:
        if not serving:
            server.server_bind()
            server.server_activate()
            serving.append(threading.Thread(target=server.serve_forever, daemon=True))
            serving[0].start()

    pub = uploader(port, patience_s=60.0, on_pause=come_back)
    try:
        pub._upload(data, cid)
    finally:
        if serving:
            server.shutdown()
        server.server_close()
    assert len(pub.pauses) == 1  # refused once, then uploaded  # type: ignore[attr-defined]
    assert Stored.got[f"/v1/blobs/{cid}"] == data


def test_a_coordinator_that_stays_away_is_lost_not_a_traceback() -> None:
    pub = uploader(free_port(), patience_s=2.0)
    data = b"another payload"
    with pytest.raises(CoordinatorLost, match="no upload of blob"):
        pub._upload(data, content_id(data))
    assert pub.pauses  # it tried again before giving up  # type: ignore[attr-defined]
