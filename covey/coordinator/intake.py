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
from covey.blobs import BlobClient
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
            if req.end_state_cid is not None and draw is not None:  # H3: the local-state chain
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
        try:
            if draw is not None and draw.drawn:
                self._secure(req)  # recorded first: it can neither resubmit nor walk away
        finally:
            self._wake.set()
        log.info("[%s - round %d] contribution %s received", req.peer_id, req.round, req.cid[:12])
        # the receipt: with the ledger's signed head, which the peer keeps (covey.peer.heads)
        return {"ok": True, "cid": req.cid, "ledger_head": self.accounts.head()}

    def _book_refusal(
        self,
        c: Any,
        round_: int,
        attempt: int,
        peer_id: str,
        reason: str,
        withheld: bool = False,
    ) -> None:
        """Inside an accounts transaction: a refused contribution's rejections row (the
        certificate lists it) and "contribution rejected" ledger entry; `withheld` marks
        one drawn for verification whose local states its peer did not deliver."""
        now = time.time()
        c.execute(
            "INSERT INTO rejections (round, attempt, peer_id, reason, at) VALUES (?, ?, ?, ?, ?)",
            (round_, attempt, peer_id, reason, now),
        )
        entry: dict[str, Any] = {"round": round_, "peer_id": peer_id, "reason": reason}
        if withheld:
            entry["withheld"] = True  # counts against its reputation (Account.withheld)
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

    def _check_local_state(self, req: schemas.ContributionRequest) -> Draw | None:
        """H3, the local-state chain (covey.algorithms.base): a strategy that carries local
        state names the state its round started from, which must be exactly the end state
        its contribution to the previous round named (in that round's certified attempt;
        none: a fresh start), and its end state, of a local state's exact size. Only the
        hashes are checked here; a validator checks the content by re-execution.

        The evidence, the two states' bytes (3x the model each), crosses the coordinator's
        link only when the contribution is drawn for verification: the draw made here is
        the one the commit makes (`record_round`), at the rate returned here, which the
        commit reuses. An undrawn contribution's states stay on the worker's blob server.
        A drawn one's are fetched by `_secure` once the contribution is recorded, before
        it can be aggregated; a peer whose contribution to this round was drawn and then
        withheld gets no second draw in it (another attempt, another payload)."""
        if not self.strategy.carries_local_state:
            if req.local_state_cid or req.end_state_cid or req.end_state_size:
                raise Rejected(422, "this run's strategy carries no local state to name")
            return None
        if req.end_state_cid is None or req.end_state_size is None:
            raise Rejected(422, "a contribution must name its end local state (end_state_cid)")
        if not self.uploads.is_local_state_size(req.end_state_size):
            raise Rejected(
                422,
                f"end state {req.end_state_cid[:12]} of {req.end_state_size} bytes is not "
                f"a local state of this run",
            )
        prev = self.db.one(  # a contribution refused for its evidence continues no chain
            "SELECT l.end_cid FROM rounds r JOIN local_states l ON l.round = r.round AND "
            "l.attempt = r.attempt AND l.peer_id = ? WHERE r.round = ? AND r.status = 'committed' "
            "AND (l.evidence IS NULL OR l.evidence = 'secured')",
            (req.peer_id, req.round - 1),
        )
        want = prev["end_cid"] if prev is not None else None
        if req.local_state_cid != want:
            raise Rejected(
                422,
                f"starts from local state {(req.local_state_cid or 'fresh')[:12]}, but its "
                f"contribution to round {req.round - 1} ended at {(want or 'none: fresh')[:12]}",
            )
        if self.db.one(  # "lost" (this side failed) may try again in the next attempt
            "SELECT 1 FROM local_states WHERE round = ? AND peer_id = ? "
            "AND evidence IN ('pending', 'withheld')",
            (req.round, req.peer_id),
        ):
            raise Rejected(
                409,
                f"its contribution to round {req.round} was drawn for verification and its "
                f"local states not secured: no second submission in this round",
            )
        if self.blobs.has(req.end_state_cid):  # uploaded: its size is checked all the same
            self.uploads.fetch_from_peer(req.peer_id, req.end_state_cid, req.end_state_size)
        rate = self.accounts.book.sampling_rate(req.peer_id) if self.verifying else 0.0
        drawn, _ = sample(self.identity, self.run_id, req.round, req.peer_id, req.cid, rate)
        return Draw(rate, drawn)

    @functools.cached_property
    def _evidence_fetches(self) -> tuple[threading.Lock, dict[tuple[int, int, str], BlobClient]]:
        return threading.Lock(), {}

    def _secure(self, req: schemas.ContributionRequest) -> None:
        """Fetch a recorded, drawn contribution's start and end states from its peer and
        say so in local_states.evidence: "secured"; "withheld" (its peer did not deliver
        them: refused, and it counts against the peer, `Withheld`); "lost" (this side
        failed: refused, no fault of the peer's, 503). If the round closed first,
        `_refuse_missing_evidence` has refused it already and cut this fetch short."""
        outcome, why = "secured", ""
        limits, key = self.cfg.limits, (req.round, req.attempt, req.peer_id)
        lock, fetches = self._evidence_fetches
        fetcher: BlobClient | None = None
        try:
            # a client of its own: other peers' transfers cannot hold its connections
            fetcher = BlobClient(
                timeout_s=limits.request_timeout_s,
                retries=limits.retries,
                max_bytes=limits.max_blob_bytes,
            )
            with lock:
                fetches[key] = fetcher
            for cid in (req.local_state_cid, req.end_state_cid):
                if cid is not None:
                    size = req.end_state_size or 0
                    self.uploads.fetch_from_peer(req.peer_id, cid, size, fetcher=fetcher)
        except Rejected as e:
            outcome, why = ("lost" if e.status == 503 else "withheld"), e.message
        except OSError as e:  # e.g. no file descriptor left for a client: ours
            outcome, why = "lost", f"{type(e).__name__}: {e}"
        finally:
            with lock:
                fetches.pop(key, None)
            if fetcher is not None:
                fetcher.close()
        with self.accounts.transaction() as c:
            row = c.execute(
                "SELECT evidence FROM local_states WHERE round = ? AND attempt = ? AND peer_id = ?",
                key,
            ).fetchone()
            if row is None or row["evidence"] != "pending":
                raise Withheld(
                    409,
                    f"round {req.round} closed before this contribution's local states "
                    f"arrived (drawn for verification)",
                )
            c.execute(
                "UPDATE local_states SET evidence = ? "
                "WHERE round = ? AND attempt = ? AND peer_id = ?",
                (outcome, *key),
            )
            if outcome == "withheld":
                why = f"drawn for verification, but its local states were not delivered: {why}"
            elif outcome == "lost":
                why = (
                    "drawn for verification; this coordinator failed to store its local "
                    f"states (no fault of the peer's): {why}"
                )
            if outcome != "secured":
                self._book_refusal(c, *key, why, withheld=outcome == "withheld")
        if outcome == "withheld":
            raise Withheld(409, why)
        if outcome == "lost":
            raise Rejected(503, why)

    def close_evidence_fetches(self) -> None:
        """Cut every drawn contribution's fetch short (the coordinator stops): each ends
        as "lost"; one whose row cannot be written any more is released at the restart."""
        lock, fetches = self._evidence_fetches
        with lock:
            for fetcher in fetches.values():
                fetcher.close()

    def _late_evidence(
        self, query: Any, round_: int, attempt: int, deadline: float, now: float
    ) -> tuple[bool, dict[str, bool]]:
        """The drawn contributions of this round attempt still fetching their states:
        (whether the round waits for them, {peer: past its own grace}). Each has its grace
        (`evidence_grace_s`, times the fetches under way: they share this coordinator's
        link), and the round waits no longer than half the workers' patience past its
        deadline (limits.coordinator_lost_s), so a staller cannot make them give up."""
        rows = query(
            "SELECT c.peer_id, c.submitted_at, l.end_size FROM local_states l "
            "JOIN contributions c ON c.round = l.round AND c.attempt = l.attempt "
            "AND c.peer_id = l.peer_id WHERE l.round = ? AND l.attempt = ? "
            "AND l.evidence = 'pending'",
            (round_, attempt),
        )
        timeout, under_way = self.cfg.limits.request_timeout_s, len(rows)
        overdue = {
            r["peer_id"]: now
            >= r["submitted_at"] + evidence_grace_s(timeout, r["end_size"], under_way)
            for r in rows
        }
        cap = deadline + self.cfg.limits.coordinator_lost_s / 2
        return now < cap and not all(overdue.values()), overdue

    def _evidence_pending(self, round_: int, attempt: int, deadline: float, now: float) -> bool:
        """Whether the round waits to close for a drawn contribution's states (`_late_evidence`)."""
        return self._late_evidence(self.db.query, round_, attempt, deadline, now)[0]

    def _release_pending_evidence(self, c: Any) -> None:
        """At a restart, inside its accounts transaction: a drawn contribution whose states
        were being fetched when this coordinator stopped is refused as "lost", no fault of
        its peer's (nothing fetches them again; its peer may submit in the next attempt)."""
        for r in c.execute(
            "SELECT round, attempt, peer_id FROM local_states WHERE evidence = 'pending'"
        ).fetchall():
            c.execute(
                "UPDATE local_states SET evidence = 'lost' "
                "WHERE round = ? AND attempt = ? AND peer_id = ?",
                (r["round"], r["attempt"], r["peer_id"]),
            )
            why = (
                "drawn for verification; the coordinator stopped while fetching its local "
                "states (no fault of the peer's)"
            )
            self._book_refusal(c, r["round"], r["attempt"], r["peer_id"], why)

    def _refuse_missing_evidence(
        self, c: Any, round_: int, attempt: int, deadline: float, now: float
    ) -> set[str]:
        """Inside the close's accounts transaction: refuse every drawn contribution whose
        states are still not here, and cut its fetch short. Past its own grace it is
        withheld (its peer's fault); still within it (the round could not wait longer)
        it is lost (nobody's). Returns the peers the round leaves out for their evidence."""

        def query(sql: str, params: tuple[Any, ...]) -> list[Any]:
            return c.execute(sql, params).fetchall()

        _, overdue = self._late_evidence(query, round_, attempt, deadline, now)
        lock, fetches = self._evidence_fetches
        for peer_id, past_grace in overdue.items():
            outcome = "withheld" if past_grace else "lost"
            c.execute(
                "UPDATE local_states SET evidence = ? "
                "WHERE round = ? AND attempt = ? AND peer_id = ?",
                (outcome, round_, attempt, peer_id),
            )
            why = (
                "drawn for verification, but its local states had not arrived within their "
                "grace when the round closed"
                if past_grace
                else "drawn for verification; the round could not wait longer for its local "
                "states (no fault of the peer's)"
            )
            self._book_refusal(c, round_, attempt, peer_id, why, withheld=past_grace)
            with lock:
                fetcher = fetches.get((round_, attempt, peer_id))
            if fetcher is not None:
                fetcher.close()  # its request thread is freed; it finds the row refused
        return {
            r["peer_id"]
            for r in c.execute(
                "SELECT peer_id FROM local_states WHERE round = ? AND attempt = ? "
                "AND evidence IN ('withheld', 'lost')",
                (round_, attempt),
            )
        }

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


EVIDENCE_BYTES_S = 1 << 20  # slowest rate a drawn contribution's local states may arrive at


def evidence_grace_s(request_timeout_s: float, state_size: int, drawn: int = 1) -> float:
    """How long after its submission a drawn contribution may take to deliver its two
    local states (start and end) before the round closes without it, when `drawn`
    contributions of its round fetch theirs over the same link."""
    return request_timeout_s + 2 * state_size * max(drawn, 1) / EVIDENCE_BYTES_S


class Withheld(Rejected):
    """A contribution drawn for verification whose peer did not deliver the local states
    its check needs (its evidence): refused, and it counts against the peer's reputation.
    Its stake is not touched: that the peer did not serve is the coordinator's word."""
