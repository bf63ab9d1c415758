"""Blobs in an S3-compatible object store (AWS S3, Cloudflare R2, MinIO, GCS's S3
interface): `--blobs s3://bucket/prefix` on any coordinator mode.

`S3BlobStore` is a `BlobStore` whose local directory is a cache: every blob that lands in
it (a put, a streamed upload, an adopted state) is copied to `s3://bucket/prefix/ab/<cid>`
before the write returns, so a coordinator started on an empty data dir finds every blob
of the run in the bucket. `has` and `size` ask the bucket (one HEAD, remembered); `path`
(the readers': states, checkpoints) downloads a blob the cache lacks and checks its hash.
`presigned_url` is what the coordinator answers a peer's GET with (a 307 redirect:
covey.coordinator.app), so model-sized bytes go from the object store to the peers without
passing through the coordinator process; uploads still come through it, size-capped and
signature-checked, and are checked against their content id before they are stored.

Endpoint, region and credentials are boto3's, found the standard way: AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, or AWS_PROFILE and its
~/.aws files. boto3 is imported here only (`pip install 'covey[scale]'`).
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

from covey.blobs.store import _TMP_PREFIX, BlobError, BlobStore, LocalBlobError, is_cid
from covey.protocol.content import file_content_id

PRESIGNED_TTL_S = 3600  # a redirect's URL stays valid this long: a slow peer's whole fetch
_URL = re.compile(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$")


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix ending in / or empty) of `s3://bucket/prefix`; ValueError
    otherwise."""
    m = _URL.match(url)
    if m is None:
        raise ValueError(f"--blobs {url!r} is not s3://bucket/prefix (a valid bucket name)")
    prefix = (m.group(2) or "").strip("/")
    return m.group(1), f"{prefix}/" if prefix else ""


class S3BlobStore(BlobStore):
    """A `BlobStore` over a bucket, with `root` as its local cache (see the module)."""

    def __init__(self, url: str, root: Path, max_blob_bytes: int | None = None) -> None:
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        try:
            import boto3
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError as e:  # pragma: no cover - the extra is missing
            raise ValueError("--blobs s3://... needs boto3: pip install 'covey[scale]'") from e
        super().__init__(root, max_blob_bytes)
        self._errors = (BotoCoreError, ClientError)
        from botocore.config import Config

        # SigV4 presigned URLs: what every region and S3-compatible store accepts
        self._s3: Any = boto3.client("s3", config=Config(signature_version="s3v4"))
        # cid -> (size, when stored) in the bucket; blobs are immutable, so kept
        self._heads: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()
        try:
            self._s3.head_bucket(Bucket=self.bucket)
        except self._errors as e:
            raise ValueError(
                f"--blobs {url}: cannot reach bucket {self.bucket!r} ({e}); set "
                "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and "
                "AWS_DEFAULT_REGION (or AWS_PROFILE), and create the bucket"
            ) from None

    def key(self, cid: str) -> str:
        return f"{self.prefix}{cid[:2]}/{cid}"

    def _head(self, cid: str) -> tuple[int, float] | None:
        """(size, when stored) of the blob in the bucket, None where it is not there."""
        if cid in self._heads:
            return self._heads[cid]
        try:
            head = self._s3.head_object(Bucket=self.bucket, Key=self.key(cid))
        except self._errors as e:
            if _status(e) == 404:
                return None
            raise LocalBlobError(f"cannot ask {self.url} for blob {cid}: {e}") from e
        found = self._heads[cid] = (int(head["ContentLength"]), head["LastModified"].timestamp())
        return found

    def remote_size(self, cid: str) -> int | None:
        """The blob's size in the bucket, None where it is not there."""
        head = self._head(cid)
        return None if head is None else head[0]

    def modified(self, cid: str) -> float:
        """When the bucket got the blob (no download); BlobError if it is not there."""
        head = self._head(cid) if is_cid(cid) else None
        if head is None:
            raise BlobError(f"blob {cid} is not stored")
        return head[1]

    def has(self, cid: str) -> bool:
        if not is_cid(cid):
            return False
        return super().path(cid).is_file() or self.remote_size(cid) is not None

    def size(self, cid: str) -> int:
        local = super().path(cid)
        if local.is_file():
            return local.stat().st_size
        if is_cid(cid) and (size := self.remote_size(cid)) is not None:
            return size
        raise BlobError(f"blob {cid} is not stored")

    def path(self, cid: str) -> Path:
        """The blob's file in the cache, downloaded first if only the bucket has it (its
        hash checked: BlobError, nothing cached, if the bucket's copy is not `cid`)."""
        local = super().path(cid)
        if local.is_file() or self.remote_size(cid) is None:
            return local
        local.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=_TMP_PREFIX, suffix=".part")
        os.close(fd)
        try:
            self._s3.download_file(self.bucket, self.key(cid), tmp)
            if (actual := file_content_id(Path(tmp))) != cid:
                raise BlobError(f"{self.url}'s copy of blob {cid} hashes to {actual}")
            os.replace(tmp, local)
        except self._errors as e:
            raise LocalBlobError(f"cannot download blob {cid} from {self.url}: {e}") from e
        finally:
            Path(tmp).unlink(missing_ok=True)
        return local

    def presigned_url(self, cid: str, ttl_s: int = PRESIGNED_TTL_S) -> str:
        """A URL anyone may GET the blob from for `ttl_s` seconds (Range allowed)."""
        return str(
            self._s3.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self.key(cid)}, ExpiresIn=ttl_s
            )
        )

    def delete(self, cid: str) -> None:
        super().path(cid).unlink(missing_ok=True)  # the cached copy, never fetched for this
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self.key(cid))
        except self._errors as e:
            raise LocalBlobError(f"cannot delete blob {cid} from {self.url}: {e}") from e
        self._heads.pop(cid, None)

    def cids(self) -> list[str]:
        found = set(super().cids())
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix
        )
        for page in pages:
            for obj in page.get("Contents", []):
                name = obj["Key"][len(self.prefix) :]
                if is_cid(cid := name[3:]) and name[:3] == f"{cid[:2]}/":
                    found.add(cid)
        return sorted(found)

    def _landed(self, cid: str, path: Path) -> None:
        """Copy a blob that reached the cache to the bucket, once."""
        with self._lock:
            if self.remote_size(cid) is not None:
                return
            try:
                self._s3.upload_file(str(path), self.bucket, self.key(cid))
            except self._errors as e:
                raise LocalBlobError(f"cannot store blob {cid} in {self.url}: {e}") from e
            self._heads.pop(cid, None)  # asked again when needed: the bucket's own time


def _status(e: Exception) -> int | None:
    response = getattr(e, "response", None) or {}
    code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(code) if code is not None else None


def open_store(url: str | None, root: Path, max_blob_bytes: int | None = None) -> BlobStore:
    """The blob store a coordinator's `--blobs` names: None, the directory `root`; an
    `s3://bucket/prefix`, that bucket with `root` as its cache. ValueError otherwise."""
    if url is None:
        return BlobStore(root, max_blob_bytes)
    if url.startswith("s3://"):
        return S3BlobStore(url, root, max_blob_bytes)
    raise ValueError(f"--blobs {url!r}: give s3://bucket/prefix, or leave it out for local disk")
