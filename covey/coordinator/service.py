"""The coordinator: a facade over its components. Transport-free: the FastAPI app
(covey.coordinator.app) turns HTTP into calls here and `Rejected` into 4xx replies.

The host (covey.coordinator.host: identity, database, accounts and ledger, blob store,
Membership with the peers table, the owner's Halt) is built first; the rounds mode's
components then take what they need in `__init__`: Blobs (the fetcher of peers' own blobs
and the upload gate: covey.coordinator.uploads), Verification (assignments, canaries,
disputes and the referee) and Rounds (covey.coordinator.rounds: open, close, commit,
intake, certificates, evaluation, the read side). This class builds them in order and
forwards the calls the app, the CLI and the tests make; it holds no logic of its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from covey.algorithms import TrainState
from covey.blobs import BlobClient
from covey.config import RunConfig, run_id_of
from covey.data.corpus import Corpus, load_corpus
from covey.protocol import schemas
from covey.protocol.rounds import PeerView
from covey.trust.halt import owner_of
from covey.trust.identity import Identity

from .db import Database
from .host import Host, RunTerms
from .liveness import Liveness
from .model import build_model
from .rounds import Rounds
from .storage import Storage
from .uploads import Blobs, blob_sizes
from .verification import Verification
from .views import CommitSignal, OpenRound

log = logging.getLogger("covey.coordinator")


def load_run_corpus(cfg: RunConfig) -> Corpus:
    """The run's data, as its [data] table names it."""
    d = cfg.data
    return load_corpus(list(d.paths), d.val_fraction, d.tokenizer, d.text_column)


