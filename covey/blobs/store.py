"""The blob store: immutable content-addressed bytes in a directory, named by sha256.

`BlobStore` writes each blob atomically under its content id; `parse_range` reads the single
HTTP byte range that the blob server (covey.blobs.server) and the coordinator serve.
Shared by both ends of the blob plane: `BlobError`, the content-id checks, and the wire
path `BLOB_PATH_PREFIX` (`GET|HEAD {base}/v1/blobs/{cid}`, `PUT` on the coordinator only).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import tempfile
import threading
from pathlib import Path

from covey.protocol.content import content_id, file_content_id, is_content_id

BLOB_PATH_PREFIX = "/v1/blobs/"
# A blob upload is signed in headers (its body is the blob): who, which blob, how big
UPLOAD_PURPOSE = "PUT /v1/blobs"
UPLOAD_PEER_HEADER = "X-Covey-Peer"
UPLOAD_NONCE_HEADER = "X-Covey-Nonce"
UPLOAD_SIGNATURE_HEADER = "X-Covey-Signature"
_TMP_PREFIX = ".tmp-"  # never a content id, so a crash's leftover is never seen as a blob


class BlobError(Exception):
    """A blob could not be stored or fetched; the message names the cid and why."""


class LocalBlobError(BlobError):
    """This side failed, not the bytes or whoever served them: the store's disk (I/O
    errors, no space) or a fetching client closed under it. A fetch passes it through
    unchanged, so a caller never blames a peer for it (covey.coordinator.intake). A full
    connection pool is not one: other peers can fill it."""


def upload_message(run_id: str, peer_id: str, cid: str, size: int, nonce: str) -> bytes:
    """The bytes an upload's signature covers: its purpose, the run, the uploader, the blob
    and its exact size, and a nonce (covey.trust.identity.make_nonce). Its own prefix keeps
    it from ever reading as a signed JSON request, and a JSON request from reading as it."""
    fields = ("covey-upload/v1", UPLOAD_PURPOSE, run_id, peer_id, cid, str(size), nonce)
    return "\n".join(fields).encode()


def is_cid(value: object) -> bool:
    """Whether `value` is a content id: exactly 64 lowercase hex digits."""
    # The length check also refuses "<cid>\n", which is_content_id's `$` lets through.
    return isinstance(value, str) and len(value) == 64 and is_content_id(value)


def cid_or_error(cid: str) -> str:
    """`cid` unchanged if it is a content id; BlobError naming it otherwise."""
    if not is_cid(cid):
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
        cid_or_error(cid)
        return self.root / cid[:2] / cid

    def has(self, cid: str) -> bool:
        """Whether blob `cid` is stored; False (never an error) for a malformed cid."""
        return is_cid(cid) and self.path(cid).is_file()

    def size(self, cid: str) -> int:
        """The blob's length in bytes; BlobError if it is missing or cid is malformed."""
        try:
            return self.path(cid).stat().st_size
        except FileNotFoundError:
            raise BlobError(f"blob {cid} is not stored") from None

    def modified(self, cid: str) -> float:
        """When the blob was stored (seconds since the epoch); BlobError if missing."""
        try:
            return self.path(cid).stat().st_mtime
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
        cid_or_error(cid)
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

    def view(self, cid: str) -> memoryview:
        """The blob's bytes mapped read-only from its file: pages are read as they are used
        and the kernel may drop them again, so N big blobs viewed at once are not N blobs
        of process memory (as `get` would make them). BlobError if missing or malformed."""
        try:
            with self.path(cid).open("rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return memoryview(b"")
                return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except FileNotFoundError:
            raise BlobError(f"blob {cid} is not stored") from None
        except OSError as e:
            raise BlobError(f"cannot map blob {cid}: {e}") from e

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

    def writer(self, cid: str, size: int, *, capped: bool = True) -> BlobWriter:
        """A `BlobWriter` that streams exactly `size` bytes of blob `cid` into the store.
        BlobError (nothing created) if cid is malformed or, when `capped` (bytes a peer
        sends us unasked), size exceeds max_blob_bytes. Uncapped: a blob this process
        asked for, whose size the caller checked against what the run's model implies."""
        cid_or_error(cid)
        if size < 0:
            raise BlobError(f"blob {cid}: negative size {size}")
        if capped:
            self._check_size(cid, size)
        return BlobWriter(self, cid, size)

    def range_writer(self, cid: str, size: int, *, capped: bool = True) -> RangeWriter:
        """A `RangeWriter`: blob `cid` of `size` bytes arriving as disjoint ranges in any
        order, from several threads. BlobError as for `writer`."""
        cid_or_error(cid)
        if size < 0:
            raise BlobError(f"blob {cid}: negative size {size}")
        if capped:
            self._check_size(cid, size)
        return RangeWriter(self, cid, size)

    def scratch(self) -> Path:
        """A new empty temporary file inside the store (same filesystem, so `adopt` is a
        rename); never listed or served. The caller writes it, then adopts or deletes it."""
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=_TMP_PREFIX, suffix=".part")
        except OSError as e:
            raise LocalBlobError(f"cannot create a file in {self.root}: {e}") from e
        os.close(fd)
        return Path(tmp)

    def adopt(self, path: Path, cid: str | None = None) -> tuple[str, int]:
        """Move a file this process wrote (e.g. in `scratch()`) into the store as a blob;
        returns (cid, size). Its hash is computed by reading it in pieces unless `cid` is
        given (the writer hashed it on the way out). Not capped by max_blob_bytes: the
        store's owner may keep states of any size. The file is gone afterwards either way.
        BlobError on I/O errors or a malformed cid."""
        path = Path(path)
        try:
            cid = cid_or_error(cid) if cid is not None else file_content_id(path)
            size = path.stat().st_size
            final = self.path(cid)
            if final.is_file():  # immutable: same id, same bytes
                path.unlink()
                self._landed(cid, final)
                return cid, size
            final.parent.mkdir(exist_ok=True)
            with path.open("rb+") as f:
                os.fsync(f.fileno())
            os.replace(path, final)
        except OSError as e:
            path.unlink(missing_ok=True)
            raise LocalBlobError(f"cannot store {path.name}: {e}") from e
        _fsync_dir(final.parent)
        self._landed(cid, final)
        return cid, size

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
                if is_cid(f.name) and f.name[:2] == shard.name and f.is_file():
                    out.append(f.name)
        return sorted(out)

    def _landed(self, cid: str, path: Path) -> None:
        """Blob `cid` is now at `path` (its place in the store): a store that keeps blobs
        elsewhere too copies it there (covey.blobs.s3); this one has nothing to do."""

    def _check_size(self, cid: str, n: int) -> None:
        if self.max_blob_bytes is not None and n > self.max_blob_bytes:
            raise BlobError(f"blob {cid}: {n} bytes exceeds max_blob_bytes={self.max_blob_bytes}")

    def _write(self, cid: str, data: bytes) -> None:
        self._check_size(cid, len(data))
        final = self.path(cid)
        if final.is_file():
            self._landed(cid, final)
            return  # immutable: same id, same bytes
        try:
            final.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=_TMP_PREFIX, suffix=".part")
        except OSError as e:
            raise LocalBlobError(f"cannot store blob {cid}: {e}") from e
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException as e:
            Path(tmp).unlink(missing_ok=True)  # then re-raised: nothing is swallowed
            if isinstance(e, OSError):
                raise LocalBlobError(f"cannot store blob {cid}: {e}") from e
            raise
        _fsync_dir(final.parent)
        self._landed(cid, final)


