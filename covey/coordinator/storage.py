"""Where a coordinator keeps its run beside its data dir: the database, the blobs and its
key (docs/operations.md). Light on purpose: every mode's command line imports it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DB_HELP = (
    "the run's database: postgresql://user:password@host/dbname (needs covey[scale]); "
    "default: SQLite in --data-dir"
)
BLOBS_HELP = (
    "where blobs live: s3://bucket/prefix (endpoint and credentials: AWS_ENDPOINT_URL, "
    "AWS_ACCESS_KEY_ID, ... or AWS_PROFILE; needs covey[scale]); default: --data-dir"
)
REPLICA_HELP = (
    "one of several coordinators of this run on one --db and --blobs (and --key): serve at "
    "once (reads from the database, writes relayed to the lease holder), drive the run once "
    "holding its lease; exit when the lease is lost"
)
KEY_HELP = (
    "the coordinator's Ed25519 key file (made on first use); default: in --data-dir. The "
    "run id covers it: keep it to restart on another --data-dir"
)


@dataclass(frozen=True)
class Storage:
    """The defaults keep everything in the data dir; with a database and a bucket
    elsewhere and the key given, the data dir holds only caches, and a coordinator started
    on an empty one continues the run."""

    db: str | None = None  # None: the data dir's SQLite file; or postgresql://user@host/db
    blobs: str | None = None  # None: the data dir's blobs/; or s3://bucket/prefix
    key: Path | None = None  # None: the data dir's key file; the run id covers this key
    # a replica's lease check, run inside each writing transaction (covey.coordinator.lease)
    fence: Callable[[Any], None] | None = None
