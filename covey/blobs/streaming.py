"""Fetching blobs to disk: `BlobClient.fetch_into` and its parts, as a mixin of
BlobClient (covey.blobs.client), which supplies the transport (`_get`, `_with_retries`,
`_candidates`, `_error`). A whole body streams through a hashing BlobWriter; a big blob
comes as parallel ranges written where they belong (RangeWriter) and is hashed once
complete. Nothing is stored under a content id unless the bytes hash to it, and nothing is
held in memory beyond a network piece per range in flight.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from covey.blobs.store import BlobError, BlobStore, BlobWriter, LocalBlobError, cid_or_error

logger = logging.getLogger("covey.blobs.client")

T = TypeVar("T")

_WRITE_BYTES = 1 << 20  # a ranged fetch writes to disk in pieces of about this size


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


class StreamingFetch:
    """`fetch_into` for BlobClient (see the module docstring)."""

    max_bytes: int | None
    chunk_bytes: int
    parallel: int
    _lock: threading.Lock
    _candidates: Callable[[Sequence[str], dict[str, str]], list[str]]
    _error: Callable[[str, str, dict[str, str]], BlobError]
    _with_retries: Callable[..., Any]
    _get: Callable[..., int]

    def fetch_into(
        self,
        store: BlobStore,
        cid: str,
        providers: Sequence[str],
        size: int | None = None,
        *,
        max_bytes: int | None = None,
    ) -> Path:
        """Fetch blob `cid` into `store` and return its path there; the bytes stream to disk
        and are never held whole in memory. Providers, retries, fallback and parallel
        ranges as in `fetch`: a whole body is hashed as it arrives; ranges are written
        where they belong as they arrive, from several providers at once, and the file is
        hashed once complete. Nothing is stored under `cid` unless the bytes hash to it.
        A blob already stored is not fetched again.

        `max_bytes` (default: the client's) bounds the blob: the caller passes what the
        run's model implies for it (a state of any size), and a provider that sends more
        fails. BlobError naming each provider's last failure if none delivers."""
        cid_or_error(cid)
        if store.has(cid):
            return store.path(cid)
        cap = self.max_bytes if max_bytes is None else max_bytes
        if size is not None and cap is not None and size > cap:
            raise BlobError(f"cannot fetch {cid}: {size} bytes exceeds max_bytes={cap}")
        failures: dict[str, str] = {}
        candidates = self._candidates(providers, failures)
        if not candidates:
            raise self._error("fetch", cid, failures or {"-": "no providers"})
        if size is not None and size > self.chunk_bytes:
            dead = self._fetch_ranges_into(store, cid, candidates, size, failures)
            if store.has(cid):
                return store.path(cid)
            candidates = [p for p in candidates if p not in dead]
            logger.warning(
                "blob %s: ranged fetch failed, trying whole body from %s", cid, candidates
            )
        limit = size if size is not None else cap
        for p in candidates:
            try:
                self._with_retries(lambda p=p: self._get_into(store, p, cid, size, limit))
                return store.path(cid)
            except _Failure as f:
                failures[p] = str(f)
        raise self._error("fetch", cid, failures)

    def _get_into(
        self, store: BlobStore, base: str, cid: str, size: int | None, limit: int | None
    ) -> None:
        """One whole-body attempt streamed into the store, hashed as it arrives. Without
        a known size the body's Content-Length (bounded by `limit`) sizes the writer."""
        box: list[BlobWriter] = []

        def sink(piece: bytes) -> None:
            box[0].write(piece)

        def on_length(declared: int) -> None:
            if size is not None and declared not in (-1, size):
                raise _Failure(f"body of {declared} bytes, expected {size}", retry=False)
            n = size if size is not None else declared
            if n < 0:
                raise _Failure("no Content-Length: cannot stream to disk", retry=False)
            box.append(store.writer(cid, n, capped=False))

        try:
            self._get(base, cid, None, limit, sink, on_length)
            if not box:
                raise _Failure("no body", retry=False)
            box[0].commit()
        except LocalBlobError:
            raise
        except BlobError as e:
            raise _Failure(str(e), retry=False) from None
        finally:
            if box:
                box[0].abort()  # a no-op once committed

    def _fetch_ranges_into(
        self,
        store: BlobStore,
        cid: str,
        providers: list[str],
        size: int,
        failures: dict[str, str],
    ) -> set[str]:
        """Ranges of `chunk_bytes` streamed into a RangeWriter, chunk i from provider
        i % len(providers) first, `parallel` at a time; the blob is stored if every range
        arrived and the file hashes to `cid`. Returns the providers to skip from now on.
        A retried range rewrites its own bytes: the writer counts each range once."""
        writer = store.range_writer(cid, size, capped=False)

        def attempt(p: str, start: int, end: int) -> None:
            offset = start
            buf = bytearray()  # at most one network piece: flushed as it arrives

            def sink(piece: bytes) -> None:
                nonlocal offset
                buf.extend(piece)
                if len(buf) >= _WRITE_BYTES:
                    writer.write_at(offset, bytes(buf))
                    offset += len(buf)
                    buf.clear()

            self._get(p, cid, (start, end), None, sink)
            writer.write_at(offset, bytes(buf))

        dead: set[str] = set()
        try:
            done, dead = self._over_ranges(providers, size, failures, attempt)
            if done is not None:
                # a failed attempt may have written part of a range that a retry rewrote:
                # count by ranges, not by writes
                writer.received = size
                writer.commit()
        except LocalBlobError:
            raise
        except BlobError as e:
            failures["chunks"] = str(e)  # e.g. the assembled ranges do not hash to the cid
        finally:
            writer.abort()  # a no-op once committed
        return dead

    def _over_ranges(
        self,
        providers: list[str],
        size: int,
        failures: dict[str, str],
        attempt: Callable[[str, int, int], T],
    ) -> tuple[list[T] | None, set[str]]:
        """`attempt(provider, start, end)` for every `chunk_bytes` range of a `size`-byte
        blob (end inclusive), range i from provider i % len(providers) first and then the
        others, with retries, `parallel` at a time. Returns (the results in range order, or
        None once some range had no provider left; the providers to skip from now on);
        each provider's last failure goes into `failures`."""
        ranges = [
            (s, min(s + self.chunk_bytes, size) - 1) for s in range(0, size, self.chunk_bytes)
        ]
        results: dict[int, T] = {}
        dead: set[str] = set()
        abort = threading.Event()  # one range had no provider left: stop the others

        def one(i: int) -> bool:
            start, end = ranges[i]
            k = i % len(providers)
            for p in providers[k:] + providers[:k]:
                with self._lock:
                    if p in dead:
                        continue
                try:
                    value = self._with_retries(lambda p=p: attempt(p, start, end), abort)
                except _Aborted:
                    return False
                except _Failure as f:
                    with self._lock:
                        failures[p] = str(f)
                        if f.skip:
                            dead.add(p)
                    continue
                with self._lock:
                    results[i] = value
                return True
            abort.set()
            return False

        with ThreadPoolExecutor(max_workers=min(self.parallel, len(ranges))) as pool:
            complete = all(list(pool.map(one, range(len(ranges)))))
        return ([results.pop(i) for i in range(len(ranges))] if complete else None), dead