class _PartWriter:
    """What both writers share: a `.part` file beside the blob's place, and a `commit` that
    checks the count and the hash and renames the file into place, or aborts. Subclasses
    say how bytes arrive, how the file is closed (`_close`) and hashed (`_digest`)."""

    def __init__(self, store: BlobStore, cid: str, size: int) -> None:
        self.cid, self.size, self.received = cid, size, 0
        self._store, self._final = store, store.path(cid)
        try:
            self._final.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._final.parent, prefix=_TMP_PREFIX, suffix=".part")
        except OSError as e:
            raise LocalBlobError(f"cannot store blob {cid}: {e}") from e
        self._fd: int | None = fd
        self._tmp = Path(tmp)

    def _close(self) -> None:
        """Flush, fsync and close the file; idempotent."""
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def _digest(self) -> str:
        """The content id of what was written (the file is closed)."""
        return file_content_id(self._tmp)

    def commit(self) -> None:
        """Put the blob in place; BlobError (writer aborted, store unchanged) if fewer bytes
        than declared arrived or they do not hash to the cid."""
        try:
            if self.received != self.size:
                raise BlobError(f"blob {self.cid}: {self.received} of {self.size} bytes arrived")
            self._close()
            actual = self._digest()
            if actual != self.cid:
                raise BlobError(f"blob {self.cid}: data hashes to {actual}, refusing to store")
            os.replace(self._tmp, self._final)
        except OSError as e:
            self.abort()
            raise LocalBlobError(f"cannot store blob {self.cid}: {e}") from e
        except BlobError:
            self.abort()
            raise
        _fsync_dir(self._final.parent)
        self._store._landed(self.cid, self._final)

    def abort(self) -> None:
        """Drop what was written; idempotent."""
        try:
            if self._fd is not None:
                os.close(self._fd)
        except OSError:
            pass  # already unusable: the file is removed below either way
        self._fd = None
        self._tmp.unlink(missing_ok=True)


