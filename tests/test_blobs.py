"""The blob plane over real sockets on 127.0.0.1: store, range parsing, server, client.

Misbehaving providers (corrupt, Range-ignoring, always-failing, hanging, PUT-accepting) are
tiny stdlib servers defined here; nothing about the network is mocked.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from covey.blobs import (
    BlobClient,
    BlobError,
    BlobServer,
    BlobStore,
    RangeNotSatisfiable,
    parse_range,
)
from covey.protocol.content import content_id

pytestmark = pytest.mark.network

Answer = Callable[[BaseHTTPRequestHandler], None]


class Scripted:
    """A stdlib HTTP/1.0 server on 127.0.0.1 whose every request is answered by `answer`."""

    def __init__(self, answer: Answer) -> None:
        self.requests = 0
        self.release = threading.Event()  # set at teardown: frees handlers that hang
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _any(self) -> None:
                outer.requests += 1
                answer(self)

            do_GET = do_HEAD = do_PUT = _any

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # clients may hang up early
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def reply(h: BaseHTTPRequestHandler, status: int, body: bytes, **headers: str) -> None:
    h.send_response(status)
    for k, v in headers.items():
        h.send_header(k.replace("_", "-"), v)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)


@pytest.fixture
def scripted() -> Iterator[Callable[[Answer], Scripted]]:
    servers: list[Scripted] = []

    def make(answer: Answer) -> Scripted:
        servers.append(Scripted(answer))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A port that is bound but not listening: connecting is refused at once, deterministically."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[bytes], str]]:
    """Start a BlobServer over a fresh store holding `data`; returns its base URL."""
    servers: list[BlobServer] = []

    def make(data: bytes) -> str:
        store = BlobStore(tmp_path / f"store{len(servers)}")
        store.put(data)
        servers.append(BlobServer(store))
        return servers[-1].start()

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def client() -> Iterator[BlobClient]:
    with BlobClient(timeout_s=2.0, retries=2, backoff_s=0.01) as c:
        yield c


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---- store ----------------------------------------------------------------------------


def test_store_put_get_roundtrip(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    cid = store.put(b"hello")
    assert cid == content_id(b"hello")
    assert store.put(b"hello") == cid  # idempotent
    assert store.has(cid) and store.get(cid) == b"hello" and store.size(cid) == 5
    assert store.path(cid) == tmp_path / cid[:2] / cid
    assert store.read_range(cid, 1, 3) == b"ell"
    assert store.cids() == [cid]
    empty = store.put(b"")
    assert store.get(empty) == b"" and store.size(empty) == 0
    store.put_verified(content_id(b"x"), b"x")
    assert store.get(content_id(b"x")) == b"x"
    store.delete(cid)
    store.delete(cid)  # deleting a missing blob is fine
    assert not store.has(cid) and cid not in store.cids()
    with pytest.raises(BlobError, match=cid):
        store.get(cid)
    with pytest.raises(BlobError, match=cid):
        store.size(cid)


def test_store_read_range_bounds(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    cid = store.put(b"0123456789")
    assert store.read_range(cid, 0, 9) == b"0123456789"
    for start, end in [(-1, 3), (5, 4), (0, 10), (10, 10)]:
        with pytest.raises(BlobError, match="range"):
            store.read_range(cid, start, end)


def test_put_verified_mismatch_and_size_limit_leave_store_unchanged(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, max_blob_bytes=8)
    store.put(b"keep")
    before = all_files(tmp_path)
    with pytest.raises(BlobError, match="hashes to"):
        store.put_verified(content_id(b"good"), b"evil")
    with pytest.raises(BlobError, match="max_blob_bytes"):
        store.put_verified(content_id(b"123456789"), b"123456789")
    with pytest.raises(BlobError, match="max_blob_bytes"):
        store.put(b"123456789")
    assert all_files(tmp_path) == before


@pytest.mark.parametrize(
    "bad",
    [
        "../x",
        "../" + "a" * 61,
        "A" * 64,
        content_id(b"x").upper(),
        "a" * 63,
        "a" * 65,
        content_id(b"x") + "\n",
        "ab/" + "c" * 61,
        "/etc/passwd",
        "",
    ],
)
def test_store_rejects_malformed_cids(tmp_path: Path, bad: str) -> None:
    store = BlobStore(tmp_path / "s")
    store.put(b"keep")
    before = all_files(tmp_path)
    assert store.has(bad) is False
    for call in (store.path, store.get, store.size, store.delete):
        with pytest.raises(BlobError, match="not a content id"):
            call(bad)
    with pytest.raises(BlobError, match="not a content id"):
        store.put_verified(bad, b"x")
    assert all_files(tmp_path) == before


def test_failed_rename_leaves_no_blob_and_no_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = BlobStore(tmp_path)

    def broken_replace(src: object, dst: object) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(BlobError, match="disk went away"):
        store.put(b"data")
    assert not store.has(content_id(b"data")) and store.cids() == []
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_crash_leftovers_are_never_blobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed between write and rename leaves a tmp file: never listed or served."""
    store = BlobStore(tmp_path)
    cid = content_id(b"data")

    class Killed(BaseException):
        """Stands in for SIGKILL; the cleanup a kill would skip is disabled below."""

    def die(src: object, dst: object) -> None:
        raise Killed

    monkeypatch.setattr(os, "replace", die)
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: None)
    with pytest.raises(Killed):
        store.put(b"data")
    monkeypatch.undo()
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(leftovers) == 1 and leftovers[0].name != cid
    (tmp_path / "ff").mkdir()
    (tmp_path / "ff" / cid).write_bytes(b"data")  # a stray name in the wrong shard
    assert not store.has(cid) and store.cids() == []
    with pytest.raises(BlobError):
        store.get(cid)
    assert store.put(b"data") == cid and store.cids() == [cid]  # a retry after restart works


