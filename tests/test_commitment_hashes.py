"""Where a commitment is a hash (covey/trust/sketch.py): at step 0, the round's start, and at
its end (the end state's content id); an intermediate commitment is its sketches alone, and
what crosses from the training device to the host for one is no more than those sums. Old
claims, with a hash at every step, still read and compare; a hash a claim adds gains it
nothing, and one it leaves out where it must be one is refused."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from covey.algorithms import TrainState, build_strategy
from covey.bench.hostsync import HostBytes, method_config, time_commitment
from covey.coordinator.rejected import Rejected
from covey.models.gpt import GPT, gpt_config, lm_loss
from covey.peer import overlap
from covey.peer.overlap import SideCommitter
from covey.protocol import schemas
from covey.trust.committer import Committer
from covey.trust.evidence import evidence_of, local_state_cid
from covey.trust.sketch import (
    NO_HASH,
    Commitment,
    commitment_distance,
    commitment_of,
    start_digest,
    state_hash,
)
from covey.trust.verify import compare, reexecute

META = torch.device("meta")
K, STEPS = 2, 7
POOL = torch.randint(0, 256, (8, 2, 17), generator=torch.Generator().manual_seed(0))


def batch(i: int) -> torch.Tensor:
    return POOL[i % len(POOL)]


def nano() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("nano"))


def strategy() -> Any:
    return build_strategy(method_config("diloco"), nano(), lm_loss)


def start_of(s: Any, model: GPT) -> TrainState:
    host = dict(model.named_parameters(remove_duplicate=False))
    return TrainState({n: host[n].detach().clone() for n in s.names})


def on_meta() -> tuple[Any, TrainState]:
    """A DiLoCo strategy training on the meta device (as the host sees a GPU: no values
    without a copy `HostBytes` sees) and its start state."""
    model = nano()
    s = build_strategy(method_config("diloco"), copy.deepcopy(model).to(META), lm_loss)
    return s, start_of(s, model)


def size(start: TrainState) -> int:
    return sum(t.numel() for t in start.params.values())


def own_bytes(c: Commitment) -> int:
    """A commitment's own bytes on the host: its sketches' float64 sums."""
    return 8 * (len(c.sketch["params"]) + len(c.sketch["optim"]))


def honest_round() -> tuple[Any, TrainState, list[Commitment], bytes]:
    s = strategy()
    start = s.init_state()
    s.begin_round(start)
    committer = Committer(s, start, K)
    for step in range(STEPS):
        s.inner_step(batch(step))
        committer.after_step(step + 1)
    return s, start, committer.commitments, s.make_contribution().payload


# -- the wire format ------------------------------------------------------------------------


def test_only_the_start_of_a_round_is_hashed_among_its_commitments() -> None:
    s = strategy()
    start = s.init_state()
    s.begin_round(start)
    at_start = state_hash(s.local_state())
    committer = Committer(s, start, K)
    for step in range(STEPS):
        s.inner_step(batch(step))
        committer.after_step(step + 1)
    claim = committer.commitments
    assert [c.step for c in claim] == [0, 2, 4, 6]
    assert claim[0].hash == at_start
    assert all(c.hash == NO_HASH for c in claim[1:])
    assert all(c.to_dict()["hash"] == "" for c in claim[1:])  # on the wire: ""
    assert [Commitment.from_dict(c.to_dict()) for c in claim] == claim


def test_the_end_states_hash_is_its_content_id_computed_once() -> None:
    s, start, claim, payload = honest_round()
    mine = reexecute(strategy(), start, batch, STEPS, K)
    assert mine.end is not None and mine.end.step == STEPS
    assert mine.end.hash == mine.end_cid == local_state_cid(evidence_of(s, s.local_state()))
    assert compare(claim, payload, mine, s.codec, size(start), 0.1, mine.end).exact


def test_from_dict_refuses_a_start_without_hash_and_reads_old_claims() -> None:
    _, _, claim, _ = honest_round()
    start, later = claim[0].to_dict(), claim[1].to_dict()
    with pytest.raises(ValueError, match=r"commitment 0 .* has no hash"):
        Commitment.from_dict({**start, "hash": ""})
    for bad in ("x" * 64, "A" * 64, "0" * 63, None, 7):
        with pytest.raises(ValueError, match="hash"):
            Commitment.from_dict({**later, "hash": bad})
    with pytest.raises(ValueError, match="keys"):
        Commitment.from_dict({k: v for k, v in later.items() if k != "hash"})
    # an older worker's commitment, with its state's hash at every step, still reads
    assert Commitment.from_dict({**later, "hash": "ab" * 32}).hash == "ab" * 32


def test_the_request_schema_refuses_a_start_without_hash() -> None:
    sketch = {"params": [0.5] * 4, "optim": []}
    ok = schemas.CommitmentIn.model_validate({"step": 3, "hash": "", "sketch": sketch})
    assert ok.hash == ""
    schemas.CommitmentIn.model_validate({"step": 3, "hash": "ab" * 32, "sketch": sketch})
    for step, digest in ((0, ""), (3, "zz" * 32), (3, "ab" * 31)):
        with pytest.raises(pydantic.ValidationError):
            schemas.CommitmentIn.model_validate({"step": step, "hash": digest, "sketch": sketch})


# -- what an attacker can do with hashes --------------------------------------------------


def test_old_claims_with_every_hash_still_compare() -> None:
    """A claim made before intermediate commitments dropped their hashes: the same
    sketches, a hash at every step. It agrees, exactly, with today's re-execution."""
    s, start, claim, payload = honest_round()
    mine = reexecute(strategy(), start, batch, STEPS, K)
    old = [claim[0], *(dataclasses.replace(c, hash=f"{c.step:064x}") for c in claim[1:])]
    verdict = compare(old, payload, mine, s.codec, size(start), 0.1, mine.end)
    assert verdict.agree and verdict.exact, verdict.detail


