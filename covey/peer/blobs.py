"""The blob plane: immutable content-addressed bytes, stored, served and fetched by sha256.

Three layers, each usable alone:
- `BlobStore`: a directory of blobs named by content id, written atomically.
- `BlobServer`: a peer's own read-only HTTP server over a store (GET/HEAD, single Range).
- `BlobClient`: fetches a blob from an ordered list of providers, with bounded retries,
  provider fallback, and parallel ranged chunks for large blobs.

Trust model (as in hivemind, every record from the network passes a validator): a provider
can be slow, absent or lying, and the client only hands back bytes whose sha256 equals the
requested id. Wire format: `GET|HEAD {base}/v1/blobs/{cid}`, `PUT` on the coordinator only.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO, TypeVar
from urllib.parse import urlsplit

import httpx

from covey.protocol.content import content_id, is_content_id

logger = logging.getLogger(__name__)

BLOB_PATH_PREFIX = "/v1/blobs/"
_TMP_PREFIX = ".tmp-"  # never a content id, so a crash's leftover is never seen as a blob
_COPY_BYTES = 256 << 10
_IDLE_TIMEOUT_S = 30.0  # a keep-alive connection with no request for this long is closed
_JOIN_TIMEOUT_S = 5.0
_MAX_BACKOFF_S = 5.0
_MIN_RATE_BYTES_S = 64 << 10  # after timeout_s of grace, a transfer slower than this is cut
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})

T = TypeVar("T")


class BlobError(Exception):
    """A blob could not be stored or fetched; the message names the cid and why."""


def _is_cid(value: object) -> bool:
    # The length check also refuses "<cid>\n", which is_content_id's `$` lets through.
    return isinstance(value, str) and len(value) == 64 and is_content_id(value)


def _cid_or_error(cid: str) -> str:
    if not _is_cid(cid):
        raise BlobError(f"not a content id (64 lowercase hex digits): {str(cid)[:80]!r}")
    return cid


class BlobStore:
    """Immutable content-addressed blobs in a directory (root/ab/abcdef...).

    Writes go to a temporary file in the blob's shard directory, are fsynced, then renamed
    into place with `os.replace`, so a crash never leaves a partial blob under its id (at
    worst a `.tmp-*` file, which is never listed or served). Safe for concurrent use by
    threads of one process; the same blob written twice is written once.
    """

    def __init__(self, root: Path, max_blob_bytes: int | None = None) -> None:
        if max_blob_bytes is not None and max_blob_bytes < 0:
            raise ValueError(f"max_blob_bytes ({max_blob_bytes}) must be >= 0 or None")
        self.root = Path(root)
        self.max_blob_bytes = max_blob_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, cid: str) -> Path:
        """Where blob `cid` lives (it may not exist); BlobError for a malformed cid.

        Only 64 lowercase hex digits pass, so the path can never escape `root`.
        """
        _cid_or_error(cid)
        return self.root / cid[:2] / cid

    def has(self, cid: str) -> bool:
        """Whether blob `cid` is stored; False (never an error) for a malformed cid."""
        return _is_cid(cid) and self.path(cid).is_file()

    def size(self, cid: str) -> int:
        """The blob's length in bytes; BlobError if it is missing or cid is malformed."""
        try:
            return self.path(cid).stat().st_size
        except FileNotFoundError:
            raise BlobError(f"blob {cid} is not stored") from None

    def put(self, data: bytes) -> str:
        """Store `data` and return its content id; idempotent. BlobError if too large or on I/O."""
        cid = content_id(data)
        self._write(cid, data)
        return cid

    def put_verified(self, cid: str, data: bytes) -> None:
        """Store bytes received for `cid`; BlobError (store unchanged) if cid is malformed,
        the bytes do not hash to it, or they exceed `max_blob_bytes`."""
        _cid_or_error(cid)
        self._check_size(cid, len(data))
        actual = content_id(data)
        if actual != cid:
            raise BlobError(f"blob {cid}: data hashes to {actual}, refusing to store")
        self._write(cid, data)

    def get(self, cid: str) -> bytes:
        """The blob's bytes; BlobError if missing or cid is malformed."""
        try:
            return self.path(cid).read_bytes()
        except FileNotFoundError:
            raise BlobError(f"blob {cid} is not stored") from None

    def read_range(self, cid: str, start: int, end_inclusive: int) -> bytes:
        """Bytes start..end_inclusive of the blob; BlobError if missing or out of bounds."""
        size = self.size(cid)
        if not 0 <= start <= end_inclusive < size:
            raise BlobError(f"blob {cid}: range {start}-{end_inclusive} outside 0-{size - 1}")
        with self.path(cid).open("rb") as f:
            f.seek(start)
            data = f.read(end_inclusive - start + 1)
        if len(data) != end_inclusive - start + 1:
            raise BlobError(f"blob {cid}: short read at {start}-{end_inclusive}")
        return data

    def delete(self, cid: str) -> None:
        """Remove the blob; a missing blob is not an error, a malformed cid is (BlobError)."""
        self.path(cid).unlink(missing_ok=True)

    def cids(self) -> list[str]:
        """Every stored blob's id, sorted. Temporary files and stray names are ignored."""
        out: list[str] = []
        for shard in self.root.iterdir():
            if not (shard.is_dir() and re.fullmatch(r"[0-9a-f]{2}", shard.name)):
                continue
            for f in shard.iterdir():
                if _is_cid(f.name) and f.name[:2] == shard.name and f.is_file():
                    out.append(f.name)
        return sorted(out)

    def _check_size(self, cid: str, n: int) -> None:
        if self.max_blob_bytes is not None and n > self.max_blob_bytes:
            raise BlobError(f"blob {cid}: {n} bytes exceeds max_blob_bytes={self.max_blob_bytes}")

    def _write(self, cid: str, data: bytes) -> None:
        self._check_size(cid, len(data))
        final = self.path(cid)
        if final.is_file():
            return  # immutable: same id, same bytes
        try:
            final.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=_TMP_PREFIX, suffix=".part")
        except OSError as e:
            raise BlobError(f"cannot store blob {cid}: {e}") from e
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException as e:
            Path(tmp).unlink(missing_ok=True)  # then re-raised: nothing is swallowed
            if isinstance(e, OSError):
                raise BlobError(f"cannot store blob {cid}: {e}") from e
            raise
        _fsync_dir(final.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable; skipped where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is atomic
    finally:
        os.close(fd)


class RangeNotSatisfiable(ValueError):
    """A Range header that is malformed, multi-range, or outside the blob (HTTP 416)."""


_RANGE = re.compile(r"bytes=(\d*)-(\d*)", re.IGNORECASE)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end_inclusive) for a single HTTP byte range over `size` bytes.

    None when there is no header (send the whole body). Accepts `bytes=a-b` (b clamped to
    the last byte), `bytes=a-` and the suffix form `bytes=-n` (the last n bytes). Raises
    RangeNotSatisfiable for anything else: other units, several ranges, a > b, a start at
    or past the end, an empty suffix, or any range over an empty blob.
    """
    if header is None:
        return None
    m = _RANGE.fullmatch(header.strip())
    if m is None:
        raise RangeNotSatisfiable(f"unsupported Range {header[:80]!r} (single bytes=a-b only)")
    first, last = m.group(1), m.group(2)
    if first == "":
        if last == "" or int(last) == 0 or size == 0:
            raise RangeNotSatisfiable(f"suffix Range {header!r} selects nothing of {size} bytes")
        return max(0, size - int(last)), size - 1
    start = int(first)
    end = size - 1 if last == "" else int(last)
    if last != "" and end < start:
        raise RangeNotSatisfiable(f"Range {header!r} ends before it starts")
    if start >= size:
        raise RangeNotSatisfiable(f"Range {header!r} starts past the end ({size} bytes)")
    return start, min(end, size - 1)


class _StoreHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # connection threads never block shutdown
    store: BlobStore

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
        if not path.startswith(BLOB_PATH_PREFIX) or not _is_cid(cid):
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
                self._copy(f, start, end - start + 1)

    def _copy(self, f: BinaryIO, start: int, n: int) -> None:
        f.seek(start)
        try:
            while n > 0:
                piece = f.read(min(n, _COPY_BYTES))
                if not piece:  # file shrank under us: cut the connection, the client sees it
                    self.close_connection = True
                    return
                self.wfile.write(piece)
                n -= len(piece)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client hung up (e.g. it gave up on us)


class BlobServer:
    """A peer's own blob server: stdlib ThreadingHTTPServer in a daemon thread.

    Serves `GET` and `HEAD /v1/blobs/{cid}` from a BlobStore: 200 whole, 206 with
    Content-Range for a single Range, 404 for unknown or malformed ids and every other
    path, 416 for a bad range, 405 for other methods; Content-Length always. Access and
    error logs go to `logging` at debug level.
    """

    def __init__(self, store: BlobStore, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store, self.host, self.port = store, host, port
        self._httpd: _StoreHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Bind, start serving, and return the base URL (e.g. "http://127.0.0.1:43211").

        OSError if the address cannot be bound; RuntimeError if already started.
        """
        if self._httpd is not None:
            raise RuntimeError(f"blob server already started at {self.url}")
        httpd = _StoreHTTPServer((self.host, self.port), _BlobHandler)
        httpd.store = self.store
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