# ---- parse_range ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "size", "want"),
    [
        (None, 10, None),
        ("bytes=0-9", 10, (0, 9)),
        ("bytes=2-4", 10, (2, 4)),
        ("bytes=5-5", 10, (5, 5)),
        ("bytes=5-100", 10, (5, 9)),
        ("bytes=3-", 10, (3, 9)),
        ("bytes=-3", 10, (7, 9)),
        ("bytes=-100", 10, (0, 9)),
        (" Bytes=0-0 ", 1, (0, 0)),
    ],
)
def test_parse_range_ok(header: str | None, size: int, want: tuple[int, int] | None) -> None:
    assert parse_range(header, size) == want


@pytest.mark.parametrize(
    ("header", "size"),
    [
        ("bytes=10-", 10),
        ("bytes=10-20", 10),
        ("bytes=5-4", 10),
        ("bytes=-0", 10),
        ("bytes=-", 10),
        ("bytes=0-0", 0),
        ("bytes=-5", 0),
        ("bytes=0-1,3-4", 10),
        ("items=0-1", 10),
        ("bytes=a-b", 10),
        ("bytes=-1-2", 10),
        ("", 10),
    ],
)
def test_parse_range_unsatisfiable(header: str, size: int) -> None:
    with pytest.raises(RangeNotSatisfiable):
        parse_range(header, size)


# ---- server -----------------------------------------------------------------------------


def test_server_get_head_range_and_errors(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = bytes(range(256)) * 4
    cid = store.put(data)
    with BlobServer(store) as server, httpx.Client(timeout=5, trust_env=False) as http:
        url = f"{server.url}/v1/blobs/{cid}"
        r = http.get(url)
        assert r.status_code == 200 and r.content == data
        assert r.headers["content-length"] == str(len(data))
        r = http.get(url, headers={"Range": "bytes=10-19"})
        assert r.status_code == 206 and r.content == data[10:20]
        assert r.headers["content-range"] == f"bytes 10-19/{len(data)}"
        r = http.get(url, headers={"Range": "bytes=-4"})
        assert r.status_code == 206 and r.content == data[-4:]
        r = http.head(url)
        assert r.status_code == 200 and r.content == b""
        assert r.headers["content-length"] == str(len(data))
        r = http.get(url, headers={"Range": f"bytes={len(data)}-"})
        assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(data)}"
        assert http.get(url, headers={"Range": "bytes=0-1,4-5"}).status_code == 416
        for path in [
            f"/v1/blobs/{content_id(b'absent')}",
            f"/v1/blobs/{cid.upper()}",
            "/v1/blobs/../../etc/passwd",
            f"/v1/blobs/{cid}/x",
            f"/v2/blobs/{cid}",
            "/",
        ]:
            r = http.get(server.url + path)
            assert r.status_code == 404, path
            assert r.headers["content-length"] == str(len(r.content))
        assert http.head(f"{server.url}/v1/blobs/{content_id(b'absent')}").status_code == 404
        assert http.put(url, content=b"x").status_code == 405


# ---- client -----------------------------------------------------------------------------


def test_fetch_and_head_size(serve: Callable[[bytes], str], client: BlobClient) -> None:
    data = os.urandom(5000)
    url = serve(data)
    assert client.fetch(content_id(data), [url]) == data
    assert client.fetch(content_id(data), [url + "/"], size=len(data)) == data
    assert client.head_size(content_id(data), [url]) == len(data)
    assert client.served[url] == len(data)
    with pytest.raises(BlobError, match="not a content id"):
        client.fetch("../x", [url])
    with pytest.raises(BlobError, match="HTTP 404"):
        client.head_size(content_id(b"absent"), [url])


