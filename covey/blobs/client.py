"""Fetching blobs by content id from an ordered list of providers, and uploading them.

Trust model (as in hivemind, every record from the network passes a validator): a provider
can be slow, absent or lying, and the client only hands back bytes whose sha256 equals the
requested id. Retries are bounded, failed providers are skipped, and large blobs come in
parallel ranged chunks.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

import httpx

from covey.blobs.store import (
    BLOB_PATH_PREFIX,
    UPLOAD_NONCE_HEADER,
    UPLOAD_PEER_HEADER,
    UPLOAD_SIGNATURE_HEADER,
    BlobError,
    LocalBlobError,
    cid_or_error,
    upload_message,
)
from covey.blobs.streaming import StreamingFetch, _Aborted, _Failure
from covey.protocol.content import content_id

if TYPE_CHECKING:
    from covey.trust.identity import Identity

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 5.0
_MIN_RATE_BYTES_S = 64 << 10  # after timeout_s of grace, a transfer slower than this is cut
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})

T = TypeVar("T")


def upload_headers(identity: Identity, run_id: str, cid: str, size: int) -> dict[str, str]:
    """Headers that sign one upload of blob `cid` of `size` bytes to run `run_id` (fresh
    nonce: make new headers for every attempt)."""
    from covey.trust.identity import make_nonce  # the peer side only: keep blobs light

    nonce = make_nonce()
    signature = identity.sign(upload_message(run_id, identity.peer_id, cid, size, nonce))
    return {
        UPLOAD_PEER_HEADER: identity.peer_id,
        UPLOAD_NONCE_HEADER: nonce,
        UPLOAD_SIGNATURE_HEADER: signature,
    }


def check_provider(base: str) -> str:
    """`base` if it is an http(s) URL with a host; BlobError otherwise. Providers are peers'
    blob servers: a file://, ftp:// or host-less URL is never fetched, nor an address no
    peer serves from (link-local: cloud metadata services; multicast), so a registered URL
    cannot point the coordinator at them (no SSRF). Loopback, unspecified (= this host)
    and private addresses stay allowed: local clusters and LANs run there."""
    try:
        parts = urlsplit(base)
        host = parts.hostname
    except ValueError as e:
        raise BlobError(f"provider {base[:100]!r} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise BlobError(f"provider {base[:100]!r} is not an http(s) URL with a host")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return base  # a name: resolved by the connection, never to a file or a redirect
    if ip.is_link_local or ip.is_multicast:
        raise BlobError(f"provider {base[:100]!r}: address {ip} serves no peer's blobs")
    return base


class BlobClient(StreamingFetch):
    """Fetches blobs by content id from an ordered list of providers (base URLs).

    Blob URL is f"{base}/v1/blobs/{cid}". Every attempt is bounded by `timeout_s` per
    network wait (connect, each read, each write, pool) and, after `timeout_s` of grace, a
    minimum average rate of 64 KiB/s; each provider gets at most `retries` attempts with
    exponential backoff `backoff_s * 2**k` (capped at 5 s). Only transport errors and
    408/429/5xx are retried; a 4xx, a wrong length or a wrong hash fails the provider at
    once. `served` counts bytes received per provider. Proxy environment variables are
    ignored: providers are peers, reached directly. Only http(s) providers are contacted,
    and redirects are never followed (a provider cannot send the client elsewhere) but
    from the providers in `redirects_from`, one hop.
    Thread-safe.
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
        redirects_from: Sequence[str] = (),
    ) -> None:
        """`redirects_from`: providers (base URLs, e.g. the coordinator's) whose GETs may
        answer with one temporary redirect, followed to an http(s) URL that passes
        `check_provider` (an object store's presigned URL: covey.blobs.s3); any other
        provider's redirect fails it, as before."""
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
        self.redirects_from = frozenset(b.rstrip("/") for b in redirects_from)
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
            follow_redirects=False,  # one hop at most, by hand (_stream); else a 3xx fails
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
        cid_or_error(cid)
        if not providers:
            raise BlobError(f"cannot fetch {cid}: no providers")
        if size is not None and self.max_bytes is not None and size > self.max_bytes:
            raise BlobError(f"cannot fetch {cid}: {size} bytes exceeds max_bytes={self.max_bytes}")
        failures: dict[str, str] = {}
        candidates = self._candidates(providers, failures)
        if not candidates:
            raise self._error("fetch", cid, failures)
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
                return self._with_retries(lambda p=p: self._get_bytes(p, cid, limit))
            except _Failure as f:
                failures[p] = str(f)
        raise self._error("fetch", cid, failures)

    def _candidates(self, providers: Sequence[str], failures: dict[str, str]) -> list[str]:
        out = []
        for p in providers:
            try:
                out.append(check_provider(p))
            except BlobError as e:
                failures[p] = str(e)
        return out

    def _get_bytes(self, base: str, cid: str, limit: int | None) -> bytes:
        """One whole-body attempt into memory, checked against `cid`."""
        buf = bytearray()
        self._get(base, cid, None, limit, buf.extend)
        if (actual := content_id(buf)) != cid:
            raise _Failure(f"served {len(buf)} bytes hashing to {actual}", retry=False)
        return bytes(buf)

    def head_size(self, cid: str, providers: Sequence[str]) -> int:
        """The blob's size from the first provider answering HEAD with 200; BlobError if none."""
        cid_or_error(cid)
        failures: dict[str, str] = {}
        for p in providers:
            try:
                return self._with_retries(lambda p=p: self._head(p, cid))
            except _Failure as f:
                failures[p] = str(f)
        raise self._error("find size of", cid, failures or {"-": "no providers"})

    def upload(
        self,
        base_url: str,
        data: bytes,
        cid: str | None = None,
        *,
        signer: tuple[Identity, str] | None = None,
    ) -> str:
        """PUT the blob to {base_url}/v1/blobs/{cid} and return its cid. With `signer`
        (identity, run id), each attempt carries freshly signed upload headers: the
        coordinator takes blobs from members only.

        BlobError if `cid` is given and is not the data's hash (nothing is sent), or with
        the server's message on a non-retryable 4xx, or after `retries` attempts failing
        with transport errors or 408/429/5xx.
        """
        actual = content_id(data)
        if cid is not None and cid != actual:
            raise BlobError(f"cannot upload {cid}: data hashes to {actual}")
        url = f"{base_url.rstrip('/')}{BLOB_PATH_PREFIX}{actual}"

        def attempt() -> str:
            headers = {"Content-Type": "application/octet-stream"}
            if signer is not None:
                headers.update(upload_headers(signer[0], signer[1], actual, len(data)))
            try:
                resp = self._http.put(url, content=data, headers=headers)
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
        # pieces as they arrive: no buffer is allocated from a size someone declared
        pieces, dead = self._over_ranges(
            providers, size, failures, lambda p, start, end: self._get_range(p, cid, start, end)
        )
        if pieces is not None:
            out = b"".join(pieces)
            pieces.clear()
            if content_id(out) == cid:
                return out, dead
            failures["chunks"] = "assembled ranges do not hash to the cid"
        return None, dead

    def _get_range(self, base: str, cid: str, start: int, end: int) -> bytes:
        buf = bytearray()
        self._get(base, cid, (start, end), None, buf.extend)
        return bytes(buf)

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
        if self._closed.is_set():
            raise LocalBlobError("the fetching client was closed")
        raise last or _Aborted()

    def _get(
        self,
        base: str,
        cid: str,
        byte_range: tuple[int, int] | None,
        limit: int | None,
        sink: Callable[[bytes], None],
        on_length: Callable[[int], None] | None = None,
    ) -> int:
        """One GET attempt: status and length checked, each piece handed to `sink` as it
        arrives (never collected here); returns the byte count. `on_length(declared)`
        sees the Content-Length (-1: none) before the first piece. The caller checks the
        hash; a sink's BlobError fails the attempt without a retry."""
        url = f"{base.rstrip('/')}{BLOB_PATH_PREFIX}{cid}"
        headers = {"Range": f"bytes={byte_range[0]}-{byte_range[1]}"} if byte_range else {}
        expected = byte_range[1] - byte_range[0] + 1 if byte_range else None
        t0 = time.monotonic()
        n = 0
        try:
            with self._stream(base, url, headers) as resp:
                self._check_status(resp, byte_range)
                declared = int(resp.headers.get("Content-Length", "-1"))
                if expected is not None and declared not in (-1, expected):
                    raise _Failure(f"range of {expected} bytes came as {declared}", retry=False)
                if limit is not None and declared > limit:
                    raise _Failure(f"body of {declared} bytes exceeds limit {limit}", retry=False)
                if on_length is not None:
                    on_length(declared)
                cap = expected if expected is not None else limit
                for piece in resp.iter_bytes():
                    n += len(piece)
                    with self._lock:
                        self.served[base] = self.served.get(base, 0) + len(piece)
                    if cap is not None and n > cap:
                        raise _Failure(f"body exceeds {cap} bytes", retry=False)
                    sink(piece)
                    if time.monotonic() - t0 > self.timeout_s + n / _MIN_RATE_BYTES_S:
                        raise _Failure(f"slower than {_MIN_RATE_BYTES_S} B/s", retry=False)
        except httpx.TransportError as e:
            raise _Failure(f"{type(e).__name__}: {e}", retry=True) from e
        except LocalBlobError:
            raise
        except BlobError as e:
            raise _Failure(str(e), retry=False) from e
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
            raise _Failure(f"{type(e).__name__}: {e}", retry=False) from e
        if expected is not None and n != expected:
            raise _Failure(f"range of {expected} bytes came as {n}", retry=False)
        return n

    @contextmanager
    def _stream(self, base: str, url: str, headers: dict[str, str]) -> Iterator[httpx.Response]:
        """GET `url`; from a provider in `redirects_from`, follow at most one temporary
        redirect (302, 303, 307) to a URL `check_provider` accepts: a coordinator whose
        blobs are in an object store answers with a presigned URL there (covey.blobs.s3).
        The redirected body is checked like any other (its length, then its hash, by the
        caller); a second redirect fails it."""
        resp = self._http.send(self._http.build_request("GET", url, headers=headers), stream=True)
        try:
            location = resp.headers.get("Location", "")
            if (
                resp.status_code in (302, 303, 307)
                and base.rstrip("/") in self.redirects_from
                and location
            ):
                check_provider(location)  # BlobError: an http(s) URL no metadata service
                resp.close()
                resp = self._http.send(
                    self._http.build_request("GET", location, headers=headers), stream=True
                )
            yield resp
        finally:
            resp.close()

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
