"""A peer's own read-only blob server: GET/HEAD {base}/v1/blobs/{cid} over a BlobStore,
with a single Range per request (stdlib ThreadingHTTPServer in a daemon thread)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import BinaryIO
from urllib.parse import urlsplit

from covey.blobs.pacing import PIECE_BYTES, Pacer
from covey.blobs.store import (
    BLOB_PATH_PREFIX,
    BlobStore,
    RangeNotSatisfiable,
    is_cid,
    parse_range,
)

logger = logging.getLogger(__name__)

_COPY_BYTES = 256 << 10
_IDLE_TIMEOUT_S = 30.0  # a keep-alive connection with no request for this long is closed
_JOIN_TIMEOUT_S = 5.0


class _StoreHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # connection threads never block shutdown
    store: BlobStore
    owner: BlobServer

    def handle_error(self, request: object, client_address: object) -> None:
        logger.debug("blob server: error serving %s", client_address, exc_info=True)


class _BlobHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: chunked fetches reuse connections
    timeout = _IDLE_TIMEOUT_S
    disable_nagle_algorithm = True  # headers and body go in separate writes: avoid 40 ms stalls
    server: _StoreHTTPServer

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("blob server %s: %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def _refuse(self) -> None:
        self.close_connection = True  # any request body is left unread
        self._plain(405, "blob server is read-only: GET and HEAD only", {"Allow": "GET, HEAD"})

    do_PUT = do_POST = do_DELETE = do_PATCH = _refuse

    def _plain(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        body = message.encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _serve(self) -> None:
        path = urlsplit(self.path).path
        cid = path[len(BLOB_PATH_PREFIX) :]
        if not path.startswith(BLOB_PATH_PREFIX) or not is_cid(cid):
            self._plain(404, f"not found: {path[:100]}")
            return
        try:  # open first: a blob deleted meanwhile is a clean 404, not a cut response
            f = self.server.store.path(cid).open("rb")
        except FileNotFoundError:
            self._plain(404, f"no blob {cid}")
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            try:
                ranged = parse_range(self.headers.get("Range"), size)
            except RangeNotSatisfiable as e:
                self._plain(416, str(e), {"Content-Range": f"bytes */{size}"})
                return
            start, end = ranged if ranged else (0, size - 1)
            self.send_response(206 if ranged else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start + 1))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{cid}"')
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if self.command == "GET":
                self._copy(f, cid, start, end - start + 1)

    def _copy(self, f: BinaryIO, cid: str, start: int, n: int) -> None:
        owner = self.server.owner
        pacer = owner.pacer if owner.pacer is not None and owner.paced(cid) else None
        step = PIECE_BYTES if pacer is not None else _COPY_BYTES
        f.seek(start)
        try:
            while n > 0:
                piece = f.read(min(n, step))
                if not piece:  # file shrank under us: cut the connection, the client sees it
                    self.close_connection = True
                    return
                if pacer is not None:
                    pacer.wait(len(piece))
                self.wfile.write(piece)
                owner.count(cid, len(piece))
                n -= len(piece)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client hung up (e.g. it gave up on us)


class BlobServer:
    """A peer's own blob server: stdlib ThreadingHTTPServer in a daemon thread.

    Serves `GET` and `HEAD /v1/blobs/{cid}` from a BlobStore: 200 whole, 206 with
    Content-Range for a single Range, 404 for unknown or malformed ids and every other
    path, 416 for a bad range, 405 for other methods; Content-Length always. Access and
    error logs go to `logging` at debug level.

    `pacer`: the blobs `paced(cid)` says are paced (a worker's verification evidence) are
    sent through it, all connections together (covey.blobs.pacing); the others at once.
    `served`: body bytes sent so far, per content id.
    """

    def __init__(
        self,
        store: BlobStore,
        host: str = "127.0.0.1",
        port: int = 0,
        pacer: Pacer | None = None,
        paced: Callable[[str], bool] | None = None,
    ) -> None:
        self.store, self.host, self.port = store, host, port
        self.pacer = pacer
        self.paced: Callable[[str], bool] = paced or (lambda cid: False)
        self.served: dict[str, int] = {}
        self._served_lock = threading.Lock()
        self._httpd: _StoreHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def count(self, cid: str, n: int) -> None:
        """Add `n` body bytes sent of blob `cid` to `served`."""
        with self._served_lock:
            self.served[cid] = self.served.get(cid, 0) + n

    def start(self) -> str:
        """Bind, start serving, and return the base URL (e.g. "http://127.0.0.1:43211").

        OSError if the address cannot be bound; RuntimeError if already started.
        """
        if self._httpd is not None:
            raise RuntimeError(f"blob server already started at {self.url}")
        httpd = _StoreHTTPServer((self.host, self.port), _BlobHandler)
        httpd.store, httpd.owner = self.store, self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            daemon=True,
            name=f"blob-server:{httpd.server_address[1]}",
        )
        self._thread.start()
        logger.debug("blob server serving %s at %s", self.store.root, self.url)
        return self.url

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("blob server not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        """Stop serving and join the thread (at most a few seconds); idempotent."""
        httpd, thread = self._httpd, self._thread
        if httpd is None or thread is None:
            return
        self._httpd = self._thread = None
        httpd.shutdown()  # returns within poll_interval once serve_forever is running
        httpd.server_close()
        thread.join(timeout=_JOIN_TIMEOUT_S)
        if thread.is_alive():
            logger.warning(
                "blob server thread %s did not stop in %ss", thread.name, _JOIN_TIMEOUT_S
            )

    def __enter__(self) -> BlobServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
