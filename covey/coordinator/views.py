"""The coordinator's read side: what peers and the status page see (round info,
certificates, checkpoints, the run spec, the dashboard's status feed). Reads never change
state; covey.coordinator.service holds the write side and mixes this in.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from covey.protocol import schemas
from covey.protocol.rounds import PeerView, is_alive

if TYPE_CHECKING:
    from covey.algorithms import TrainState
    from covey.config import RunConfig
    from covey.peer.blobs import BlobStore
    from covey.trust.identity import Identity

    from .accounts import Accounts
    from .db import Database


class Rejected(Exception):
    """A request that cannot be honoured; `status` is the HTTP status it maps to. Raised
    before any state changes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class OpenRound:
    round: int
    attempt: int
    opened_at: float
    deadline: float
    members: list[str]
    assignments: dict[str, dict[str, Any]]


class Views:
    # provided by Coordinator
    cfg: RunConfig
    run_id: str
    db: Database
    blobs: BlobStore
    state: TrainState
    state_cid: str
    state_hash: str
    parameters: int
    corpus_fingerprint: str
    identity: Identity
    accounts: Accounts
    verifying: bool
    halted: dict[str, Any] | None  # covey.coordinator.halt

    def open_round(self) -> OpenRound | None:
        row = self.db.one("SELECT * FROM rounds WHERE status IN ('open', 'closing')")
        if row is None:
            return None
        return OpenRound(
            row["round"],
            row["attempt"],
            row["opened_at"],
            row["deadline"],
            json.loads(row["members"]),
            json.loads(row["assignments"]),
        )

    def finished(self) -> bool:
        """No round opens again: max_rounds reached, or the owner halted the run."""
        cap = self.cfg.rounds.max_rounds
        return self.halted is not None or (cap is not None and self.state.round >= cap)

    def round_info(self, peer_id: str | None) -> schemas.RoundInfo:
        if (halted := self.halted) is not None:
            return schemas.RoundInfo(
                run_id=self.run_id, phase="halted", round=self.state.round, halted=halted["reason"]
            )
        rnd = self.open_round()
        if rnd is None:
            phase = "finished" if self.finished() else "waiting"
            return schemas.RoundInfo(run_id=self.run_id, phase=phase, round=self.state.round)
        member = peer_id in rnd.members
        return schemas.RoundInfo(
            run_id=self.run_id,
            phase="open",
            round=rnd.round,
            attempt=rnd.attempt,
            start_cid=self.state_cid,
            start_hash=self.state_hash,
            start_size=self.blobs.size(self.state_cid),
            providers=self.state_providers(),
            deadline_in_s=rnd.deadline - time.time(),
            member=member,
            assignment=schemas.AssignmentOut(**rnd.assignments[peer_id]) if member else None,
        )

    def state_providers(self) -> list[str]:
        """Peers that hold the current canonical state: those accepted in the round that
        produced it (they verified its hash) and that accept connections."""
        row = self.db.one(
            "SELECT certificate FROM rounds WHERE status = 'committed' ORDER BY round DESC LIMIT 1"
        )
        if row is None:
            return []
        cert = schemas.Certificate.model_validate_json(row["certificate"])
        live = {
            p["peer_id"] for p in self.db.query("SELECT peer_id FROM peers WHERE state = 'live'")
        }
        return [u for a in cert.accepted if a.peer_id in live for u in a.providers]

    def certificate(self, round_: int) -> schemas.Certificate:
        row = self.db.one("SELECT status, certificate FROM rounds WHERE round = ?", (round_,))
        if row is None or row["status"] != "committed":
            state = "unknown" if row is None else row["status"]
            raise Rejected(404, f"round {round_} has no certificate yet (status: {state})")
        return schemas.Certificate.model_validate_json(row["certificate"])

    def checkpoints(self) -> list[schemas.CheckpointEntry]:
        rows = self.db.query("SELECT * FROM checkpoints ORDER BY round")
        return [
            schemas.CheckpointEntry(
                round=r["round"],
                cid=r["cid"],
                size=r["size"],
                weights_hash=r["weights_hash"],
                providers=[],
            )
            for r in rows
            if self.blobs.has(r["cid"])
        ]

    def run_spec(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "coordinator_key": self.identity.public_key,
            "verifying": self.verifying,
            "spec": self.cfg.model_dump(mode="json"),
            "corpus_fingerprint": self.corpus_fingerprint,
            "parameters": self.parameters,
        }

    def trust_status(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Verification counts, validators and the ledger's length, for the status page."""
        counts = {
            r["status"]: r["n"]
            for r in self.db.query(
                "SELECT status, COUNT(*) AS n FROM verifications GROUP BY status"
            )
        }
        validators = [
            {"peer_id": p["peer_id"], "name": p["name"]}
            for p in self.db.query("SELECT * FROM peers WHERE role = 'validator'")
        ]
        return {
            "verifying": self.verifying,
            "sample_rate": self.cfg.trust.sample_rate,
            "aggregation": self.cfg.trust.aggregation,
            "verifications": counts,
            "validators": validators,
            "ledger_entries": summary.get("entries"),
            "accounts": summary["accounts"],
        }

    def status(self) -> dict[str, Any]:
        """The dashboard's feed (covey/dashboard/static): peers, rounds, losses, bytes."""
        now = time.time()
        rnd = self.open_round()
        cfg = self.cfg.rounds
        peers = []
        summary = self.accounts.book.summary()
        accounts = summary["accounts"]
        for p in self.db.query("SELECT * FROM peers WHERE role = 'worker' ORDER BY joined_at"):
            view = PeerView(p["peer_id"], p["step_time_s"], None, p["last_seen"], p["state"])
            alive = is_alive(now, view, cfg)
            state = p["state"] if p["state"] != "live" else "waiting"
            account = accounts.get(p["peer_id"], {})
            if alive and rnd and p["peer_id"] in rnd.members:
                state = "training"
            peers.append(
                {
                    "peer_id": p["peer_id"],
                    "name": p["name"],
                    "balance": account.get("balance", 0.0),
                    "stake": account.get("stake", 0.0),
                    "reputation": account.get("reputation"),
                    "banned": account.get("banned", False),
                    "device": p["device"],
                    "step_time_s": p["step_time_s"],
                    "state": state,
                    "alive": alive,
                    "last_seen_s_ago": round(now - p["last_seen"], 2),
                    "accepts_connections": bool(p["accepts_connections"]),
                    "contributions": p["contributions"],
                }
            )
        rows = self.db.query(
            "SELECT * FROM (SELECT * FROM rounds WHERE status = 'committed' "
            "ORDER BY round DESC LIMIT 500) ORDER BY round"
        )
        rounds = [
            {
                "round": r["round"],
                "accepted": len(json.loads(r["certificate"])["accepted"]),
                "rejected": len(json.loads(r["certificate"])["rejected"]),
                "tokens": r["tokens"],
                "val_loss": r["val_loss"],
                "train_loss": r["train_loss"],
                "bytes": r["bytes"],
                "duration_s": r["closed_at"] - r["opened_at"],
                "utilization": r["utilization"],
                "weights_hash": r["new_hash"],
            }
            for r in rows
        ]
        total = self.db.one("SELECT COALESCE(SUM(bytes), 0) AS b FROM rounds")
        phase = "open" if rnd else ("finished" if self.finished() else "waiting")
        phase = "halted" if self.halted is not None else phase
        submitted = (
            self.db.one(
                "SELECT COUNT(*) AS n FROM contributions WHERE round = ? AND attempt = ?",
                (rnd.round, rnd.attempt),
            )["n"]
            if rnd
            else 0
        )
        return {
            "run_id": self.run_id,
            "name": self.cfg.name,
            "method": self.cfg.algorithm.method,
            "model": self.cfg.model.size,
            "parameters": self.parameters,
            "round": rnd.round if rnd else self.state.round,
            "phase": phase,
            "deadline_in_s": round(rnd.deadline - now, 2) if rnd else None,
            "committed_rounds": self.state.round,
            "submitted": submitted,
            "bytes_total": total["b"] if total else 0,
            "coordinator_key": self.identity.public_key,
            "halted": self.halted,
            "trust": self.trust_status(summary),
            "weights_hash": self.state_hash,
            "peers": peers,
            "rounds": rounds,
        }
