"""Verification off the critical path (docs/trust.md): a round never waits for a drawn
contribution's evidence; the drawn validators fetch it from the worker's own blob server,
not from the coordinator; a worker whose evidence its validators attest withheld is
slashed and clawed back, on their signed reports, which `covey ledger verify` replays, and
one validator alone cannot frame an honest worker; a cheat convicted two rounds after its
round was certified is slashed and clawed back, and the certified chain stands.

An in-process coordinator driven by hand (tests/test_evidence.py's harness), workers' blob
servers and the validator's evidence fetch over real sockets on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from covey.blobs import BlobClient, BlobStore
from covey.coordinator.auth import _RECEIVED_AT
from covey.coordinator.rejected import Rejected
from covey.io import audit
from covey.peer.validator import Undelivered, Validator, ValidatorOptions
from covey.protocol import schemas
from covey.protocol.content import content_id
from covey.trust import verify
from covey.trust.evidence import evidence_of
from covey.trust.identity import Identity, request_purpose
from covey.trust.incentives import Book
from covey.trust.ledger import LedgerError, read_entries
from tests import test_evidence
from tests.test_evidence import Peer, account, entries_of, overdue, signed
from tests.treasury_helpers import fund

make = test_evidence.make  # the in-process coordinator fixture


class HandValidator:
    """A staked validator key that claims and reports by hand (signed as `covey
    validator` signs)."""

    def __init__(self, coord: Any, name: str, stake: float = 10.0) -> None:
        self.coord, self.key = coord, Identity.generate()
        self.id = self.key.peer_id
        fund(coord, self.key.public_key, stake)  # the run's owner funds what it bonds
        body = {
            "run_id": coord.run_id, "validator_id": self.id, "public_key": self.key.public_key,
            "name": name, "stake": stake,
        }  # fmt: skip
        self._call("/v1/validators/join", body, -1, coord.verification.validator_join,
                   schemas.ValidatorJoin)  # fmt: skip

    def _call(self, path: str, body: dict[str, Any], round_: int, fn: Any, model: Any) -> Any:
        raw = signed(self.key, body, path, round_)
        token = _RECEIVED_AT.set(request_purpose(path))
        try:
            return fn(model.model_validate(raw), raw)
        finally:
            _RECEIVED_AT.reset(token)

    def claim(self) -> schemas.VerifyTask | None:
        body = {"run_id": self.coord.run_id, "validator_id": self.id}
        reply = self._call(
            "/v1/verify/claim", body, -1, self.coord.verification.claim, schemas.ClaimRequest
        )
        return None if reply["task"] is None else schemas.VerifyTask.model_validate(reply["task"])

    def report(self, task: schemas.VerifyTask, outcome: str, **extra: Any) -> Any:
        body = {
            "run_id": self.coord.run_id, "round": task.round, "validator_id": self.id,
            "task_id": task.task_id, "outcome": outcome, **extra,
        }  # fmt: skip
        return self._call(
            "/v1/verify/report", body, task.round, self.coord.verification.report,
            schemas.VerifyReport,
        )  # fmt: skip


def commit(coord: Any, peers: list[Peer], draws: dict[str, bool], starts: dict[str, Any]) -> None:
    """Every peer submits to the open round (drawn as `draws` says), and the round commits."""
    coord.tick(time.time())
    for p in peers:
        k = p.k_drawn(want=draws.get(p.id, False), start=1000 * coord.state.round)
        out = p.submit(k, start_cid=starts.get(p.id))
        assert isinstance(out, dict), out
        starts[p.id] = content_id(p.end_state())
    overdue(coord)
    round_ = coord.state.round
    coord.tick(time.time())
    assert coord.state.round == round_ + 1


def test_a_round_closes_while_a_drawn_contributions_evidence_is_still_moving(make) -> None:
    """The drawn worker's blob server holds every request it gets; the round commits at
    once with the drawn contribution sampled in, and nothing asked for its states: they
    wait for the drawn validators, who ask the worker, not the coordinator."""
    coord = make(min_peers=2)
    honest, drawn = Peer(coord, "honest"), Peer(coord, "drawn")
    release, end = threading.Event(), content_id(drawn.end_state())
    # a request for its evidence would hang here
    drawn.server.hook = lambda cid: release.wait(30) if cid == end else None
    try:
        coord.tick(time.time())
        assert isinstance(honest.submit(honest.k_drawn(want=False)), dict)
        t0 = time.monotonic()
        receipt = drawn.submit(drawn.k_drawn(want=True))
        assert isinstance(receipt, dict) and receipt["drawn"] is True, receipt
        coord.tick(time.time())  # everyone submitted: the close does not wait
        assert coord.open_round() is None and coord.state.round == 1
        assert time.monotonic() - t0 < 25  # under the hook's 30 s: nothing waited on it
        assert end not in drawn.server.requested and not coord.blobs.has(end)
        accepted = [e for e in entries_of(coord, drawn.id) if e.type == "contribution accepted"]
        assert [a.payload["sampled"] for a in accepted] == [True]
        validator = HandValidator(coord, "v")
        task = validator.claim()
        assert task is not None and task.peer_id == drawn.id
        assert task.providers == [drawn.server.url] and task.end_state_cid == end
    finally:
        release.set()


def fetcher(coord: Any) -> Validator:
    """A `covey validator` whose evidence fetch is used alone (no coordinator session)."""
    v = Validator(ValidatorOptions(coordinator="http://127.0.0.1:9"))
    v.blobs = BlobClient(timeout_s=5.0, retries=1)
    v.cfg = coord.cfg
    return v


def test_a_validator_fetches_evidence_from_the_worker_and_waits_out_a_slow_provider(
    make, tmp_path: Path
) -> None:
    """A slow provider (its bytes trickle) within the deadline delivers; a provider that
    does not have the state is asked again until the deadline, then Undelivered."""
    coord = make(min_peers=1)
    slow, gone = Peer(coord, "slow"), Peer(coord, "gone")
    end = slow.end_state()[: 96 << 10]  # trickled at 80 KiB/s
    cid = content_id(end)
    slow.server.blobs[cid] = end
    slow.server.trickle.add(cid)
    v = fetcher(coord)
    t0 = time.monotonic()
    path = v._fetch_evidence(
        BlobStore(tmp_path / "a"), cid, [slow.server.url], len(end), time.monotonic() + 60
    )
    assert path.read_bytes() == end and slow.server.requested.count(cid) >= 1
    assert time.monotonic() - t0 > 0.3  # it did trickle
    missing = content_id(gone.end_state())
    t0 = time.monotonic()
    with pytest.raises(Undelivered, match="not delivered"):
        v._fetch_evidence(
            BlobStore(tmp_path / "b"), missing, [gone.server.url], 100, time.monotonic() + 2.5
        )
    assert time.monotonic() - t0 >= 2.5 and gone.server.requested.count(missing) >= 2
    assert not coord.blobs.has(cid)  # nothing of it went through the coordinator


def test_withheld_evidence_attested_by_the_drawn_validators_is_slashed(make) -> None:
    """Two drawn validators attest, signed, that the drawn worker did not deliver: the
    first alone changes nothing (the second still holds its check); with the second the
    worker is slashed, excluded and counted as withholding, and `covey ledger verify`
    replays it. An attestation naming another worker is refused."""
    coord = make(min_peers=1, new=3)  # new peers are always drawn, checked by two
    worker = Peer(coord, "withholder")
    a, b = HandValidator(coord, "a"), HandValidator(coord, "b")
    commit(coord, [worker], {worker.id: True}, {})
    ta, tb = a.claim(), b.claim()
    assert ta is not None and tb is not None and ta.task_id == tb.task_id
    stake = account(coord, worker.id).stake
    first = a.report(ta, "withheld", worker_id=worker.id, detail="404 until the deadline")
    assert first["status"] != "withheld"  # b still holds its check
    with pytest.raises(Rejected, match="worker_id"):
        b.report(tb, "withheld", worker_id=a.id)  # refused: b's check ends, against b
    acc = account(coord, worker.id)
    assert not acc.banned and acc.slashed == 0 and acc.withheld == 0
    c = HandValidator(coord, "c")
    tc = c.claim()  # drawn in b's place
    assert tc is not None and tc.task_id == tb.task_id
    second = c.report(tc, "withheld", worker_id=worker.id)
    assert second["status"] == "withheld"
    acc = account(coord, worker.id)
    assert acc.banned and acc.withheld == 1
    assert acc.slashed == pytest.approx(coord.cfg.trust.slash_fraction * stake)
    slashes = [e for e in entries_of(coord, worker.id) if e.type == "slash"]
    assert len(slashes) == 1 and slashes[0].payload["withheld"] is True
    coord.stop()
    audit.verify(coord.data_dir)
    # the slash rests on the validators' signatures: an attestation edited (its detail) or
    # taken away makes the book refuse the ledger
    entries = read_entries(coord.data_dir / "coordinator.db")

    def edited(e: Any, attestation: Any) -> Any:
        if e.type != "verification" or e.payload["outcome"] != "withheld":
            return e
        return replace(e, payload={**e.payload, "attestation": attestation(e)})

    forged = [edited(e, lambda e: {**e.payload["attestation"], "detail": "x"}) for e in entries]
    with pytest.raises(LedgerError, match="attestation is not signed"):
        Book.replay(forged)
    with pytest.raises(LedgerError, match="not a signed report"):
        Book.replay([edited(e, lambda e: None) for e in entries])


def test_one_validator_cannot_frame_an_honest_worker(make) -> None:
    """One drawn validator attests withheld; the other fetches the evidence and agrees:
    the worker loses nothing, and a slash written on that ledger would not verify."""
    coord = make(min_peers=1, new=3)
    worker = Peer(coord, "honest")
    a, b = HandValidator(coord, "a"), HandValidator(coord, "b")
    commit(coord, [worker], {worker.id: True}, {})
    ta, tb = a.claim(), b.claim()
    assert ta is not None and tb is not None
    a.report(ta, "withheld", worker_id=worker.id)
    b.report(tb, "agree", distance=0.0, exact=True)
    acc = account(coord, worker.id)
    assert not acc.banned and acc.slashed == 0 and acc.withheld == 0
    book = coord.accounts.book
    assert not book.withholding_proven(0, worker.id)


def test_a_cheat_convicted_two_rounds_late_is_slashed_and_clawed_back(make) -> None:
    """Round 0's drawn contribution is agreed on by one validator and paid two rounds
    later; then the other drawn validator's disagreement is judged fraud: the worker is
    slashed and its paid work clawed back, the agreeing validator pays for missing it, the
    rounds certified meanwhile stand, the next round commits without the cheat, and the
    ledger verifies."""
    coord = make(min_peers=1, new=3)  # new peers: always drawn, checked by two
    cheat, honest = Peer(coord, "cheat", stake=20.0), Peer(coord, "honest", stake=20.0)
    a, b = HandValidator(coord, "a"), HandValidator(coord, "b")
    starts: dict[str, Any] = {}
    commit(coord, [cheat, honest], {}, starts)
    for _ in range(2):  # a checks both round-0 contributions: agrees
        t = a.claim()
        assert t is not None and t.round == 0
        a.report(t, "agree", distance=0.0, exact=True)
    late = b.claim()
    assert late is not None and late.round == 0
    if late.peer_id == honest.id:
        b.report(late, "agree", distance=0.0, exact=True)
        late = b.claim()
    assert late is not None and late.peer_id == cheat.id and late.round == 0
    for _ in range(2):  # two more rounds certified while b still holds its check
        commit(coord, [cheat, honest], {}, starts)
    certified = coord.db.query("SELECT round, new_hash FROM rounds ORDER BY round")
    paid = [e for e in entries_of(coord, cheat.id) if e.type == "reward"]
    assert [e.payload["round"] for e in paid] == [0]  # its round-0 work was paid
    points = verify.commitment_steps(late.inner_steps, coord.cfg.trust.commit_every)
    mine = cheat.payload(999_999)  # the validator's own payload backs the last segment
    coord.blobs.put(mine)
    out = b.report(late, "disagree", segment=len(points) - 1, payload_cid=content_id(mine))
    assert out["status"] == "disputed"
    coord.verification._settle(late.task_id)
    clawed = [e for e in entries_of(coord, cheat.id) if e.type == "clawback"]
    assert [e.payload["kind"] for e in clawed] == ["work"]
    assert clawed[0].payload["amount"] == paid[0].payload["amount"] > 0
    acc = account(coord, cheat.id)  # half its stake of 20, and its pay back from the rest
    assert acc.banned and acc.slashed == pytest.approx(10.0 + paid[0].payload["amount"])
    penalties = [e for e in read_entries(coord.data_dir / "coordinator.db") if e.type == "penalty"]
    assert [p.payload["peer_id"] for p in penalties] == [a.id]  # it agreed: missed fraud
    # the certified chain stands: nothing certified is rewritten, the next round goes on
    assert coord.db.query("SELECT round, new_hash FROM rounds ORDER BY round") == certified
    coord.tick(time.time())
    k = honest.k_drawn(False, start=1000 * coord.state.round)
    assert isinstance(honest.submit(k, start_cid=starts[honest.id]), dict)
    rnd = coord.open_round()
    assert rnd is not None and cheat.id not in rnd.members  # excluded
    overdue(coord)
    coord.tick(time.time())
    assert coord.state.round == 4
    coord.stop()
    audit.verify(coord.data_dir)


@pytest.mark.parametrize(
    "name, private",
    [
        ("diloco-keep", {"optim"}),
        # the residual and its pending update; Streaming's own weights carry on
        pytest.param("diloco-reset-ef", {"optim"}, marks=pytest.mark.long),
        pytest.param("streaming", {"param", "optim"}, marks=pytest.mark.long),
    ],
)
def test_evidence_is_the_private_state_alone(name: str, private: set[str]) -> None:
    """What a worker publishes of its end state holds only what the strategy carries and a
    validator cannot recompute: DiLoCo's moments and residuals, no parameters (the certified
    start stands in for them), and re-execution from it is bit-identical to re-execution
    from the whole state. DiLoCo with its inner state reset and no error feedback carries
    nothing, so publishes nothing."""
    from tests.test_reexecutable import CONFIGS, batches, make, two_rounds

    tokens = torch.randint(0, 256, (4096,))
    cfg = CONFIGS[name]
    state, end0, _, _, _ = two_rounds(cfg, tokens)
    v = make(cfg)
    published = evidence_of(v, end0)
    assert {k.split("/", 1)[0] for k in published} == private
    if name == "diloco-reset-ef":  # its moments are reset: only the residual travels
        assert all(k.startswith("optim/ef/") for k in published), sorted(published)
    whole = verify.local_state_nbytes(end0)
    small = len(verify.local_state_to_bytes(published))
    assert small == verify.local_state_nbytes(v.evidence_layout())
    if "param" not in private:
        params = sum(
            t.numel() * t.element_size() for k, t in end0.items() if k.startswith("param/")
        )
        assert small <= whole - params + 4096  # the parameters do not travel
    runs = []
    for prev in (end0, verify.local_state_from_bytes(verify.local_state_to_bytes(published),
                                                     v.evidence_layout())):  # fmt: skip
        runs.append(
            verify.reexecute(make(cfg), state, batches(tokens, 1), 4, 2, previous_end=dict(prev))
        )
    assert runs[0].payload == runs[1].payload
    assert [c.hash for c in runs[0].commitments] == [c.hash for c in runs[1].commitments]
    assert runs[0].end == runs[1].end
    stateless = make(CONFIGS["diloco-keep"].model_copy(update={"inner_state": "reset"}))
    assert not stateless.carries_local_state  # nothing is published, nothing travels