class _Failure(Exception):
    """One attempt against one provider failed. `retry`: worth another attempt at the same
    provider; `skip`: give up on this provider for the rest of the fetch."""

    def __init__(self, why: str, *, retry: bool, skip: bool = True) -> None:
        super().__init__(why)
        self.retry, self.skip = retry, skip


class _Aborted(_Failure):
    """No attempt was made: the client was closed or a sibling chunk already failed."""

    def __init__(self) -> None:
        super().__init__("aborted (client closed or fetch abandoned)", retry=False, skip=False)


class BlobClient:
    """Fetches blobs by content id from an ordered list of providers (base URLs).

    Blob URL is f"{base}/v1/blobs/{cid}". Every attempt is bounded by `timeout_s` per
    network wait (connect, each read, each write, pool) and, after `timeout_s` of grace, a
    minimum average rate of 64 KiB/s; each provider gets at most `retries` attempts with
    exponential backoff `backoff_s * 2**k` (capped at 5 s). Only transport errors and
    408/429/5xx are retried; a 4xx, a wrong length or a wrong hash fails the provider at
    once. `served` counts bytes received per provider. Proxy environment variables are
    ignored: providers are peers, reached directly. Thread-safe.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        chunk_bytes: int = 4 << 20,
        parallel: int = 4,
        max_bytes: int | None = None,
    ) -> None:
        if timeout_s <= 0 or retries < 1 or backoff_s < 0 or chunk_bytes < 1 or parallel < 1:
            raise ValueError(
                f"need timeout_s ({timeout_s}) > 0, retries ({retries}) >= 1, backoff_s "
                f"({backoff_s}) >= 0, chunk_bytes ({chunk_bytes}) >= 1, parallel ({parallel}) >= 1"
            )
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes ({max_bytes}) must be >= 0 or None")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.chunk_bytes, self.parallel, self.max_bytes = chunk_bytes, parallel, max_bytes
        self.served: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(
                max_connections=max(16, 4 * parallel),
                max_keepalive_connections=max(8, 2 * parallel),
            ),
            headers={"Accept-Encoding": "identity"},  # ranges must count raw bytes
            trust_env=False,
        )

    def fetch(self, cid: str, providers: Sequence[str], size: int | None = None) -> bytes:
        """The blob's bytes, verified against `cid`; BlobError naming each provider's last
        failure if no provider delivers them.

        Unknown size or size <= chunk_bytes: providers in order, whole body each. Known size
        above chunk_bytes: chunk i goes to provider i % len(providers) first, then the
        others, `parallel` chunks at a time; providers that failed are skipped for later
        chunks. If the assembled bytes do not hash to `cid` (someone lied) or a chunk could
        not be had, the remaining providers are tried whole-body, each verified alone.
        A body longer than `size` (when given) or `max_bytes` fails its provider.
        """
        _cid_or_error(cid)
        if not providers:
            raise BlobError(f"cannot fetch {cid}: no providers")
        if size is not None and self.max_bytes is not None and size > self.max_bytes:
            raise BlobError(f"cannot fetch {cid}: {size} bytes exceeds max_bytes={self.max_bytes}")
        failures: dict[str, str] = {}
        candidates = list(providers)
        if size is not None and size > self.chunk_bytes:
            data, dead = self._fetch_chunked(cid, candidates, size, failures)
            if data is not None:
                return data
            candidates = [p for p in candidates if p not in dead]
            logger.warning(
                "blob %s: chunked fetch failed, trying whole body from %s", cid, candidates
            )
        limit = size if size is not None else self.max_bytes
        for p in candidates:
            try:
                return self._with_retries(lambda p=p: self._get(p, cid, None, limit, True))
            except _Failure as f:
                failures[p] = str(f)
        raise self._error("fetch", cid, failures)

    def head_size(self, cid: str, providers: Sequence[str]) -> int:
        """The blob's size from the first provider answering HEAD with 200; BlobError if none."""
        _cid_or_error(cid)
        failures: dict[str, str] = {}
        for p in providers:
            try:
                return self._with_retries(lambda p=p: self._head(p, cid))
            except _Failure as f:
                failures[p] = str(f)
        raise self._error("find size of", cid, failures or {"-": "no providers"})

    def upload(self, base_url: str, data: bytes, cid: str | None = None) -> str:
        """PUT the blob to {base_url}/v1/blobs/{cid} and return its cid.

        BlobError if `cid` is given and is not the data's hash (nothing is sent), or with
        the server's message on a non-retryable 4xx, or after `retries` attempts failing
        with transport errors or 408/429/5xx.
        """
        actual = content_id(data)
        if cid is not None and cid != actual:
            raise BlobError(f"cannot upload {cid}: data hashes to {actual}")
        url = f"{base_url.rstrip('/')}{BLOB_PATH_PREFIX}{actual}"

        def attempt() -> str:
            try:
                resp = self._http.put(
                    url, content=data, headers={"Content-Type": "application/octet-stream"}
                )
            except httpx.TransportError as e:
                raise _Failure(f"{type(e).__name__}: {e}", retry=True) from e
            if resp.is_success:
                return actual
            why = f"HTTP {resp.status_code}: {resp.text[:300]}"
            raise _Failure(why, retry=resp.status_code in _RETRYABLE_STATUS)

        try:
            return self._with_retries(attempt)
        except _Failure as f:
            raise self._error("upload", actual, {base_url: str(f)}) from None

    def close(self) -> None:
        """Close connections; backoff waits in other threads end at once. Idempotent."""
        self._closed.set()
        self._http.close()

    def __enter__(self) -> BlobClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fetch_chunked(
        self, cid: str, providers: list[str], size: int, failures: dict[str, str]
    ) -> tuple[bytes | None, set[str]]:
        """(verified bytes or None, providers to skip from now on)."""
        ranges = [
            (s, min(s + self.chunk_bytes, size) - 1) for s in range(0, size, self.chunk_bytes)
        ]
        out = bytearray(size)
        dead: set[str] = set()
        abort = threading.Event()  # one chunk had no provider left: stop the others

        def one(i: int) -> bool:
            start, end = ranges[i]
            k = i % len(providers)
            for p in providers[k:] + providers[:k]:
                with self._lock:
                    if p in dead:
                        continue
                try:
                    piece = self._with_retries(
                        lambda p=p: self._get(p, cid, (start, end), None, False), abort
                    )
                except _Aborted:
                    return False
                except _Failure as f:
                    with self._lock:
                        failures[p] = str(f)
                        if f.skip:
                            dead.add(p)
                    continue
                out[start : end + 1] = piece  # disjoint slices of a fixed-size buffer
                return True
            abort.set()
            return False

        with ThreadPoolExecutor(max_workers=min(self.parallel, len(ranges))) as pool:
            complete = all(list(pool.map(one, range(len(ranges)))))
        if complete:
            if content_id(out) == cid:
                return bytes(out), dead
            failures["chunks"] = "assembled ranges do not hash to the cid"
        return None, dead

    def _with_retries(self, attempt: Callable[[], T], abort: threading.Event | None = None) -> T:
        last: _Failure | None = None
        for k in range(self.retries):
            if k > 0 and self._closed.wait(min(self.backoff_s * 2 ** (k - 1), _MAX_BACKOFF_S)):
                break
            if self._closed.is_set() or (abort is not None and abort.is_set()):
                break
            try:
                return attempt()
            except _Failure as f:
                last = f
                if not f.retry:
                    break
        raise last or _Aborted()

    def _get(
        self,
        base: str,
        cid: str,
        byte_range: tuple[int, int] | None,
        limit: int | None,
        verify: bool,
    ) -> bytes:
        """One GET attempt: the body (or the range), checked for status, length and hash."""
        url = f"{base.rstrip('/')}{BLOB_PATH_PREFIX}{cid}"
        headers = {"Range": f"bytes={byte_range[0]}-{byte_range[1]}"} if byte_range else {}
        expected = byte_range[1] - byte_range[0] + 1 if byte_range else None
        t0 = time.monotonic()
        try:
            with self._http.stream("GET", url, headers=headers) as resp:
                self._check_status(resp, byte_range)
                declared = int(resp.headers.get("Content-Length", "-1"))
                if expected is not None and declared not in (-1, expected):
                    raise _Failure(f"range of {expected} bytes came as {declared}", retry=False)
                if limit is not None and declared > limit:
                    raise _Failure(f"body of {declared} bytes exceeds limit {limit}", retry=False)
                buf = bytearray()
                for piece in resp.iter_bytes():
                    buf += piece
                    with self._lock:
                        self.served[base] = self.served.get(base, 0) + len(piece)
                    cap = expected if expected is not None else limit
                    if cap is not None and len(buf) > cap:
                        raise _Failure(f"body exceeds {cap} bytes", retry=False)
                    if time.monotonic() - t0 > self.timeout_s + len(buf) / _MIN_RATE_BYTES_S:
                        raise _Failure(f"slower than {_MIN_RATE_BYTES_S} B/s", retry=False)
        except httpx.TransportError as e:
            raise _Failure(f"{type(e).__name__}: {e}", retry=True) from e
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
            raise _Failure(f"{type(e).__name__}: {e}", retry=False) from e
        if expected is not None and len(buf) != expected:
            raise _Failure(f"range of {expected} bytes came as {len(buf)}", retry=False)
        if verify and (actual := content_id(buf)) != cid:
            raise _Failure(f"served {len(buf)} bytes hashing to {actual}", retry=False)
        return bytes(buf)

    @staticmethod
    def _check_status(resp: httpx.Response, byte_range: tuple[int, int] | None) -> None:
        code = resp.status_code
        if byte_range is not None and code == 200:
            # Not this provider's fault, and it may still serve the whole body later.
            raise _Failure("ignores Range (answered 200)", retry=False, skip=False)
        if code != (206 if byte_range is not None else 200):
            raise _Failure(f"HTTP {code}", retry=code in _RETRYABLE_STATUS)
        if byte_range is not None:
            want = f"bytes {byte_range[0]}-{byte_range[1]}/"
            if not resp.headers.get("Content-Range", "").startswith(want):
                raise _Failure(
                    f"Content-Range {resp.headers.get('Content-Range')!r}, asked {want}*",
                    retry=False,
                )

    def _head(self, base: str, cid: str) -> int:
        url = f"{base.rstrip('/')}{BLOB_PATH_PREFIX}{cid}"
        try:
            resp = self._http.head(url)
        except httpx.TransportError as e:
            raise _Failure(f"{type(e).__name__}: {e}", retry=True) from e
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise _Failure(f"{type(e).__name__}: {e}", retry=False) from e
        if resp.status_code != 200:
            raise _Failure(f"HTTP {resp.status_code}", retry=resp.status_code in _RETRYABLE_STATUS)
        try:
            return int(resp.headers["Content-Length"])
        except (KeyError, ValueError):
            raise _Failure("HEAD without a valid Content-Length", retry=False) from None

    @staticmethod
    def _error(action: str, cid: str, failures: dict[str, str]) -> BlobError:
        detail = "; ".join(f"{p}: {why}" for p, why in failures.items())
        return BlobError(f"cannot {action} blob {cid}: {detail}")