def test_fetch_falls_back_when_first_provider_is_down(
    serve: Callable[[bytes], str], refused_url: str, client: BlobClient
) -> None:
    data = b"payload" * 100
    good = serve(data)
    assert client.fetch(content_id(data), [refused_url, good]) == data
    assert client.head_size(content_id(data), [refused_url, good]) == len(data)


def test_fetch_falls_back_when_first_provider_lies(
    serve: Callable[[bytes], str], scripted: Callable[[Answer], Scripted], client: BlobClient
) -> None:
    data = b"the truth" * 50
    liar = scripted(lambda h: reply(h, 200, b"x" * len(data)))
    good = serve(data)
    assert client.fetch(content_id(data), [liar.url, good]) == data
    assert liar.requests == 1  # a wrong hash is not retried
    with pytest.raises(BlobError, match="hashing to") as err:
        client.fetch(content_id(data), [liar.url])
    assert liar.url in str(err.value) and content_id(data) in str(err.value)


def test_parallel_chunked_fetch_spreads_over_providers(
    serve: Callable[[bytes], str], client: BlobClient
) -> None:
    data = os.urandom(3 << 20)
    a, b = serve(data), serve(data)
    with BlobClient(timeout_s=5, retries=2, backoff_s=0.01, chunk_bytes=256 << 10) as c:
        assert c.fetch(content_id(data), [a, b], size=len(data)) == data
        assert c.served[a] > 0 and c.served[b] > 0
        assert c.served[a] + c.served[b] == len(data)


def test_chunked_fetch_survives_down_lying_and_rangeless_providers(
    serve: Callable[[bytes], str],
    scripted: Callable[[Answer], Scripted],
    refused_url: str,
) -> None:
    data = os.urandom(1 << 20)
    cid = content_id(data)

    def lying_ranges(h: BaseHTTPRequestHandler) -> None:
        ranged = parse_range(h.headers["Range"], len(data))
        if ranged is None:
            reply(h, 200, b"\0" * len(data))
            return
        start, end = ranged
        reply(h, 206, b"\0" * (end - start + 1), Content_Range=f"bytes {start}-{end}/{len(data)}")

    liar = scripted(lying_ranges)
    rangeless = scripted(lambda h: reply(h, 200, data))
    good = serve(data)
    with BlobClient(timeout_s=5, retries=2, backoff_s=0.01, chunk_bytes=128 << 10) as c:
        # Chunks from the liar poison the assembly; whole-body fallback finds the honest one.
        assert c.fetch(cid, [liar.url, refused_url, good], size=len(data)) == data
        # A provider that ignores Range is still used, whole-body.
        assert c.fetch(cid, [rangeless.url], size=len(data)) == data
        with pytest.raises(BlobError, match="hashing to"):
            c.fetch(cid, [liar.url], size=len(data))


def test_size_limits(serve: Callable[[bytes], str]) -> None:
    data = b"z" * 1000
    url = serve(data)
    with BlobClient(max_bytes=100, retries=1) as c:
        with pytest.raises(BlobError, match="exceeds"):
            c.fetch(content_id(data), [url])
        with pytest.raises(BlobError, match="max_bytes"):
            c.fetch(content_id(data), [url], size=len(data))
        assert c.served.get(url, 0) == 0  # refused on the declared length, before the body
    with BlobClient(retries=1) as c, pytest.raises(BlobError, match="exceeds"):
        c.fetch(content_id(data), [url], size=10)  # longer than promised


def test_always_failing_provider_is_retried_a_bounded_number_of_times(
    scripted: Callable[[Answer], Scripted], refused_url: str
) -> None:
    broken = scripted(lambda h: reply(h, 503, b"busy"))
    retries, timeout_s, backoff_s = 3, 1.0, 0.02
    with BlobClient(timeout_s=timeout_s, retries=retries, backoff_s=backoff_s) as c:
        t0 = time.monotonic()
        with pytest.raises(BlobError, match="HTTP 503") as err:
            c.fetch(content_id(b"x"), [broken.url, refused_url])
        elapsed = time.monotonic() - t0
    assert broken.requests == retries
    assert refused_url in str(err.value)
    # Generous: every attempt of both providers timing out, plus every backoff, plus slack.
    assert elapsed < 2 * retries * (2 * timeout_s + backoff_s * 2**retries) + 2


def test_hanging_provider_times_out(scripted: Callable[[Answer], Scripted]) -> None:
    hung = scripted(lambda h: hung.release.wait(timeout=30))  # answers nothing until teardown
    retries, timeout_s = 2, 0.2
    with BlobClient(timeout_s=timeout_s, retries=retries, backoff_s=0.01) as c:
        t0 = time.monotonic()
        with pytest.raises(BlobError, match="Timeout"):
            c.fetch(content_id(b"x"), [hung.url])
        elapsed = time.monotonic() - t0
    assert hung.requests == retries
    assert elapsed < retries * (2 * timeout_s + 0.5) + 2


