"""The swarm coordinator's money side: trainers' reports, pay per verified check
(covey.swarm.evidence), payouts and disputes. A mixin of SwarmCoordinator
(covey.swarm.service), which owns the state these methods read and write.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import sqlite3
import threading
import time
from typing import TYPE_CHECKING, Any

from covey.coordinator.rejected import Rejected
from covey.protocol.swarm import MAX_CHECKS_PER_REPORT, SwarmDispute, SwarmReport
from covey.swarm import evidence, payouts
from covey.swarm.observed import Observations
from covey.trust import swarm_evidence

if TYPE_CHECKING:
    from covey.blobs import BlobStore
    from covey.coordinator.accounts import Accounts
    from covey.coordinator.db import Database
    from covey.coordinator.membership import Membership
    from covey.swarm.averaging import Averaging
    from covey.swarm.config import SwarmConfig
    from covey.swarm.referee import Referee
    from covey.swarm.servers import ServerInfo
    from covey.trust.identity import Identity

log = logging.getLogger("covey.swarm")
KNOWN_STATES = 16  # agreed states per stage whose replies are still paid
MAX_PARKED = 4 * MAX_CHECKS_PER_REPORT  # checks waiting for their state, all trainers
MAX_VERDICTS = 1024  # settled disputes remembered, to answer a replay without recomputing


class PayDesk:
    cfg: SwarmConfig
    lock: threading.RLock
    db: Database
    accounts: Accounts
    membership: Membership
    identity: Identity
    referee: Referee
    averaging: Averaging
    blobs: BlobStore
    servers: dict[str, ServerInfo]
    observed: Observations
    trainers: dict[str, dict[str, Any]]
    unpaid: dict[str, int]
    epoch: int
    disputes: list[dict[str, Any]]
    known_states: list[list[str]]
    _parked: list[tuple[float, str, evidence.Check]]
    _saved: dict[str, str]
    _verdicts: dict[str, dict[str, Any]]

    def _save(self, conn: Any = None) -> None:
        raise NotImplementedError

    def known_state(self, stage: int, agreed: str | None) -> None:
        """Remember `stage`'s agreed state (under the lock): replies on it are paid."""
        known = self.known_states[stage]
        if agreed is not None and agreed not in known:
            known[:] = [*known, agreed][-KNOWN_STATES:]

    def trainer_report(self, req: SwarmReport, raw: dict[str, Any]) -> dict[str, Any]:
        """The trainer's loss, reroutes, bans, microbatches each server completed (shown,
        never paid: a trainer's word; they cap the server's pending samples), its router's
        measured throughput of each server (covey.swarm.observed), and evidence of agreed
        checks: pay rests on those alone (covey.swarm.evidence). Answers each check's
        outcome, in order: "paid", "parked" (its state is not agreed yet: settled within two
        round timeouts) or "refused: why"."""
        peer = req.peer_id  # the schema bounded every field (covey.protocol.swarm)
        self.membership.check_run(req.run_id)
        self.membership.authenticate(raw, -1, peer)
        served, measured, items = req.served, req.measured, req.checks
        with self.lock:
            if peer not in self.trainers:  # a server cannot report (and pay) its own work
                raise Rejected(403, f"peer {peer[:16]} has not joined as a trainer")
            t = self.trainers[peer]
            t.update(
                samples=req.samples,
                loss=req.loss,
                reroutes=req.reroutes,
                banned=dict(req.banned),
                next=max(int(t.get("next", 0)), req.next),
            )
            for server, n in served.items():
                if server in self.servers:
                    self.servers[server].served += n
                    self.observed.vouch(server, n * self.cfg.microbatch)
            self.observed.record(peer, measured, set(self.servers), time.time())
            self._save()
        outcomes = []
        now = time.time()
        for item in items:
            try:
                check = evidence.parse(item, self.cfg.stages)
            except evidence.EvidenceError as e:
                outcomes.append(f"refused: {e}")
                continue
            until = now + 2 * self.cfg.round_timeout_s
            outcomes.append(self._settle(peer, check, now, park_until=until))
        return {"ok": True, "checks": outcomes}

    def _settle(self, reporter: str, check: evidence.Check, now: float, park_until: float) -> str:
        """Pay one check's servers (queued for the next payout) if it passes every test:
        both are live servers of its stage, other than the reporter; its state is agreed
        (else it is parked until `park_until`); both signatures hold and the replies agree;
        its request was never paid; and, when drawn, the referee's recomputation agrees
        (a wrong reply convicts). Returns the outcome."""
        with self.lock:
            for s in check.servers:
                info = self.servers.get(s)
                if info is None or info.stage != check.stage or s == reporter:
                    return f"refused: {s[:12]} is no live server of stage {check.stage}"
            if check.state not in self.known_states[check.stage]:
                if len(self._parked) >= MAX_PARKED:  # made-up states must not fill memory
                    return "refused: too many checks wait for their state; report it later"
                if now <= park_until:
                    self._parked.append((park_until, reporter, check))
                    return "parked"
                return f"refused: state {check.state[:12]} is no agreed state of the stage"
            providers = [x.blob_url for x in self.servers.values() if x.stage == check.stage]
        keys = {}
        for s in check.servers:
            keys[s] = self.membership.peers.public_key(s) or ""
        try:
            evidence.verify_agreement(check, keys, self.cfg.tolerance)
        except evidence.EvidenceError as e:
            return f"refused: {e}"
        if self.db.one("SELECT 1 FROM swarm_checks WHERE id = ?", (check.id,)) is not None:
            return "refused: this request was paid already"
        if evidence.drawn(self.identity, check.id, self.cfg.spot_check_rate):
            try:
                verdict = self.referee.settle(check.dispute_body(), keys, providers)
            except Rejected as e:  # the state is nowhere to be had: not verified, not paid
                return f"refused: spot check impossible: {e.message}"
            if verdict["liars"]:
                # the other server's reply agreed with the lie: a missed fraud (payouts)
                agreed = [s for s in check.servers if s in verdict["honest"]]
                proof = self._keep(check.dispute_body(), verdict)
                self._convict(check.stage, "spot check", verdict, reporter, agreed, proof)
                return f"refused: spot check convicted {', '.join(verdict['liars'])}"
            if len(verdict["honest"]) != 2:
                return f"refused: spot check inconclusive: {verdict['detail']}"
        first, second = evidence.tokens_paid(
            self.cfg.microbatch, self.cfg.seq_len, self.cfg.verify_rate
        )
        with self.lock:
            before = dict(self.unpaid)
            for s, n in zip(check.servers, (first, second), strict=True):
                self.unpaid[s] = self.unpaid.get(s, 0) + n
            try:  # the id and the queued pay commit together
                with self.db.transaction() as c:
                    c.execute("INSERT INTO swarm_checks VALUES (?, ?)", (check.id, now))
                    self._save(c)
            except sqlite3.IntegrityError:  # the same evidence settled meanwhile
                self.unpaid, self._saved = before, {}
                return "refused: this request was paid already"
            except BaseException:
                self.unpaid, self._saved = before, {}
                raise
        return "paid"

    def pay(self, now: float) -> None:
        """Pay the work queued since the last payout (covey.swarm.payouts). The ledger
        entries and the emptied queue commit in one transaction: a crash pays nothing twice
        and loses nothing accepted."""
        with self.lock:
            if not self.unpaid:
                return
            due, epoch = self.unpaid, self.epoch + 1
            try:
                with self.accounts.transaction() as c:
                    payouts.pay(self.accounts, self.cfg, due, epoch)
                    self.unpaid = {}
                    self._save(c)
            except BaseException:  # rolled back: still due, and the snapshot not written
                self.unpaid, self._saved = due, {}
                raise
            self.epoch = epoch

    def dispute(self, req: SwarmDispute, raw: dict[str, Any]) -> dict[str, Any]:
        """Two servers of a stage disagreed on a duplicated microbatch: the referee
        recomputes from the signed stage input and state; each server whose reply is off
        is slashed and banned (ledger "dispute" + "slash"). Only a joined trainer files
        one, with exactly two replies (the referee's work is bounded per dispute)."""
        peer = req.peer_id  # exactly two replies: the schema (covey.protocol.swarm)
        self.membership.check_run(req.run_id)
        self.membership.authenticate(raw, -1, peer)
        if not 0 <= req.stage < self.cfg.stages:
            raise Rejected(400, f"stage {req.stage}: stages are 0..{self.cfg.stages - 1}")
        body = req.evidence()
        with self.lock:
            if peer not in self.trainers:
                raise Rejected(403, f"peer {peer[:16]} has not joined as a trainer")
            providers = [s.blob_url for s in self.servers.values()]
        keys = {}
        for r in req.replies:
            key = self.membership.peers.public_key(r.server)
            if key is None:
                raise Rejected(404, f"unknown server {r.server[:12]}")
            keys[r.server] = key
        if len(keys) != 2:
            raise Rejected(400, "a dispute's two replies come from two different servers")
        # the same dispute again (replayed, or filed by another trainer) is answered from
        # its verdict: the referee's recomputation is not a service to call in a loop
        ident = hashlib.sha256(
            json.dumps([body[k] for k in ("stage", "kind", "request", "replies")],
                       sort_keys=True).encode()
        ).hexdigest()  # fmt: skip
        with self.lock:
            known = self._verdicts.get(ident)
        if known is not None:
            return known
        verdict = self.referee.settle(body, keys, providers)
        proof = self._keep(body, verdict) if verdict["liars"] else None
        self._convict(req.stage, req.kind, verdict, peer, None, proof)
        with self.lock:
            self._verdicts[ident] = verdict
            while len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.pop(next(iter(self._verdicts)))
        return verdict

    def _keep(self, body: dict[str, Any], verdict: dict[str, Any]) -> dict[str, Any] | None:
        """A conviction's evidence (covey.trust.swarm_evidence): the request, both replies
        and the stage state the referee recomputed on, kept in the blob store so `covey
        ledger verify --recompute` recomputes the verdict. None (and a warning) when the
        state is no longer held: the conviction stands on the referee's word alone."""
        replies = body["replies"]
        state = str(replies[0]["state"])
        data = self.referee.state_bytes(state)
        if data is None:
            log.warning("[referee] state %s of a conviction is gone: no evidence", state[:12])
            return None
        if not self.blobs.has(state):
            self.blobs.put_verified(state, data)
        request = self.blobs.put(base64.b64decode(body["request"]))
        kept = [(str(r["server"]), self.blobs.put(base64.b64decode(r["reply"])), str(r["sig"]))
                for r in replies]  # fmt: skip
        return swarm_evidence.evidence(
            int(body["stage"]), str(body["kind"]), request, state, kept,
            self.cfg.tolerance, verdict.get("distances", {}),
        )  # fmt: skip

    def _convict(
        self,
        stage: int,
        kind: str,
        verdict: dict[str, Any],
        reporter: str,
        agreed: list[str] | None = None,
        proof: dict[str, Any] | None = None,
    ) -> None:
        """Slash and ban the referee's liars; their reports leave any open round (a liar's
        gradient sum is not averaged into its stage) and their queued pay is void. `agreed`:
        servers whose replies agreed with the lie (a spot check's), which pay a missed
        fraud; the witness is then the reporting trainer, not them. `proof`: the dispute
        entries' evidence (`_keep`)."""
        liars, honest = verdict["liars"], verdict["honest"]
        with self.lock:
            self.epoch += 1
            epoch = self.epoch
        witness = honest[0] if honest and not agreed else reporter
        payouts.convict(
            self.accounts, epoch, stage, liars, witness, verdict["detail"], agreed or [], proof
        )
        with self.lock:
            for liar in liars:
                self.servers.pop(liar, None)
                self.unpaid.pop(liar, None)
                self.averaging.drop(liar)
                log.warning(
                    "[referee] server %s lied on stage %s: slashed and banned", liar[:8], stage
                )
            self.disputes.append(
                {"at": time.time(), "stage": stage, "kind": kind, "liars": liars,
                 "honest": honest}
            )  # fmt: skip
            self._save()
