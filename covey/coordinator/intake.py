"""Contribution intake: every check a contribution must pass before it is recorded for
its round (run, round and attempt, membership, deadline, the start weights it was trained
from, the work it claims against its assignment, its bytes, and its payload's format,
shape and values). Any failure is a `Rejected` that is logged and listed in the round's
certificate, and changes nothing else.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from covey.algorithms import Contribution, RoundError, TrainState
from covey.protocol import schemas
from covey.trust.certify import sample
from covey.trust.identity import Identity, body_content_id

from .rejected import Rejected
from .views import Views

if TYPE_CHECKING:
    from covey.algorithms import Strategy

    from .accounts import Accounts
    from .uploads import Blobs

log = logging.getLogger("covey.coordinator")


class Intake(Views):
    # provided by the rounds mode (covey.coordinator.rounds)
    strategy: Strategy
    uploads: Blobs  # the blob plane component (covey.coordinator.uploads)
    seq_len: int
    _wake: threading.Event
    accounts: Accounts
    authenticate: Any
    _check_run: Any
    _check_not_banned: Any
    template: Any
    identity: Identity
    run_id: str
    verifying: bool

    @functools.cached_property
    def _submitting(self) -> tuple[threading.Lock, set[tuple[str, int]]]:
        return threading.Lock(), set()

    def submit(
        self, round_: int, req: schemas.ContributionRequest, raw: dict[str, Any]
    ) -> dict[str, Any]:
        """Check a contribution completely, then record it. Any failure is a `Rejected`
        (also logged, listed in the round's certificate and, once the sender is
        authenticated, in the ledger) and records nothing else."""
        self._check_run(req.run_id)
        if round_ != req.round:
            raise Rejected(400, f"path says round {round_}, body says round {req.round}")
        self.authenticate(raw, req.round, req.peer_id)
        lock, busy = self._submitting
        with lock:  # one submission per peer and round at a time: no racing duplicates
            if (req.peer_id, req.round) in busy:  # a conflict, not a busy server: no retry
                raise Rejected(
                    409, f"peer {req.peer_id[:12]} is already submitting to round {req.round}"
                )
            busy.add((req.peer_id, req.round))
        try:
            return self._submit(req, raw)
        finally:
            with lock:
                busy.discard((req.peer_id, req.round))
            # a signed submission named them, accepted or refused: no longer pending uploads
            # (else an honest peer refused a few times in a row could upload nothing more)
            named = (req.cid, getattr(req, "end_state_cid", None))
            self.uploads.named(req.peer_id, named)

    def _submit(self, req: schemas.ContributionRequest, raw: dict[str, Any]) -> dict[str, Any]:
        round_ = req.round
        try:
            self._check_not_banned(req.peer_id)
            draw = self._check_contribution(round_, req)
        except Rejected as e:
            with self.accounts.transaction() as c:
                self._book_refusal(c, req.round, req.attempt, req.peer_id, e.message)
            raise
        now = time.time()
        with self.db.transaction() as c:
            row = c.execute(
                "SELECT status, attempt FROM rounds WHERE round = ?", (req.round,)
            ).fetchone()
            if row is None or row["status"] != "open" or row["attempt"] != req.attempt:
                raise Rejected(409, f"round {req.round} closed while the contribution was checked")
            c.execute(
                "INSERT INTO contributions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    req.round,
                    req.attempt,
                    req.peer_id,
                    req.cid,
                    req.size,
                    req.tokens,
                    req.inner_steps,
                    req.fragment,
                    req.train_loss,
                    req.compute_s,
                    req.wall_s,
                    now,
                    body_content_id(raw),
                    req.nonce,
                    req.signature,
                    json.dumps([m.model_dump() for m in req.commitments]),
                ),
            )
            if req.end_state_cid is not None and draw is not None:  # the local-state chain
                c.execute(
                    "INSERT INTO local_states VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        req.round,
                        req.attempt,
                        req.peer_id,
                        req.local_state_cid,
                        req.end_state_cid,
                        req.end_state_size,
                        draw.rate,
                        "pending" if draw.drawn else None,
                    ),
                )
            if req.compute_s > 0:  # the next round plans with the speed seen in this one
                self.peers.set_step_time(c, req.peer_id, req.compute_s / req.inner_steps)
        self.uploads.named(req.peer_id, (req.cid, req.end_state_cid))
        # a drawn contribution's evidence is not fetched here, and its round does not wait
        # for it: its drawn validators fetch it from the worker once the round is certified
        # (covey.coordinator.verification, docs/trust.md "Verification off the critical path")
        self._wake.set()
        log.info("[%s - round %d] contribution %s received", req.peer_id, req.round, req.cid[:12])
        # the receipt: with the ledger's signed head, which the peer keeps (covey.peer.heads),
        # and whether it was drawn for verification: recorded, it can no longer be withdrawn
        # or replaced, and its worker must keep its evidence for the validators
        drawn = draw is not None and draw.drawn
        return {"ok": True, "cid": req.cid, "ledger_head": self.accounts.head(), "drawn": drawn}

    def _book_refusal(
        self,
        c: Any,
        round_: int,
        attempt: int,
        peer_id: str,
        reason: str,
    ) -> None:
        """Inside an accounts transaction: a refused contribution's rejections row (the
        certificate lists it) and "contribution rejected" ledger entry."""
        now = time.time()
        c.execute(
            "INSERT INTO rejections (round, attempt, peer_id, reason, at) VALUES (?, ?, ?, ?, ?)",
            (round_, attempt, peer_id, reason, now),
        )
        entry: dict[str, Any] = {"round": round_, "peer_id": peer_id, "reason": reason}
        self.accounts.append(c, "contribution rejected", entry, now)
        log.warning("[%s - round %d] contribution rejected: %s", peer_id, round_, reason)

    def _check_contribution(self, round_: int, req: schemas.ContributionRequest) -> Draw | None:
        """Every check (see the module docstring); the contribution's draw for
        verification (`_check_local_state`), None for a strategy without local state."""
        rnd = self.open_round()
        if rnd is None or rnd.round != req.round or rnd.attempt != req.attempt:
            now_open = f"{rnd.round}.{rnd.attempt}" if rnd else "none"
            raise Rejected(
                409, f"round {req.round}.{req.attempt} is not open (open round: {now_open}): late"
            )
        if req.start_hash != self.state_hash:
            raise Rejected(
                409,
                f"trained from weights {req.start_hash[:12]}, but round {req.round} starts "
                f"from {self.state_hash[:12]}",
            )
        if self.db.one(
            "SELECT 1 FROM contributions WHERE round = ? AND attempt = ? AND peer_id = ?",
            (req.round, req.attempt, req.peer_id),
        ):
            raise Rejected(409, f"peer {req.peer_id} already submitted to round {req.round}")
        if req.peer_id not in rnd.members:
            raise Rejected(409, f"peer {req.peer_id} is not a member of round {req.round}")
        seen = self.db.one(
            "SELECT round, peer_id FROM contributions WHERE cid = ? LIMIT 1", (req.cid,)
        )
        if seen is not None:  # a stale, replayed or copied contribution: the same bytes again
            who = "its own" if seen["peer_id"] == req.peer_id else f"peer {seen['peer_id'][:12]}'s"
            raise Rejected(
                409,
                f"contribution {req.cid[:12]} has the same bytes as {who} contribution to round "
                f"{seen['round']}: stale, replayed or copied work",
            )
        if time.time() > rnd.deadline:
            raise Rejected(409, f"round {req.round}'s deadline has passed: late")
        budget = rnd.assignments[req.peer_id]["inner_steps"]
        if req.inner_steps > budget:
            raise Rejected(422, f"claims {req.inner_steps} inner steps; assigned {budget}")
        max_tokens = req.inner_steps * self.cfg.data.batch_size * self.seq_len
        if req.tokens > max_tokens:
            raise Rejected(
                422, f"claims {req.tokens} tokens; {req.inner_steps} steps make {max_tokens}"
            )
        payload = self._contribution_bytes(req)
        # checked against the round's shapes, never the state's tensors: a close may be
        # consuming those (covey.coordinator.rounds._next_state)
        start = TrainState(self.template.params, {}, self.state.round)
        try:
            self.strategy.validate(
                start, Contribution(payload, req.tokens, req.inner_steps, req.fragment)
            )
        except RoundError as e:
            raise Rejected(422, f"contribution {req.cid[:12]} is unusable: {e}") from None
        return self._check_local_state(req)

    @functools.cached_property
    def evidence_size(self) -> int:
        """The size of a published end state (covey.trust.evidence.evidence_of: the private
        part of a local state alone, when the strategy does not carry its parameters)."""
        from covey.trust.verify import published_state_nbytes  # torch-heavy: coordinator only

        return published_state_nbytes(self.strategy)

    def _check_local_state(self, req: schemas.ContributionRequest) -> Draw | None:
        """The local-state chain (covey.algorithms.base): a strategy that carries local
        state names the state its round started from, which must be exactly the end state
        its contribution to the previous round named (in that round's certified attempt;
        none: a fresh start), and its end state, of a published end state's exact size
        (`evidence_size`). Only the
        hashes are checked here; a validator checks the content by re-execution.

        The draw made here is the one the commit makes (`record_round`), at the rate
        returned here, which the commit reuses. Nothing is fetched for it: a drawn
        contribution's evidence moves from its worker to its drawn validators after the
        round is certified (covey.coordinator.verification), never through here."""
        if not self.strategy.carries_local_state:
            if req.local_state_cid or req.end_state_cid or req.end_state_size:
                raise Rejected(422, "this run's strategy carries no local state to name")
            return None
        if req.end_state_cid is None or req.end_state_size is None:
            raise Rejected(422, "a contribution must name its end local state (end_state_cid)")
        if req.end_state_size != self.evidence_size:
            raise Rejected(
                422,
                f"end state {req.end_state_cid[:12]} of {req.end_state_size} bytes is not "
                f"a local state of this run",
            )
        prev = self.db.one(  # refused at intake for its evidence (older runs): no chain
            "SELECT l.end_cid FROM rounds r JOIN local_states l ON l.round = r.round AND "
            "l.attempt = r.attempt AND l.peer_id = ? WHERE r.round = ? AND r.status = 'committed' "
            "AND (l.evidence IS NULL OR l.evidence NOT IN ('withheld', 'lost'))",
            (req.peer_id, req.round - 1),
        )
        want = prev["end_cid"] if prev is not None else None
        if req.local_state_cid != want:
            raise Rejected(
                422,
                f"starts from local state {(req.local_state_cid or 'fresh')[:12]}, but its "
                f"contribution to round {req.round - 1} ended at {(want or 'none: fresh')[:12]}",
            )
        if self.blobs.has(req.end_state_cid):  # uploaded: its size is checked all the same
            self.uploads.fetch_from_peer(req.peer_id, req.end_state_cid, req.end_state_size)
        rate = self.accounts.book.sampling_rate(req.peer_id) if self.verifying else 0.0
        drawn, _ = sample(self.identity, self.run_id, req.round, req.peer_id, req.cid, rate)
        return Draw(rate, drawn)

    def _contribution_bytes(self, req: schemas.ContributionRequest) -> memoryview:
        if not self.uploads.is_payload_size(req.size):
            # checked before any fetch: no buffer is sized from what a peer declares
            raise Rejected(
                422,
                f"contribution {req.cid[:12]} of {req.size} bytes: not a payload size of "
                f"this run ({self.uploads.payload_sizes()})",
            )
        # uploaded, or fetched from the peer's own server: relayed for peers that cannot
        # reach it (hash and size checked by the fetch)
        if self.blobs.has(req.cid) and self.blobs.size(req.cid) != req.size:
            size = self.blobs.size(req.cid)
            raise Rejected(422, f"blob {req.cid[:12]} has {size} bytes; request says {req.size}")
        self.uploads.fetch_from_peer(req.peer_id, req.cid, req.size)
        return self.blobs.view(req.cid)


class Draw(NamedTuple):
    """A stateful contribution's draw for verification, made at intake: the peer's
    sampling rate then, and whether the coordinator's draw fell below it."""

    rate: float
    drawn: bool