def test_upload(tmp_path: Path, scripted: Callable[[Answer], Scripted], client: BlobClient) -> None:
    store = BlobStore(tmp_path, max_blob_bytes=64)

    def accept(h: BaseHTTPRequestHandler) -> None:  # a minimal coordinator-side PUT
        body = h.rfile.read(int(h.headers["Content-Length"]))
        try:
            store.put_verified(h.path.rsplit("/", 1)[-1], body)
        except BlobError as e:
            reply(h, 400, str(e).encode())
        else:
            reply(h, 201, b"")

    server = scripted(accept)
    cid = client.upload(server.url, b"contribution")
    assert cid == content_id(b"contribution") and store.get(cid) == b"contribution"
    with pytest.raises(BlobError, match="hashes to"):
        client.upload(server.url, b"data", cid=content_id(b"other"))  # refused before sending
    n = server.requests
    with pytest.raises(BlobError, match=r"HTTP 400.*max_blob_bytes"):
        client.upload(server.url, b"y" * 100)
    assert server.requests == n + 1  # a 4xx is not retried

    busy = scripted(lambda h: reply(h, 503, b"try later"))
    with pytest.raises(BlobError, match="HTTP 503: try later"):
        client.upload(busy.url, b"data")
    assert busy.requests == client.retries


# ---- streamed writes, signed uploads, providers that redirect ------------------------


def test_writer_streams_and_checks_count_and_hash(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, max_blob_bytes=64)
    data = b"streamed in pieces"
    w = store.writer(content_id(data), len(data))
    for i in range(0, len(data), 5):
        w.write(data[i : i + 5])
    w.commit()
    assert store.get(content_id(data)) == data
    short = store.writer(content_id(b"abc"), 3)
    short.write(b"ab")
    with pytest.raises(BlobError, match="2 of 3 bytes"):
        short.commit()
    long = store.writer(content_id(b"abc"), 3)
    with pytest.raises(BlobError, match="more than the declared 3"):
        long.write(b"abcd")
    liar = store.writer(content_id(b"abc"), 3)
    liar.write(b"xyz")
    with pytest.raises(BlobError, match="hashes to"):
        liar.commit()
    with pytest.raises(BlobError, match="max_blob_bytes"):
        store.writer(content_id(b"big"), 65)  # refused before any file is made
    assert not store.has(content_id(b"abc"))
    kept, shard = content_id(data), content_id(b"abc")[:2]
    # no temporary file is left behind
    assert all_files(tmp_path) == sorted([kept[:2], f"{kept[:2]}/{kept}", shard])


def test_signed_upload_headers(scripted: Callable[[Answer], Scripted], client: BlobClient) -> None:
    from covey.blobs.store import upload_message
    from covey.trust.identity import Identity, verify

    seen: list[dict[str, str]] = []

    def accept(h: BaseHTTPRequestHandler) -> None:
        h.rfile.read(int(h.headers["Content-Length"]))
        seen.append(dict(h.headers))
        reply(h, 429 if len(seen) == 1 else 200, b"")  # busy once: the retry re-signs

    key = Identity.generate()
    server = scripted(accept)
    cid = client.upload(server.url, b"payload", signer=(key, "run-1"))
    assert len(seen) == 2 and seen[0]["X-Covey-Nonce"] != seen[1]["X-Covey-Nonce"]
    for h in seen:
        assert h["X-Covey-Peer"] == key.peer_id
        message = upload_message("run-1", key.peer_id, cid, 7, h["X-Covey-Nonce"])
        assert verify(key.public_key, message, h["X-Covey-Signature"])
        other = upload_message("run-2", key.peer_id, cid, 7, h["X-Covey-Nonce"])
        assert not verify(key.public_key, other, h["X-Covey-Signature"])


def test_fetch_never_follows_redirects_or_odd_schemes(
    serve: Callable[[bytes], str], scripted: Callable[[Answer], Scripted], client: BlobClient
) -> None:
    data = b"the real blob"
    good = serve(data)
    bounce = scripted(lambda h: reply(h, 302, b"", Location=f"{good}{h.path}"))
    with pytest.raises(BlobError, match="HTTP 302"):
        client.fetch(content_id(data), [bounce.url])
    assert client.served.get(good, 0) == 0  # never went where the redirect pointed
    for odd in ("file:///etc/passwd", "ftp://127.0.0.1/", "http://", "gopher://x"):
        with pytest.raises(BlobError, match="not an http"):
            client.fetch(content_id(data), [odd])
    for odd in ("http://169.254.169.254", "http://[fe80::1]:80", "http://224.0.0.1"):
        with pytest.raises(BlobError, match="serves no peer's blobs"):
            client.fetch(content_id(data), [odd])
    assert client.fetch(content_id(data), ["file:///etc/passwd", good]) == data  # skipped