class BlobWriter(_PartWriter):
    """Streams one blob into a store: `write` pieces as they arrive (hashed and written,
    never all held in memory), then `commit` (checks the count and the hash, fsyncs,
    renames into place) or `abort`. A writer never committed leaves nothing under the blob's
    id: at worst a `.tmp-*` file, and `abort` removes that. Not thread-safe: one caller."""

    def __init__(self, store: BlobStore, cid: str, size: int) -> None:
        super().__init__(store, cid, size)
        self._hash = hashlib.sha256()

    def write(self, piece: bytes) -> None:
        """Append `piece`; BlobError (and the writer aborted) past the declared size."""
        if self.received + len(piece) > self.size:
            self.abort()
            raise BlobError(f"blob {self.cid}: more than the declared {self.size} bytes")
        if self._fd is None:
            raise BlobError(f"blob {self.cid}: writer already closed")
        self._hash.update(piece)
        self.received += len(piece)
        view = memoryview(piece)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            self.abort()
            raise LocalBlobError(f"cannot store blob {self.cid}: {e}") from e

    def _digest(self) -> str:
        return self._hash.hexdigest()  # hashed as it arrived: no second read


class RangeWriter(_PartWriter):
    """Streams one blob into a store as disjoint byte ranges, in any order and from any
    number of threads (`write_at` is a positional write: no shared file offset). `commit`
    checks that exactly `size` bytes arrived, hashes the file in order (its pages are
    still cached), fsyncs and renames it into place; on any failure the writer is aborted
    and nothing is stored under the id. Nothing is held in memory beyond one piece."""

    def __init__(self, store: BlobStore, cid: str, size: int) -> None:
        super().__init__(store, cid, size)
        self._lock = threading.Lock()

    def write_at(self, offset: int, piece: bytes) -> None:
        """Write `piece` at `offset`; BlobError past the declared size or on I/O errors.
        The caller's ranges must not overlap (each byte is counted once)."""
        if offset < 0 or offset + len(piece) > self.size:
            raise BlobError(
                f"blob {self.cid}: bytes {offset}-{offset + len(piece)} outside 0-{self.size}"
            )
        fd = self._fd
        if fd is None:
            raise BlobError(f"blob {self.cid}: writer already closed")
        view = memoryview(piece)
        try:
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as e:
            raise LocalBlobError(f"cannot store blob {self.cid}: {e}") from e
        with self._lock:
            self.received += len(piece)


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
