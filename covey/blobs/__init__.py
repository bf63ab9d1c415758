"""The blob plane: immutable content-addressed bytes, stored, served and fetched by sha256.

Three layers, each usable alone and each in its own module; this module re-exports them:
- `BlobStore` (covey.blobs.store): a directory of blobs named by content id, written
  atomically; also `parse_range` for single HTTP byte ranges.
- `BlobServer` (covey.blobs.server): a peer's own read-only HTTP server over a store
  (GET/HEAD, single Range).
- `S3BlobStore` (covey.blobs.s3): the same store over an S3-compatible bucket, its
  directory a cache; `open_store` picks one from a coordinator's --blobs.
- `BlobClient` (covey.blobs.client): fetches a blob from an ordered list of providers,
  with bounded retries, provider fallback, and parallel ranged chunks for large blobs;
  `fetch_into` (covey.blobs.streaming) streams one to disk instead, hashed on arrival, so
  a blob of any size never sits whole in memory.

Trust model (as in hivemind, every record from the network passes a validator): a provider
can be slow, absent or lying, and the client only hands back bytes whose sha256 equals the
requested id. Wire format: `GET|HEAD {base}/v1/blobs/{cid}`, `PUT` on the coordinator only.
"""

from __future__ import annotations

from covey.blobs.client import BlobClient
from covey.blobs.s3 import S3BlobStore, open_store
from covey.blobs.server import BlobServer
from covey.blobs.store import (
    BLOB_PATH_PREFIX,
    BlobError,
    BlobStore,
    LocalBlobError,
    RangeNotSatisfiable,
    parse_range,
)

__all__ = [
    "BLOB_PATH_PREFIX",
    "BlobClient",
    "BlobError",
    "BlobServer",
    "BlobStore",
    "LocalBlobError",
    "RangeNotSatisfiable",
    "S3BlobStore",
    "open_store",
    "parse_range",
]
