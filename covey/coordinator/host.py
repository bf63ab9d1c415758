"""The host: the parts every mode of the coordinator shares, built once and in order.

1. the coordinator's identity (its key file in the data dir, made on first use);
2. the database (covey.coordinator.db: created, migrated or refused by schema version):
   the data dir's SQLite file, or a PostgreSQL server (`Storage.db`);
3. the run's terms, asked of the mode now that its key and database are known (`terms`:
   the run id, the owner's key, membership's config, the largest blob), and the run-id
   check: a data dir holding another run is refused (ValueError naming both ids);
4. the accounts (the signed ledger and the book replayed from it);
5. the blob store (the data dir's blobs/, or an S3-compatible bucket: `Storage.blobs`);
6. membership (peers, the peers table, liveness, signatures and nonces, no-shows);
7. the owner's HALT, with the mode's `position`, `effect` and `written`.

Each mode (rounds: covey.coordinator.service; rl: covey.rl.trainer; swarm:
covey.swarm.service) builds one and takes its parts; no part reaches into a mode, and the
host knows nothing of rounds, rollouts or stages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from covey.blobs import BlobStore, open_store
from covey.config import MembershipConfig
from covey.trust.identity import Identity

from .accounts import Accounts
from .db import Database
from .halt import Halt
from .membership import Membership
from .storage import Storage


@dataclass(frozen=True)
class RunTerms:
    """What the host needs to know of the run, from the mode's spec."""

    run_id: str
    owner_key: str  # who may HALT the run (covey.trust.halt.owner_of)
    membership: MembershipConfig
    max_blob_bytes: int | None = None  # None: the blob store's own limit


def _nothing() -> None:
    return None


class Host:
    """The shared parts of one run's coordinator, whatever its mode."""

    __slots__ = (
        "accounts", "blobs", "data_dir", "db", "halt", "identity", "membership", "run_id",
        "stop", "terms", "wake",
    )  # fmt: skip
    data_dir: Path
    identity: Identity
    db: Database
    terms: RunTerms
    run_id: str
    accounts: Accounts
    blobs: BlobStore
    wake: threading.Event  # set to have the mode's driver look now (a leave, a HALT)
    stop: threading.Event  # ends the mode's threads and membership's liveness flusher
    membership: Membership
    halt: Halt

    def __init__(
        self,
        data_dir: Path,
        terms: Callable[[Identity, Database], RunTerms],
        *,
        position: Callable[[], int],
        effect: Callable[[], None] = _nothing,
        written: Callable[[], None] = _nothing,
        key_file: str = "coordinator.key",
        db_file: str = "coordinator.db",
        storage: Storage = Storage(),  # noqa: B008 -- frozen, so one shared default is safe
    ) -> None:
        """Open (or create) the host of the run in `data_dir`. `terms(identity, db)` is
        the mode's: the run it serves, read from its spec (and, for a run the data dir
        holds already, from `db`); it may raise ValueError. `position`, `effect` and
        `written` are the mode's part of the HALT (covey.coordinator.halt.Halt). Raises
        ValueError when `data_dir` holds another run, SchemaError (a ValueError) for a
        database no migration reads; the database is closed again on any failure."""
        self.data_dir = data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self.identity = Identity.load_or_create(storage.key or data_dir / key_file)
        self.db = Database(storage.db or data_dir / db_file)
        self.db.fence = storage.fence
        try:
            self.terms = run = terms(self.identity, self.db)
            known = self.db.get_meta("run_id")
            if known is not None and known != run.run_id:
                where = f"--db {self.db.path}" if storage.db else str(data_dir)
                raise ValueError(
                    f"{where} holds run {known}, not this spec's run {run.run_id} (the run "
                    f"id covers the coordinator's key: give the run's --key); use another "
                    f"{'--db' if storage.db else '--data-dir'}"
                )
        except BaseException:
            self.db.close()
            raise
        self.run_id = run.run_id
        self.accounts = Accounts(self.db, self.identity, data_dir)
        self.blobs = open_store(storage.blobs, data_dir / "blobs", run.max_blob_bytes)
        self.wake, self.stop = threading.Event(), threading.Event()
        self.membership = Membership(
            self.db,
            run.membership,
            self.accounts,
            self.run_id,
            wake=self.wake,
            stop=self.stop,
            check_not_halted=lambda: self.halt.check_not_halted(),  # built next
        )
        self.halt = Halt(
            self.accounts,
            run_id=self.run_id,
            owner_key=run.owner_key,
            check_run=self.membership.check_run,
            authenticate=self.membership.authenticate,
            wake=self.wake,
            position=position,
            effect=effect,
            written=written,
        )

    def close(self) -> None:
        """Heartbeats still in memory reach SQLite, then the database closes. The mode
        sets `stop` and joins its threads first."""
        self.stop.set()
        self.membership.liveness.flush()
        self.db.close()