class Coordinator:
    def __init__(
        self,
        cfg: RunConfig,
        data_dir: Path,
        *,
        threads: int | None = None,
        device: str | None = None,
        storage: Storage = Storage(),  # noqa: B008 -- frozen
        corpus: Corpus | None = None,
    ) -> None:
        """Open (or create) the run in `data_dir` (and `storage`, covey.coordinator.storage).
        ValueError if the spec names another coordinator key, or `data_dir` holds another
        run; DeviceError (a ValueError) for a bad `device`, where the referee recomputes
        (default: the run's verify_device). `corpus`: the run's data, loaded already (a
        standby replica loads it before it waits: `load_run_corpus`)."""
        self.data_dir = data_dir
        if threads:
            torch.set_num_threads(threads)

        def terms(identity: Identity, db: Database) -> RunTerms:
            # the coordinator's own key signs certificates and ledger entries; it is part of
            # the spec, so of the run id (ValueError if the spec names another key)
            self.cfg = c = cfg.with_coordinator_key(identity.public_key)
            self.corpus = corpus or load_run_corpus(c)
            # the run id covers the data: one spec on other data is another run
            return RunTerms(
                run_id=run_id_of(c, self.corpus.fingerprint),
                owner_key=owner_of(c.model_dump(), identity.public_key),
                membership=c.membership(),
                max_blob_bytes=c.limits.max_blob_bytes,
            )

        # the host's parts; the round driver writes the owner's HALT and aborts the open round
        self.host = host = Host(
            data_dir,
            terms,
            position=lambda: self.rounds.state.round,
            effect=lambda: self.rounds.abort_if_open(),
            written=lambda: self.rounds.commits.notify(),  # round long-polls learn at once
            storage=storage,
        )
        cfg = self.cfg
        (data_dir / "checkpoints").mkdir(exist_ok=True)
        self.identity, self.db, self.run_id = host.identity, host.db, host.run_id
        self.accounts, self.blobs, self.halt = host.accounts, host.blobs, host.halt
        self.membership = host.membership
        self._stop, wake = host.stop, host.wake  # wake: a contribution or a leave
        self.fetcher = BlobClient(
            timeout_s=cfg.limits.request_timeout_s,
            retries=cfg.limits.retries,
            max_bytes=cfg.limits.max_blob_bytes,
        )
        model = build_model(cfg, self.corpus, self.blobs)
        verifying = model.strategy.reexecutable
        self.verification = Verification(
            self.db,
            cfg,
            self.accounts,
            self.membership,
            self.blobs,
            run_id=self.run_id,
            strategy=model.strategy,
            template=model.template,
            corpus=self.corpus,
            seq_len=model.seq_len,
            verifying=verifying,
        )
        self.verification.set_referee_device(device)
        self.uploads = Blobs(  # sizes worked out once, before serving: from the model
            self.db,
            cfg,
            self.blobs,
            self.fetcher,
            blob_sizes(model.strategy, model.template),
            self.membership.check_not_banned,
            run_id=self.run_id,
        )
        self.rounds = Rounds(
            cfg,
            data_dir,
            identity=self.identity,
            db=self.db,
            accounts=self.accounts,
            membership=self.membership,
            verification=self.verification,
            blobs=self.blobs,
            fetcher=self.fetcher,
            uploads=self.uploads,
            corpus=self.corpus,
            run_id=self.run_id,
            model=model,
            wake=wake,
            stop=self._stop,
            halt=self.halt,
        )
        if not verifying:
            log.warning(
                "contributions of this run cannot be re-executed (%s keeps worker-local state "
                "across rounds): validators will not be given work; robust aggregation and "
                "the intake checks still apply",
                cfg.algorithm.method,
            )

    def start(self) -> None:
        self.rounds.start()
        self.verification.start_referee()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self.verification.stop_referee()
        self.rounds.stop(timeout_s)
        self.fetcher.close()
        self.host.close()  # heartbeats in memory reach SQLite, then the database closes

    # -- membership (covey.coordinator.membership): the facade's calls, delegated ------------

    def join(self, req: schemas.JoinRequest, raw: dict[str, Any]) -> schemas.JoinReply:
        return self.membership.join(req, raw)

    def heartbeat(self, req: schemas.HeartbeatRequest, raw: dict[str, Any]) -> dict[str, Any]:
        return self.membership.heartbeat(req, raw)

    def leave(self, req: schemas.LeaveRequest, raw: dict[str, Any]) -> dict[str, Any]:
        return self.membership.leave(req, raw)

    @property
    def liveness(self) -> Liveness:
        return self.membership.liveness

    def _peer_views(self) -> list[PeerView]:
        return self.membership.peer_views()

    # -- verification (covey.coordinator.verification): the facade's calls, delegated --------

    def validator_join(self, req: schemas.ValidatorJoin, raw: dict[str, Any]) -> dict[str, Any]:
        """Rejected(410) once the run is halted: nobody joins it again."""
        self.halt.check_not_halted()
        return self.verification.validator_join(req, raw)

    def claim(self, req: schemas.ClaimRequest, raw: dict[str, Any]) -> dict[str, Any]:
        """Rejected(410) with the owner's reason once the run is halted: validators learn
        of a HALT here and stop (reports of checks already claimed are still taken)."""
        self.halt.check_not_halted()
        return self.verification.claim(req, raw)

    def report(self, req: schemas.VerifyReport, raw: dict[str, Any]) -> dict[str, Any]:
        return self.verification.report(req, raw)

    # -- the rounds mode (covey.coordinator.rounds): the facade's calls, delegated ----------

    @property
    def state(self) -> TrainState:
        return self.rounds.state

    @property
    def state_cid(self) -> str:
        return self.rounds.state_cid

    @property
    def state_hash(self) -> str:
        return self.rounds.state_hash

    @property
    def verifying(self) -> bool:
        return self.verification.verifying

    @property
    def commits(self) -> CommitSignal:
        return self.rounds.commits

    @property
    def halted(self) -> dict[str, Any] | None:
        return self.halt.halted

    @property
    def samples(self) -> dict[str, Any] | None:
        return self.rounds.samples

    def tick(self, now: float) -> None:
        self.rounds.tick(now)

    def committed_rounds(self) -> int:
        return self.rounds.committed_rounds()

    def open_round(self) -> OpenRound | None:
        return self.rounds.open_round()

    def finished(self) -> bool:
        return self.rounds.finished()

    def submit(
        self, round_: int, req: schemas.ContributionRequest, raw: dict[str, Any]
    ) -> dict[str, Any]:
        return self.rounds.submit(round_, req, raw)

    def round_info(self, peer_id: str | None) -> schemas.RoundInfo:
        return self.rounds.round_info(peer_id)

    def round_news(self, after: str, peer_id: str | None) -> bool:
        return self.rounds.round_news(after, peer_id)

    def certificate(self, round_: int) -> schemas.Certificate:
        return self.rounds.certificate(round_)

    def checkpoints(self) -> list[schemas.CheckpointEntry]:
        return self.rounds.checkpoints()

    def run_spec(self) -> dict[str, Any]:
        return self.rounds.run_spec()

    def status(self) -> dict[str, Any]:
        return self.rounds.status()

    def costs(self) -> dict[str, Any]:
        return self.rounds.costs()
