"""The coordinator's read side: what peers and the status page see (round info,
certificates, checkpoints, the run spec, the dashboard's status feed). Reads never change
state; the rounds mode (covey.coordinator.rounds) holds the write side and mixes this in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from covey.protocol import schemas
from covey.protocol.rounds import PeerView, is_alive

from .costs import RoundsCosts
from .rejected import Rejected

if TYPE_CHECKING:
    from covey.algorithms import TrainState
    from covey.blobs import BlobStore
    from covey.config import RunConfig
    from covey.trust.identity import Identity

    from .accounts import Accounts
    from .db import Database
    from .liveness import Liveness
    from .peers import Peers

# Cached views : /v1/round and /v1/status answer from views rebuilt when what they show
# changes (the open round's row, the canonical state), not per request over all peers.
# Peers' liveness changes with every heartbeat, so the parts that list live peers are
# rebuilt at most once per VIEW_MAX_AGE_S however many requests come.
VIEW_MAX_AGE_S = 1.0
_CACHE_LOCK = threading.Lock()
_STATUS_LOCK = threading.Lock()  # one status rebuild at a time


@dataclass
class OpenRound:
    round: int
    attempt: int
    opened_at: float
    deadline: float
    members: list[str]
    assignments: dict[str, dict[str, Any]]
    member_set: frozenset[str] = field(default=frozenset(), compare=False)

    def __post_init__(self) -> None:
        self.member_set = frozenset(self.members)  # O(1) "is this peer a member?"


class CommitSignal:
    """Wakes the long-polls when the round view changes (a round opens, commits or is
    aborted; the run is halted): `notify` (from any thread, the round driver's) resolves
    every waiter's future on its own event loop, so a waiter learns of it at once instead
    of polling a timer. Each waiter re-checks its own condition (a certificate, a new
    round tag) and waits on if it is not met."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    def notify(self) -> None:
        """Wake every waiter, WAKE_CHUNK at a time per event loop: between chunks the loop
        reads and answers other requests, so a wake of a thousand long-polls is not a
        second during which no heartbeat is answered."""
        with self._lock:
            waiters, self._waiters = self._waiters, set()
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        for loop, future in waiters:
            by_loop.setdefault(loop, []).append(future)
        for loop, futures in by_loop.items():
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits
                loop.call_soon_threadsafe(_resolve_chunks, loop, futures)

    async def wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `done()` (checked after every commit) or `timeout_s` passes; whether
        it is done. Holds no thread while waiting."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout_s
        while not done():
            left = give_up - loop.time()
            if left <= 0:
                return False
            entry = (loop, loop.create_future())
            with self._lock:
                self._waiters.add(entry)
            try:
                if done():  # committed between the check and registering: no lost wake-up
                    return True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(entry[1], left)
            finally:
                with self._lock:
                    self._waiters.discard(entry)
        return True


WAKE_CHUNK = 16  # long-polls woken per turn of the event loop (CommitSignal.notify)


def _resolve_chunks(loop: asyncio.AbstractEventLoop, futures: list[asyncio.Future[None]]) -> None:
    for future in futures[:WAKE_CHUNK]:
        if not future.done():
            future.set_result(None)
    if len(futures) > WAKE_CHUNK:  # the rest on a later turn, after the loop polls sockets
        loop.call_soon(_resolve_chunks, loop, futures[WAKE_CHUNK:])


class Views:
    # provided by the rounds mode (covey.coordinator.rounds)
    cfg: RunConfig
    run_id: str
    db: Database
    peers: Peers  # covey.coordinator.peers, membership's
    blobs: BlobStore
    state: TrainState
    state_cid: str
    state_hash: str
    parameters: int
    model_name: str  # covey.models.naming, and the source it was built from
    model_source: str
    corpus_fingerprint: str
    model_files_cid: str | None
    identity: Identity
    accounts: Accounts
    verifying: bool
    halted: dict[str, Any] | None  # covey.coordinator.halt
    samples: dict[str, Any] | None  # covey.coordinator.samples, refreshed by the evaluator
    liveness: Liveness  # covey.coordinator.membership

    @property
    def commits(self) -> CommitSignal:
        """Notified at every round change (rounds: _open, _close, _abort; halt); the
        certificate and round long-polls wait on it."""
        with _CACHE_LOCK:
            signal = self.__dict__.get("_commits")
            if signal is None:
                signal = self.__dict__["_commits"] = CommitSignal()
        return signal

    def open_round(self, committed: bool = False) -> OpenRound | None:
        """The open (or closing) round: the latest round's row, when it is open. Rounds open
        in order and only round `state.round` can be open, so the latest row (a primary-key
        lookup) is the one; its members and assignments are parsed once per (round,
        attempt, deadline), not per request. `committed`: read the last committed state
        without waiting for a writer (for polls; not inside a transaction)."""
        one = self.db.read_one if committed else self.db.one
        head = one(
            "SELECT round, attempt, status, opened_at, deadline FROM rounds "
            "ORDER BY round DESC LIMIT 1"
        )
        if head is None or head["status"] not in ("open", "closing"):
            return None
        key = (head["round"], head["attempt"], head["opened_at"], head["deadline"])
        cached = self.__dict__.get("_open_round")
        if cached is not None and cached[0] == key:
            return cached[1]
        row = one("SELECT * FROM rounds ORDER BY round DESC LIMIT 1")
        if row is None or row["status"] not in ("open", "closing"):
            return None
        rnd = OpenRound(
            row["round"],
            row["attempt"],
            row["opened_at"],
            row["deadline"],
            json.loads(row["members"]),
            json.loads(row["assignments"]),
        )
        key = (row["round"], row["attempt"], row["opened_at"], row["deadline"])
        self.__dict__["_open_round"] = (key, rnd)
        return rnd

    def _start_view(self) -> tuple[int, list[str]]:
        """(size, providers) of the current state: rebuilt when the state changes, and at
        most every VIEW_MAX_AGE_S for the providers' liveness."""
        cid, now = self.state_cid, time.monotonic()
        cached = self.__dict__.get("_start_view_cache")
        if cached is not None and cached[0] == cid and now - cached[1] < VIEW_MAX_AGE_S:
            return cached[2]
        view = (self.blobs.size(cid), self.state_providers())
        self.__dict__["_start_view_cache"] = (cid, now, view)
        return view

    def finished(self) -> bool:
        """No round opens again: max_rounds reached, or the owner halted the run."""
        cap = self.cfg.rounds.max_rounds
        return self.halted is not None or (cap is not None and self.state.round >= cap)

    def _round_tag(self, rnd: OpenRound | None) -> str:
        """RoundInfo.tag: what changes when a round opens, commits or is aborted, or the
        run finishes or is halted (not the deadline, nor membership)."""
        if self.halted is not None:
            return "halted"
        if rnd is None:
            return f"{'finished' if self.finished() else 'waiting'}:{self.state.round}"
        return f"open:{rnd.round}:{rnd.attempt}"

    def round_news(self, after: str, peer_id: str | None) -> bool:
        """Whether a round long-poll past tag `after` has news for `peer_id` now: the tag
        differs and it is something the peer acts on: a round it is a member of (any
        round, for a poll that names no peer), or the run finished or halted. A round that
        only closed ("waiting"), or one the peer is not in, is not: the poll waits on, so
        one round change wakes its members, not every peer."""
        rnd = None if self.halted is not None else self.open_round(committed=True)
        tag = self._round_tag(rnd)
        if tag == after or tag.startswith("waiting:"):
            return False
        return rnd is None or peer_id is None or peer_id in rnd.member_set

    def round_info(self, peer_id: str | None) -> schemas.RoundInfo:
        if (halted := self.halted) is not None:
            return schemas.RoundInfo(
                run_id=self.run_id,
                phase="halted",
                round=self.state.round,
                halted=halted["reason"],
                tag=self._round_tag(None),
            )
        rnd = self.open_round(committed=True)
        if rnd is None:
            phase = "finished" if self.finished() else "waiting"
            return schemas.RoundInfo(
                run_id=self.run_id, phase=phase, round=self.state.round, tag=self._round_tag(None)
            )
        member = peer_id in rnd.member_set
        start_size, providers = self._start_view()
        return schemas.RoundInfo(
            run_id=self.run_id,
            phase="open",
            round=rnd.round,
            attempt=rnd.attempt,
            start_cid=self.state_cid,
            start_hash=self.state_hash,
            start_size=start_size,
            providers=providers,
            deadline_in_s=rnd.deadline - time.time(),
            member=member,
            assignment=schemas.AssignmentOut(**rnd.assignments[peer_id]) if member else None,
            tag=self._round_tag(rnd),
        )

    def state_providers(self) -> list[str]:
        """Peers that hold the current canonical state: those accepted in the round that
        produced it (they verified its hash) and that accept connections."""
        row = self.db.read_one(
            "SELECT certificate FROM rounds WHERE status = 'committed' ORDER BY round DESC LIMIT 1"
        )
        if row is None:
            return []
        cert = schemas.Certificate.model_validate_json(row["certificate"])
        live = {p["peer_id"] for p in self.peers.live(committed=True)}
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
            "mode": "rounds",
            "coordinator_key": self.identity.public_key,
            "verifying": self.verifying,
            "spec": self.cfg.model_dump(mode="json"),
            "corpus_fingerprint": self.corpus_fingerprint,
            "parameters": self.parameters,
            "model_files_cid": self.model_files_cid,  # covey.models.bundle; None: no hf: files
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
            {"peer_id": p["peer_id"], "name": p["name"]} for p in self.peers.by_role("validator")
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
        """The dashboard's feed (covey/dashboard/static): peers, rounds, losses, bytes.
        Cached: rebuilt after any write to the database (SQLite's total_changes() on the
        coordinator's one connection: a join, a submission, a commit, a heartbeat flush),
        and at most every VIEW_MAX_AGE_S otherwise (its peers' ages), whatever the rate of
        requests."""
        rnd = self.open_round()
        changes = self.db.one("SELECT total_changes() AS n")
        key = (
            None if rnd is None else (rnd.round, rnd.attempt, rnd.deadline),
            self.state_cid,
            self.halted is None,
            changes["n"] if changes else None,
            self.samples["round"] if self.samples else None,
        )
        with _STATUS_LOCK:  # one rebuild at a time; the others wait for it, then share it
            cached = self.__dict__.get("_status_cache")
            now = time.monotonic()
            if cached is not None and cached[0] == key and now - cached[1] < VIEW_MAX_AGE_S:
                return cached[2]
            view = self._status(rnd)
            self.__dict__["_status_cache"] = (key, now, view)
            return view

    def _status(self, rnd: OpenRound | None) -> dict[str, Any]:
        now = time.time()
        cfg = self.cfg.rounds
        peers = []
        summary = self.accounts.book.summary()
        accounts = summary["accounts"]
        for p in self.peers.by_role("worker"):
            seen = self.liveness.last_seen(p["peer_id"], p["last_seen"])  # unflushed beats
            view = PeerView(p["peer_id"], p["step_time_s"], None, seen, p["state"])
            alive = is_alive(now, view, cfg)
            state = p["state"] if p["state"] != "live" else "waiting"
            account = accounts.get(p["peer_id"], {})
            if alive and rnd and p["peer_id"] in rnd.member_set:
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
                    "last_seen_s_ago": round(now - seen, 2),
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
            "model_name": self.model_name,
            "model_source": self.model_source,
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
            "samples": self.samples,  # covey.coordinator.samples; None until the first
            "costs": self.costs(),  # the decentralization multiplier and its parts
        }

    def costs(self) -> dict[str, Any]:
        """covey.coordinator.costs over the run so far, updated when a round commits or a
        check is reported: each update books only the rounds committed since the last one
        (RoundsCosts), and re-reads the checks."""
        n = self.db.one("SELECT COUNT(report) AS n FROM verifications")
        key = (self.state.round, n["n"] if n else 0)
        cached = self.__dict__.get("_costs_cache")
        if cached is None or cached[0] != key:
            booking = self.__dict__.setdefault("_costs_booking", RoundsCosts())
            cached = (key, booking.update(self.db, self.peers).as_dict())
            self.__dict__["_costs_cache"] = cached
        return cached[1]
