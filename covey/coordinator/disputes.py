"""Disputes on the coordinator: a validator's report is validated in full before anything
is judged, and the referee (a thread) recomputes one disputed segment and decides
(covey.trust.referee, after Verde, arXiv 2502.19405).

Nothing a party supplies decides a verdict unless it is bound by a hash the accused
committed to: a report is refused when its segment is out of range or a blob it names is
missing or of a size the run does not imply (`_report_fault`); the referee uses a
validator's segment-start state only when it hashes to the worker's commitment, else it
recomputes from W_r. A judging that raises is retried `trust.dispute_attempts` times, then
closed "inconclusive": nobody is slashed on an exception. "fraud" slashes and bans the
worker, pays the validator `catch_reward`, and costs every validator that agreed on the
contribution its stake share and check pay, and the worker its paid work
(covey.coordinator.checks.Checks.convict); "validator wrong" (its report provably
wrong) costs the validator `validator_slash_fraction` of its stake; "honest drift" (the
worker right, the validator near it: cross-thread rounding past the tolerance) costs
nobody anything.
"""

from __future__ import annotations

import copy
import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from covey.algorithms import build_strategy
from covey.algorithms.codec_base import CodecError
from covey.blobs import BlobError
from covey.data.batches import assignment_batches
from covey.devices import RefereeCompute, referee_compute
from covey.protocol import schemas
from covey.protocol.checkpoint import state_from_bytes
from covey.trust import referee, verify
from covey.trust.sketch import commitment_of

from .checks import Outcome, Verdict

if TYPE_CHECKING:
    from covey.algorithms import Strategy, TrainState
    from covey.blobs import BlobStore
    from covey.config import RunConfig
    from covey.data.corpus import Corpus

    from .accounts import Accounts
    from .checks import Checks
    from .db import Database
    from .peers import Peers

log = logging.getLogger("covey.coordinator")

# the referee's findings (covey.trust.referee) as the outcomes every mode's referee gives
REFEREE_OUTCOMES: dict[str, Outcome] = {
    "fraud": "convicted",
    "validator wrong": "cleared",
    "honest drift": "cleared",
    "inconclusive": "inconclusive",
}


class Disputed(NamedTuple):
    """What the rounds referee judges: a check's task and the report disputing it."""

    task: schemas.VerifyTask
    report: schemas.VerifyReport


