"""What a validator receives for a check, counted in bytes over real HTTP, and how a worker
paces its evidence (docs/trust.md, "Verification off the critical path").

A worker's DiLoCo rounds (AdamW kept between rounds, int4 with error feedback) are trained
for real; its published end states are served by covey's own blob server on 127.0.0.1,
which counts the body bytes it sends; `covey validator`'s own evidence fetch, re-execution
and end-state check run against it. The round's certified start is the one the validator
holds (fetched once a round from the coordinator, kept by content id): the worker's server
sends only the end state of its previous round (its private state: moments and residual).
The end state of the checked round is recomputed and tied to the content id the worker
named; it travels only when the recomputation is not bit-identical (here, a forged one).
"""

from __future__ import annotations

import dataclasses
import random
import threading
from pathlib import Path

import pytest
import torch

from covey.blobs import BlobClient, BlobServer, BlobStore
from covey.blobs.pacing import PIECE_BYTES, Pacer, TokenBucket
from covey.config.specs import RunConfig
from covey.peer.validator import Undelivered, Validator, ValidatorOptions, _claimed
from covey.protocol import schemas
from covey.protocol.content import content_id
from covey.trust import verify
from covey.trust.evidence import evidence_of
from covey.trust.sketch import start_digest
from tests.test_reexecutable import CONFIGS, TOL, K, batches, make, numel, two_rounds


@pytest.fixture(scope="module")
def rounds():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4096,))
    cfg = CONFIGS["diloco-ef"]  # inner_state "keep" with error feedback: the default's state
    state, end0, commitments, c1, end1 = two_rounds(cfg, tokens)
    return cfg, tokens, state, end0, commitments, c1, end1


def published(cfg, end: dict[str, torch.Tensor]) -> bytes:
    """A local state's bytes as a worker publishes them (`evidence_of`)."""
    return verify.local_state_to_bytes(evidence_of(make(cfg), end))


def validator(cfg, tokens: torch.Tensor) -> Validator:
    """`covey validator` with the run's config and strategy, checking by hand (no
    coordinator session: the task and the start state are handed to it)."""
    v = Validator(ValidatorOptions(coordinator="http://127.0.0.1:9"))
    base = RunConfig()
    v.cfg = base.model_copy(update={"trust": base.trust.model_copy(update={"commit_every": K})})
    v.blobs = BlobClient(timeout_s=5.0, retries=1)
    v.strategy = make(cfg)
    v._batch_fn = lambda task: batches(tokens, 1)  # type: ignore[method-assign]
    return v


def task_for(c1, commitments, start_cid: str, start_size: int, end: bytes, url: str):
    # commitment 0 as a networked worker names its start: by the task's start hash and
    # the content id of the local state it started from (covey.trust.sketch.start_digest)
    first = dataclasses.replace(commitments[0], hash=start_digest("h" * 64, start_cid, True))
    commitments = [first, *commitments[1:]]
    return schemas.VerifyTask(
        task_id=1, round=1, peer_id="p" * 16, cid=content_id(c1.payload), size=len(c1.payload),
        tokens=c1.tokens, inner_steps=c1.inner_steps, fragment=c1.fragment, data_key="peer-0",
        start_cid="s" * 64, start_hash="h" * 64, start_size=1,
        commitments=[c.to_dict() for c in commitments], providers=[url],
        local_state_cid=start_cid, local_state_size=start_size,
        end_state_cid=content_id(end), end_state_size=len(end),
    )  # fmt: skip


def check(v: Validator, task, state, c1, tmp_path: Path) -> verify.Verdict:
    """The validator's check of `task` as `Validator.check` runs it, but for the report."""
    store = BlobStore(tmp_path / "scratch")
    local = v._local_states(task, task.providers, store)
    spill = tmp_path / "spill"
    spill.mkdir(exist_ok=True)
    mine, _ = v._reexecute(task, state, local, spill)
    claimed_end = v._claimed_end(task, mine, state)
    return verify.compare(
        _claimed(task.commitments),
        c1.payload, mine, v.strategy.codec, numel(v.strategy, state), TOL, claimed_end,
    )  # fmt: skip


def serve(tmp_path: Path, blobs: list[bytes]) -> BlobServer:
    store = BlobStore(tmp_path / "worker")
    for data in blobs:
        store.put(data)
    return BlobServer(store)


def test_a_check_receives_only_the_private_start_state(rounds, tmp_path: Path) -> None:
    """An honest contribution: the worker's server sends the end state of its previous
    round, once, and nothing of the end state it named (recomputed, tied by content id);
    the check agrees bit for bit. Before, both states travelled: twice the bytes."""
    cfg, tokens, state, end0, commitments, c1, end1 = rounds
    start, end = published(cfg, end0), published(cfg, end1)
    assert verify.local_state_cid(evidence_of(make(cfg), end1)) == content_id(end)
    with serve(tmp_path, [start, end]) as server:
        task = task_for(c1, commitments, content_id(start), len(start), end, server.url)
        verdict = check(validator(cfg, tokens), task, state, c1, tmp_path)
        received = dict(server.served)
    assert verdict.agree and verdict.exact, verdict
    assert received == {content_id(start): len(start)}  # the end state never travelled
    whole = verify.local_state_nbytes(end1)  # weights + moments + residual
    params = sum(t.numel() * t.element_size() for k, t in end1.items() if k.startswith("param/"))
    assert len(start) <= whole - params + 4096  # the private state alone: no weights
    print(
        f"\nevidence a validator receives per check: {len(start)} bytes "
        f"(before: {len(start) + len(end)}; a whole local state is {whole})"
    )