def test_a_hash_added_to_a_lying_commitment_gains_nothing() -> None:
    """A worker lies about commitment 2's sketch and adds hashes: the validator has no
    intermediate hash to match, so the lie is found at the same segment as without."""
    s, start, claim, payload = honest_round()
    mine = reexecute(strategy(), start, batch, STEPS, K)
    lying = list(claim)
    lying[2] = dataclasses.replace(
        claim[2], sketch={**claim[2].sketch, "params": tuple(-v for v in claim[2].sketch["params"])}
    )
    bare = compare(lying, payload, mine, s.codec, size(start), 0.1, mine.end)
    assert not bare.agree and bare.segment == 1
    for digest in ("ab" * 32, NO_HASH):
        with_hashes = [claim[0], *(dataclasses.replace(c, hash=digest) for c in lying[1:])]
        v = compare(with_hashes, payload, mine, s.codec, size(start), 0.1, mine.end)
        assert (v.agree, v.segment, v.distances) == (False, 1, bare.distances)
    # two commitments without hashes are never equal by hash: only their sketches speak
    assert commitment_distance(lying[2], mine.commitments[2]) > 1.0


def test_an_end_state_with_another_hash_is_not_exact() -> None:
    """Exactness rests on the end state's hash: the same sketches with another content id
    agree within the tolerance, not bit for bit."""
    s, start, claim, payload = honest_round()
    mine = reexecute(strategy(), start, batch, STEPS, K)
    assert mine.end is not None
    other_end = dataclasses.replace(mine.end, hash="cd" * 32)
    verdict = compare(claim, payload, mine, s.codec, size(start), 0.1, other_end)
    assert verdict.agree and not verdict.exact


def test_a_contribution_that_leaves_out_its_end_state_is_refused(tmp_path: Path) -> None:
    """The end of a round that carries local state is bound by its content id: a worker
    that names none is refused at intake (422), and nothing is recorded."""
    from covey.config import load_run_config
    from covey.coordinator.service import Coordinator
    from tests.test_evidence import SPEC, Peer

    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(min_peers=1, new=0))
    coord = Coordinator(load_run_config(spec), tmp_path / "data")
    try:
        peer = Peer(coord, "no-end")
        coord.tick(time.time())
        out = peer.submit(0, end_state_cid=None, end_state_size=None)
        assert isinstance(out, Rejected) and out.status == 422, out
        assert "end local state" in out.message
        assert not coord.db.query("SELECT * FROM contributions")
        assert isinstance(peer.submit(0), dict)  # the same contribution, naming its end
    finally:
        coord.stop()


# -- host bytes per intermediate commitment -------------------------------------------------


def test_an_intermediate_commitment_moves_only_its_own_bytes_to_the_host() -> None:
    """The strategy trains on the meta device (as the host sees a GPU: no values without a
    copy that `HostBytes` sees). Per intermediate commitment, what crosses is its sketches'
    sums, the commitment itself; an inner step and a step between commitments, nothing."""
    s, start = on_meta()
    counter = HostBytes()
    with counter:
        s.begin_round(start)
        committer = Committer(s, start, K)
        per_step = []
        for step in range(STEPS):
            s.inner_step(batch(step))
            before = counter.nbytes
            made = committer.after_step(step + 1)
            per_step.append((made, counter.nbytes - before))
    commits = [(c, n) for c, n in per_step if c is not None]
    assert len(commits) == STEPS // K
    for c, n in commits:
        assert c.hash == NO_HASH and 0 < n <= own_bytes(c), (c.step, n, own_bytes(c))
    assert all(n == 0 for c, n in per_step if c is None)