class Disputes:
    # provided by Coordinator / Verification
    cfg: RunConfig
    db: Database
    peers: Peers  # covey.coordinator.peers, membership's
    accounts: Accounts
    checks: Checks  # missed-fraud accounting, shared with RL
    blobs: BlobStore
    strategy: Strategy
    template: TrainState
    corpus: Corpus
    seq_len: int
    _task: Any
    _reveal_by_referee: Any  # covey.coordinator.canary: a house canary's reveal
    _disputes: queue.Queue[int | None]
    _referee_thread: threading.Thread | None
    _referee_strategy: Strategy | None
    referee_compute: RefereeCompute | None = None  # set_referee_device; None: the host
    _attempts: dict[int, int]
    _layout: tuple[int, dict[str, int]] | None
    _layout_lock: threading.Lock

    # -- the report, before anything is judged -------------------------------------------

    def _report_fault(
        self, task: schemas.VerifyTask, req: schemas.VerifyReport
    ) -> tuple[str, str] | None:
        """(field, reason) for a report that cannot be judged as it stands, else None: a
        round other than the task's; a disagreement without a segment, or one the round
        does not have; evidence missing for the segment (the validator's commitment at its
        end, or its payload for the last one); a commitment at the wrong step or of the
        wrong layout; a blob it names that was not uploaded or whose size is not the size
        this run's model and codec imply."""
        if req.round != task.round:
            return "round", f"task {task.task_id} is of round {task.round}, not {req.round}"
        if req.outcome != "disagree":
            return None
        if task.local_state_cid is not None and not self.blobs.has(task.local_state_cid):
            # the referee re-executes from it: a dispute brings the evidence it fetched
            return "local_state_cid", (
                f"the disputed contribution started from local state "
                f"{task.local_state_cid[:12]}: upload it (PUT /v1/blobs/...) with the dispute"
            )
        k = self.cfg.trust.commit_every
        n = len(verify.commitment_steps(task.inner_steps, k))
        if req.segment is None:
            return "segment", "a disagreement names the first diverging segment"
        if req.segment >= n:
            return "segment", (
                f"segment {req.segment} out of range: a round of {task.inner_steps} inner "
                f"steps committing every {k} has segments 0..{n - 1}"
            )
        state_size, sketch_lengths = self._evidence_layout()
        last = req.segment == n - 1
        if last and req.payload_cid is None:
            return "payload_cid", f"segment {req.segment} is the last: back it with a payload"
        if not last:
            if req.claim is None:
                return "claim", f"segment {req.segment} ends at commitment {req.segment + 1}"
            try:
                claim = verify.Commitment.from_dict(req.claim.model_dump())
            except ValueError as e:
                return "claim", str(e)
            if claim.step != (end := (req.segment + 1) * k):
                return "claim", f"step {claim.step}, segment {req.segment} ends at step {end}"
            lengths = {g: len(v) for g, v in claim.sketch.items()}
            if lengths != sketch_lengths:
                return "claim", f"sketch lengths {lengths}, this run's are {sketch_lengths}"
        names = self.strategy.fragment_names(task.fragment)
        numel = sum(self.template.params[n].numel() for n in names)
        sizes = {
            "state_cid": (req.state_cid, state_size),
            "payload_cid": (req.payload_cid, self.strategy.codec.nbytes(numel)),
        }
        for field, (cid, size) in sizes.items():
            if cid is None:
                continue
            if not self.blobs.has(cid):
                return field, f"blob {cid[:12]} was not uploaded (PUT /v1/blobs/...)"
            if (got := self.blobs.size(cid)) != size:
                return field, f"blob {cid[:12]} is {got} bytes; this run implies {size}"
        return None

    def _evidence_layout(self) -> tuple[int, dict[str, int]]:
        """(bytes of a local state as `verify.local_state_to_bytes` writes it, the sketch
        lengths of a commitment): fixed by the model and config, computed once from zeros
        of the strategy's local state's names, shapes and dtypes."""
        with self._layout_lock:
            if self._layout is None:
                layout = self.strategy.local_state_layout()
                # broadcast views of one zero: no model-sized tensors made
                zeros = {
                    n: torch.zeros((), dtype=t.dtype).expand(t.shape) for n, t in layout.items()
                }
                start = {n: zeros[f"param/{n}"] for n in self.template.params}
                c = commitment_of(zeros, start, 0)
                lengths = {g: len(v) for g, v in c.sketch.items()}
                self._layout = (verify.local_state_nbytes(layout), lengths)
            return self._layout

    # -- the referee --------------------------------------------------------------------------

    def start_referee(self) -> None:
        for row in self.db.query("SELECT id FROM verifications WHERE status = 'disputed'"):
            self._disputes.put(row["id"])  # disputes left open by a restart
        self._referee_thread = threading.Thread(target=self._referee, name="referee", daemon=True)
        self._referee_thread.start()

    def set_referee_device(self, spec: str | None = None) -> RefereeCompute:
        """Where the referee recomputes: the run's `[peer] verify_device` class and
        precision (covey.devices.referee_compute; `spec` is the coordinator's --device).
        A coordinator that cannot provide them warns now and judges nothing: disputes stay
        open (contributions held) until a coordinator on that class is started on this
        data dir, rather than convict on another class. DeviceError for a bad `spec`."""
        peer = self.cfg.peer
        self.referee_compute = referee_compute(peer.verify_device, peer.precision, spec)
        self._referee_strategy = None
        if self.referee_compute.refusal is not None:
            log.warning(
                "this coordinator will not judge disputes: %s; they stay open until it runs "
                "with a %s device (--device)",
                self.referee_compute.refusal,
                peer.verify_device,
            )
        return self.referee_compute

    def stop_referee(self) -> None:
        self._disputes.put(None)
        if self._referee_thread is not None:
            self._referee_thread.join(30)

    def _referee(self) -> None:
        while (task_id := self._disputes.get()) is not None:
            try:
                if task_id < 0:  # a house canary no validator convicted (canary.py)
                    self._reveal_by_referee(-task_id)
                else:
                    self._settle(task_id)
            except Exception as e:  # a bug must not kill the referee nor convict anyone
                self._referee_failed(task_id, e)

    def _referee_failed(self, task_id: int, error: Exception) -> None:
        """A dispute whose judging raised stays open and goes to the back of the queue
        (other disputes first); after `trust.dispute_attempts` failures it is closed
        "inconclusive": nobody slashed or paid for it, recorded on the ledger."""
        attempts = self._attempts.get(task_id, 0) + 1
        self._attempts[task_id] = attempts
        log.error(
            "referee failed on task %d (attempt %d of %d)",
            task_id,
            attempts,
            self.cfg.trust.dispute_attempts,
            exc_info=error,
        )
        if attempts < self.cfg.trust.dispute_attempts:
            self._disputes.put(task_id)
            return
        try:
            self._close_inconclusive(
                task_id, f"the referee failed {attempts} times: {type(error).__name__}: {error}"
            )
        except Exception:  # the database itself failing: left open for a restart
            log.exception("could not close dispute %d as inconclusive", task_id)

    def _close_inconclusive(self, task_id: int, detail: str) -> None:
        """Close an open dispute as "inconclusive" on the ledger (nobody slashed)."""
        v = self.db.one("SELECT * FROM verifications WHERE id = ?", (task_id,))
        if v is None or v["status"] != "disputed":
            return
        report = json.loads(v["report"] or "{}")
        with self.accounts.transaction() as c:
            c.execute("UPDATE verifications SET status = 'inconclusive' WHERE id = ?", (task_id,))
            self.accounts.append(
                c,
                "dispute",
                {
                    "round": v["round"],
                    "peer_id": v["peer_id"],
                    "validator_id": v["validator_id"],
                    "segment": int(report.get("segment") or 0),
                    "outcome": "inconclusive",
                    "detail": detail[:500],
                },
                time.time(),
            )

    def _settle(self, task_id: int) -> None:
        """Recompute the disputed segment alone and write the outcome to the ledger."""
        rc = self.referee_compute
        if rc is not None and rc.refusal is not None:  # open, not judged on another class
            log.warning("dispute %d stays open: %s", task_id, rc.refusal)
            return
        task = self._task(task_id)
        row = self.db.one("SELECT report FROM verifications WHERE id = ?", (task_id,))
        assert row is not None
        report = schemas.VerifyReport.model_validate_json(row["report"])
        verdict = self.judge(Disputed(task, report))  # raises: retried, then inconclusive
        outcome, detail = verdict.finding, verdict.detail
        now = time.time()
        trust = self.cfg.trust
        with self.accounts.transaction() as c:
            # not fraud, and more checks required: open again for the next validators
            book = self.accounts.book
            reopen = outcome != "fraud" and not book.checks_complete(task.round, task.peer_id)
            status = "pending" if reopen else outcome
            c.execute("UPDATE verifications SET status = ? WHERE id = ?", (status, task_id))
            self.accounts.append(
                c,
                "dispute",
                {
                    "round": task.round,
                    "peer_id": task.peer_id,
                    "validator_id": report.validator_id,
                    "segment": report.segment,
                    "outcome": outcome,
                    "detail": detail,
                },
                now,
            )
            if verdict.convicted:
                self.accounts.append(
                    c,
                    "slash",
                    {
                        "round": task.round,
                        "peer_id": task.peer_id,
                        "amount": self.accounts.book.slash_amount(task.peer_id),
                        "reason": detail,
                    },
                    now,
                )
                self.accounts.append(
                    c,
                    "reward",
                    {
                        "round": task.round,
                        "peer_id": report.validator_id,
                        "amount": trust.catch_reward,
                        "kind": "catch",
                        "tokens": 0,
                    },
                    now,
                )
                self.peers.ban(c, task.peer_id)
                c.execute(
                    "UPDATE payouts SET status = 'forfeit' WHERE peer_id = ? AND status = 'due'",
                    (task.peer_id,),
                )
                # validators that agreed on it missed a fraud; its paid work is clawed back
                self.checks.convict(c, task.round, task.peer_id, detail, now)
            elif outcome == "validator wrong":  # a false accusation costs its stake share
                self.accounts.append(
                    c,
                    "penalty",
                    {
                        "round": task.round,
                        "peer_id": report.validator_id,
                        "amount": self.accounts.book.penalty_amount(report.validator_id),
                        "kind": "false accusation",
                        "reason": detail[:500],
                    },
                    now,
                )
        log.warning(
            "[round %d] dispute over %s's contribution (segment %s): %s: %s",
            task.round,
            task.peer_id[:8],
            report.segment,
            outcome.upper() if outcome == "fraud" else outcome,
            detail,
        )

    def judge(self, item: Disputed) -> Verdict:
        """The referee's verdict on a disputed check (covey.coordinator.checks.Referee):
        "fraud" convicts the worker; "validator wrong" and "honest drift" clear it."""
        outcome, detail = self._judge(item.task, item.report)
        return Verdict(REFEREE_OUTCOMES[outcome], detail, outcome, item.report.segment)

    def _judge(self, task: schemas.VerifyTask, report: schemas.VerifyReport) -> tuple[str, str]:
        """Recompute the disputed segment and compare its end with what the worker and the
        validator each claim it is. The validator's state at the segment's start is used
        only when it hashes to the worker's own commitment there (covey.trust.referee);
        otherwise the referee recomputes from W_r. "fraud" only on the worker's own
        provable fault: a claim malformed on its face, or an end far from the recomputed
        one; a report that does not hold together is "inconclusive", never fraud."""
        strategy = self._referee_strategy_for()
        trust = self.cfg.trust
        start = state_from_bytes(self.blobs.get(task.start_cid), self.template)
        numel = sum(start.params[n].numel() for n in strategy.fragment_names(task.fragment))
        points = verify.commitment_steps(task.inner_steps, trust.commit_every)
        segment = report.segment
        if segment is None or not 0 <= segment < len(points):  # validated at report time
            return "inconclusive", f"segment {segment} is not one of 0..{len(points) - 1}"
        try:
            claimed = [verify.Commitment.from_dict(c) for c in task.commitments]
            steps = [c.step for c in claimed]
            if steps != points:
                raise ValueError(f"commitments at steps {steps[:8]}, the round's are {points[:8]}")
            worker_end = verify.segment_end(
                claimed, self.blobs.get(task.cid), segment, strategy.codec, numel
            )
        except (ValueError, CodecError) as e:
            # a claim that is malformed on its face needs no recomputation
            return "fraud", f"the worker's claim is malformed: {e}"
        try:
            validator_end: Any
            if segment == len(points) - 1:
                if report.payload_cid is None:
                    return "inconclusive", "the validator backed the last segment with no payload"
                data = self.blobs.get(report.payload_cid)
                validator_end = strategy.codec.decode(data, numel)
            elif report.claim is not None:
                validator_end = verify.Commitment.from_dict(report.claim.model_dump())
            else:
                return "inconclusive", "the validator backed its dispute with no claim"
        except (ValueError, CodecError, BlobError) as e:
            return "inconclusive", f"the validator's evidence is unusable: {e}"
        seg_state = None
        if report.state_cid is not None and segment > 0:
            try:
                seg_state = verify.local_state_from_bytes(
                    self.blobs.get(report.state_cid), strategy.local_state()
                )
            except (ValueError, BlobError) as e:  # the referee recomputes from W_r instead
                log.info("task %d: the validator's state is unusable: %s", task.task_id, e)
        result = referee.referee(
            strategy,
            start,
            segment,
            seg_state,
            self._batch_fn(task.round, task.data_key),
            task.inner_steps,
            trust.commit_every,
            claimed_start=claimed[segment],
            tolerance=trust.tolerance,
            **self._previous_end(task, strategy),  # the committed start local state
        )
        verdict = referee.judge(result, worker_end, validator_end, trust.tolerance)
        return verdict.outcome, verdict.detail

    def _previous_end(self, task: schemas.VerifyTask, strategy: Strategy) -> dict[str, Any]:
        """Referee arguments for the task's committed start local state (none: fresh).
        ValueError for a blob that is not a local state of this run (checked by hash at
        intake, so only a coordinator bug gets here)."""
        if task.local_state_cid is None:
            return {}
        data = self.blobs.get(task.local_state_cid)
        return {
            "previous_end": verify.local_state_from_bytes(data, strategy.evidence_layout()),
            "previous_accepted": task.previous_accepted,
        }

    def _referee_strategy_for(self) -> Strategy:
        """The referee's own copy of the strategy (its model is trained on; the round
        driver's is not touched)."""
        if self._referee_strategy is None:
            rc, s = self.referee_compute, self.strategy
            if rc is None or rc.device is None or rc.device.type == "cpu":
                self._referee_strategy = copy.deepcopy(s)
            else:  # on the run's verify class, as a validator there builds it
                model = copy.deepcopy(s.model).to(rc.device)
                self._referee_strategy = build_strategy(
                    self.cfg.algorithm, model, s.loss_fn, s.aggregator
                )
            if rc is not None:
                self._referee_strategy.set_compute(rc.precision, self.cfg.peer.compile)
        return self._referee_strategy

    def _batch_fn(self, round_: int, data_key: str) -> Any:
        return assignment_batches(self.cfg, self.corpus, self.seq_len, round_, data_key)
