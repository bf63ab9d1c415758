"""The rounds mode on a follower replica (covey.coordinator.replica): the read side of
covey.coordinator.views over the shared database and bucket, and the replica's two apps.

A follower has no round driver, so what the leader keeps in memory it reads: the
canonical state's round, content id and hash from the last committed round's row (the
initial state's hash from its blob, once), the ledger's book by replaying the entries
appended since its last look, both every REFRESH_S. What only the leader has, it does not
pretend to: the held-out samples of the status page (the leader's evaluator) are absent
(None), and a peer's last heartbeat is the one the leader last flushed to the database.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query
from fastapi import Path as PathParam
from starlette.types import ASGIApp

from covey.config import RunConfig, run_id_of
from covey.data.corpus import Corpus
from covey.protocol import schemas
from covey.protocol.checkpoint import state_from_file
from covey.trust import ledger
from covey.trust.halt import owner_of
from covey.trust.identity import Identity

from .accounts import Accounts
from .db import Database
from .host import Host, RunTerms
from .host_app import handle_errors, host_middleware, host_routes
from .liveness import Liveness
from .metrics import HostCollector, Metrics, RunCollector
from .model import build_model
from .peer_routes import blob_routes, run_route
from .rejected import Rejected
from .replica import ForwardRest, Leader, Refresher, refuse_writes
from .storage import Storage
from .views import Views

log = logging.getLogger("covey.coordinator")


@dataclass
class Position:
    """What a follower's views read of the canonical state: its round (`state.round`)."""

    round: int


def refresh_book(accounts: Accounts) -> None:
    """Apply the ledger entries appended since the book's last one (by the leader)."""
    db = accounts.db
    with db.lock:
        new = ledger.read_entries(db._conn, start=accounts.book.entries)
    for entry in new:
        accounts.book.apply(entry)


class RoundsReadSide(Views):
    """covey.coordinator.views over what the database and the bucket hold (`refresh`)."""

    def __init__(self, cfg: RunConfig, host: Host, corpus: Corpus) -> None:
        model = build_model(cfg, corpus, host.blobs)
        self.cfg, self.run_id, self.db = cfg, host.run_id, host.db
        self.peers, self.blobs = host.membership.peers, host.blobs
        self.identity, self.accounts, self._halt = host.identity, host.accounts, host.halt
        self._membership = host.membership
        self.template = model.template
        self.parameters = model.parameters
        self.model_name, self.model_source = model.name, model.source
        self.model_files_cid = model.model_files_cid
        self.corpus_fingerprint = corpus.fingerprint
        self.verifying = model.strategy.reexecutable
        self.state: Any = Position(0)
        self.state_cid, self.state_hash = "", ""
        self._initial: tuple[str, str] | None = None
        self._lock = threading.Lock()

    @property
    def halted(self) -> dict[str, Any] | None:
        return self._halt.halted

    @property
    def samples(self) -> dict[str, Any] | None:
        return None  # drawn by the leader's evaluator, kept in its memory

    @property
    def liveness(self) -> Liveness:
        return self._membership.liveness

    def ready(self) -> None:
        """Rejected(503) until the run exists in the database (its first leader made it)."""
        if not self.state_cid:
            raise Rejected(503, "the run is not created yet: retry once its leader made it")

    def refresh(self) -> None:
        """The canonical state's round, content id and hash, as last committed."""
        row = self.db.read_one(
            "SELECT round, new_cid, new_hash FROM rounds WHERE status = 'committed' "
            "ORDER BY round DESC LIMIT 1"
        )
        if row is not None:
            position, cid, digest = row["round"] + 1, str(row["new_cid"]), str(row["new_hash"])
        else:
            initial = self.db.read_one("SELECT value FROM meta WHERE key = 'initial_cid'")
            if initial is None:
                return
            cid = str(initial["value"])
            if self._initial is None or self._initial[0] != cid:
                self._initial = (cid, state_from_file(self.blobs.path(cid), self.template).digest())
            position, digest = 0, self._initial[1]
        with self._lock:
            self.state, self.state_cid, self.state_hash = Position(position), cid, digest


def read_routes(app: FastAPI, side: RoundsReadSide) -> None:
    """The rounds mode's reads a follower answers itself (the leader's are in
    covey.coordinator.app; long-polls go to the leader)."""
    run_route(app, lambda: (side.ready(), side.run_spec())[1])

    @app.get("/v1/status")
    def status() -> dict[str, Any]:
        side.ready()
        return side.status()

    @app.get("/v1/rounds/{round}/certificate")
    def certificate(round: int = PathParam(ge=0, le=schemas.MAX_INT)) -> schemas.Certificate:
        return side.certificate(round)

    @app.get("/v1/checkpoints")
    def checkpoints() -> list[schemas.CheckpointEntry]:
        return side.checkpoints()

    @app.get("/v1/ledger/receipt")
    def receipt(
        round: int = Query(ge=0, le=schemas.MAX_INT),
        peer_id: str = Query(pattern=schemas.PEER_ID_PATTERN),
    ) -> dict[str, Any]:
        entry = side.accounts.find("contribution accepted", round=round, peer_id=peer_id)
        if entry is None:
            raise Rejected(404, f"no accepted contribution of {peer_id[:12]} in round {round}")
        return entry


class RoundsFollower:
    """A follower of a rounds run: its host (its database refuses every write), its read
    side kept fresh by a thread, and its app (`app`); `close()` once its replica leads."""

    def __init__(
        self,
        cfg: RunConfig,
        data_dir: Path,
        storage: Storage,
        corpus: Corpus,
        own_url: str,
    ) -> None:
        def terms(identity: Identity, db: Database) -> RunTerms:
            self.cfg = c = cfg.with_coordinator_key(identity.public_key)
            return RunTerms(
                run_id=run_id_of(c, corpus.fingerprint),
                owner_key=owner_of(c.model_dump(), identity.public_key),
                membership=c.membership(),
                max_blob_bytes=c.limits.max_blob_bytes,
            )

        follower = Storage(db=storage.db, blobs=storage.blobs, key=storage.key, fence=refuse_writes)
        self.host = host = Host(data_dir, terms, position=lambda: self.side.state.round,
                                storage=follower)  # fmt: skip
        self.side = RoundsReadSide(self.cfg, host, corpus)
        self.refresher = Refresher(
            [lambda: refresh_book(host.accounts), self.side.refresh], host.stop
        )
        self.app = self._app(own_url)

    def _app(self, own_url: str) -> ASGIApp:
        limits = self.cfg.limits
        app = FastAPI(title="covey coordinator (follower replica)", version="1")
        handle_errors(app, log)
        metrics = Metrics(
            HostCollector(self.host.db, self.cfg.rounds.dead_after_s),
            RunCollector(self.side),  # type: ignore[arg-type] -- the read side it reads
        )
        host_routes(app, metrics, self.host.halt, self.host.accounts)
        read_routes(app, self.side)
        blob_routes(app, self.host.blobs)
        # innermost: what no route here answers goes to the leader, past the host's limits
        app.add_middleware(
            ForwardRest, leader=Leader(self.host.db, own_url), timeout_s=limits.request_timeout_s
        )
        host_middleware(app, metrics, limits, json_limit=limits.max_json_bytes)
        return app

    def close(self) -> None:
        self.host.stop.set()
        self.host.db.close()