def test_the_counter_sees_a_hashed_commitment() -> None:
    """The check above can fail: a commitment that carries the state's hash (as every
    commitment did) moves the whole state, weights and both moments, to the host."""
    s, start = on_meta()
    counter = HostBytes()
    with counter:
        s.begin_round(start)
        s.inner_step(batch(0))
        local = s.local_state(copy=False)
        before = counter.nbytes
        c = commitment_of(local, start.params, K, digest=state_hash(local))
    # what lives on the device: the weights and AdamW's moments (the error-feedback
    # residuals and the step counts are kept on the host)
    state_bytes = sum(t.numel() * t.element_size() for t in local.values() if t.is_meta)
    assert counter.nbytes - before >= state_bytes > 100 * own_bytes(c)


@pytest.fixture
def side_bytes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Commitment, int]]]:
    """Each commitment the side committer's thread makes, with the bytes it moved to the
    host (counted on that thread: a dispatch mode is per thread)."""
    seen: list[tuple[Commitment, int]] = []
    real = overlap.commitment_of

    def counted(*args: Any, **kwargs: Any) -> Commitment:
        counter = HostBytes()
        with counter:
            c = real(*args, **kwargs)
        seen.append((c, counter.nbytes))
        return c

    monkeypatch.setattr(overlap, "commitment_of", counted)
    yield seen


def test_the_side_committer_moves_only_the_commitments_bytes(
    side_bytes: list[tuple[Commitment, int]],
) -> None:
    """Off the critical path (covey/peer/overlap.py): the training thread copies on the
    device and moves nothing; the side thread moves each intermediate commitment's sums."""
    s, start = on_meta()
    counter = HostBytes()
    with counter:
        s.begin_round(start)
        committer = SideCommitter(s, start, K)
        taken = counter.nbytes
        for step in range(STEPS):
            s.inner_step(batch(step))
            committer.after_step(step + 1)
        assert counter.nbytes == taken  # the training thread: no byte to the host
    recorded = committer.recorded
    assert [c.step for c in recorded] == [0, 2, 4, 6]
    later = [(c, n) for c, n in side_bytes if c.step > 0]
    assert len(later) == 3
    for c, n in later:
        assert c.hash == NO_HASH and 0 < n <= own_bytes(c), (c.step, n)


def test_the_bench_reports_bytes_before_and_after() -> None:
    row = time_commitment(4096, repeats=1)
    assert row["host_bytes"] == row["commitment_bytes"] == 3 * 64 * 8
    assert row["before_host_bytes"] >= 3 * 4 * 4096


# -- the round's start: named, not hashed again ----------------------------------------------


def test_the_start_digest_names_what_the_round_starts_from() -> None:
    w, cid = "ab" * 32, "cd" * 32
    names = {
        start_digest(w, None, True),
        start_digest(w, cid, True),
        start_digest(w, cid, False),
        start_digest("ef" * 32, cid, True),
        start_digest(w, "01" * 32, True),
    }
    assert len(names) == 5  # every input changes it
    assert start_digest(w, None, False) == start_digest(w, None, True)  # fresh: no flag


def test_a_worker_and_its_validator_name_the_start_alike_and_move_nothing_for_it() -> None:
    """Commitment 0 from the round's names (W_r's digest, the previous end state's content
    id, the accept flag): the worker's and the validator's agree, nothing of the state
    crosses to the host for it (meta device), and other names make the claim malformed."""
    s = strategy()
    start = s.init_state()
    names = ("ab" * 32, None)
    s.begin_round(start)
    committer = Committer(s, start, K, start_digest=start_digest(*names, True))
    for step in range(STEPS):
        s.inner_step(batch(step))
        committer.after_step(step + 1)
    claim, payload = committer.commitments, s.make_contribution().payload
    assert claim[0].hash == start_digest(*names, True)
    mine = reexecute(strategy(), start, batch, STEPS, K, start_names=names)
    verdict = compare(claim, payload, mine, s.codec, size(start), 0.1, mine.end)
    assert verdict.agree and verdict.exact, verdict.detail
    other = reexecute(strategy(), start, batch, STEPS, K, start_names=("ef" * 32, None))
    verdict = compare(claim, payload, other, s.codec, size(start), 0.1, other.end)
    assert not verdict.agree and "commitment 0" in verdict.detail
    m, meta_start = on_meta()
    counter = HostBytes()
    with counter:
        m.begin_round(meta_start)
        first = Committer(m, meta_start, K, start_digest=start_digest(*names, True)).recorded[0]
    assert first.hash == start_digest(*names, True)
    assert counter.nbytes <= own_bytes(first), counter.copies