def test_an_end_state_that_is_not_the_recomputation_travels_and_is_caught(
    rounds, tmp_path: Path
) -> None:
    """A worker names a forged end state (its moments scaled: the next round would start
    from them). Its content id is not the recomputation's, so the validator fetches it
    from the worker and compares it within the tolerance: a disagreement in the last
    segment. The bytes received are then both states, as before."""
    cfg, tokens, state, end0, commitments, c1, end1 = rounds
    forged_state = {k: (t * 1.5 if k.startswith("optim/") else t) for k, t in end1.items()}
    start, forged = published(cfg, end0), published(cfg, forged_state)
    with serve(tmp_path, [start, forged]) as server:
        task = task_for(c1, commitments, content_id(start), len(start), forged, server.url)
        verdict = check(validator(cfg, tokens), task, state, c1, tmp_path)
        received = dict(server.served)
    assert not verdict.agree and verdict.segment == len(commitments) - 1, verdict
    assert received == {content_id(start): len(start), content_id(forged): len(forged)}


def test_a_named_end_state_not_delivered_when_it_must_travel_is_withheld(
    rounds, tmp_path: Path
) -> None:
    """A forged end state its worker does not serve: Undelivered (the validator attests
    withholding) once the evidence deadline passes."""
    cfg, tokens, state, end0, commitments, c1, end1 = rounds
    forged_state = {k: (t * 1.5 if k.startswith("optim/") else t) for k, t in end1.items()}
    start, forged = published(cfg, end0), published(cfg, forged_state)
    v = validator(cfg, tokens)
    limits = v.cfg.limits.model_copy(update={"request_timeout_s": 1.0})
    v.cfg = v.cfg.model_copy(update={"limits": limits})
    with serve(tmp_path, [start]) as server:
        task = task_for(c1, commitments, content_id(start), len(start), forged, server.url)
        with pytest.raises(Undelivered, match="not delivered"):
            check(v, task, state, c1, tmp_path)


def test_the_token_bucket_never_lets_more_than_burst_plus_rate_go() -> None:
    """Reservations from several senders at random times and sizes: the bytes whose wait
    has ended by any time t are at most burst + rate x (t - t0)."""
    rng = random.Random(7)
    for _ in range(50):
        rate, burst = rng.uniform(1e3, 1e6), rng.uniform(1e3, 1e5)
        bucket, now, sends = TokenBucket(rate, burst), 0.0, []
        for _ in range(200):
            now += rng.expovariate(1.0) * rng.choice((0.0, 0.001, 0.1))
            n = rng.randint(1, int(3 * burst))
            sends.append((now + bucket.reserve(n, now), n))
        sent = 0
        for at, n in sorted(sends):
            sent += n
            assert sent <= burst + rate * at + 1e-6 * sent, (rate, burst, at, sent)
    idle = TokenBucket(100.0, 50.0)
    assert idle.reserve(50, 0.0) == 0.0 and idle.reserve(100, 0.0) == pytest.approx(1.0)
    assert idle.reserve(0, 100.0) == 0.0  # refilled, but never past the burst
    assert idle.reserve(60, 100.0) == pytest.approx(0.1)


def test_a_paced_transfer_over_http_completes_at_the_cap_and_payloads_go_unpaced(
    tmp_path: Path,
) -> None:
    """covey's blob server paces the blobs it is told are evidence through its pacer (here
    on a clock that its sleeps advance, so nothing waits in real time): a real fetch of
    one completes with its content id checked, and took the pacer's clock at least
    (size - burst) / rate; a payload from the same server goes without asking the pacer."""
    clock = [0.0]
    lock = threading.Lock()

    def sleep(d: float) -> None:
        with lock:
            clock[0] += d

    rate = 1e6
    pacer = Pacer(rate, clock=lambda: clock[0], sleep=sleep)
    evidence, payload = random.Random(1).randbytes(3 << 20), b"payload" * 1000
    store = BlobStore(tmp_path / "worker")
    evidence_cid, payload_cid = store.put(evidence), store.put(payload)
    with BlobServer(store, pacer=pacer, paced={evidence_cid}.__contains__) as server:
        client = BlobClient(timeout_s=10.0, retries=1)
        assert client.fetch(payload_cid, [server.url], size=len(payload)) == payload
        assert clock[0] == 0.0  # the payload never asked the pacer
        assert client.fetch(evidence_cid, [server.url], size=len(evidence)) == evidence
        served = dict(server.served)
    assert served == {payload_cid: len(payload), evidence_cid: len(evidence)}
    least = (len(evidence) - pacer.burst) / rate
    assert least - 1e-6 <= clock[0] <= len(evidence) / rate + 1e-6, (clock[0], least)
    assert pacer.burst >= PIECE_BYTES


def test_a_stopping_validator_attests_nothing(tmp_path: Path) -> None:
    """A validator stopped while a worker's provider does not answer leaves the check
    (Stopping), never attesting withholding it did not wait out."""
    from covey.peer.validator import Stopping

    v = Validator(ValidatorOptions(coordinator="http://127.0.0.1:9"))
    v.blobs = BlobClient(timeout_s=2.0, retries=1)
    v.stop.set()
    store = BlobStore(tmp_path / "empty")
    with BlobServer(store) as server, pytest.raises(Stopping):
        v._fetch_evidence(store, "ab" * 32, [server.url], 100, float("inf"))
