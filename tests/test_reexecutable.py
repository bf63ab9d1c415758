"""Every default configuration is re-executable: DiLoCo with inner_state
"keep", DiLoCo with error feedback, Streaming DiLoCo and DeMo. A worker's round starts from
W_r and its committed end state of the previous round (`Strategy.begin_round`); a validator
re-executing from those committed inputs gets the worker's payload bit for bit (one
process, one thread count), and a start state not chained to the previous round, a wrong
payload or a forged end state are all detected. One process, tiny GPT."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from covey.algorithms import DiLoCo, Strategy, build_strategy
from covey.algorithms.state import TrainState
from covey.config import DDPConfig, DeMoConfig, DiLoCoConfig, InnerOptim, StreamingDiLoCoConfig
from covey.data.batches import sample_batch
from covey.models.gpt import lm_loss
from covey.trust.committer import Committer
from covey.trust.evidence import evidence_commitment, evidence_of
from covey.trust.verify import (
    BatchFn,
    compare,
    local_state_from_bytes,
    local_state_to_bytes,
    reexecute,
)
from tests.conftest import tiny_gpt

TOL = 0.02
K = 2  # commit every 2 inner steps
ADAMW = InnerOptim(name="adamw", lr=3e-3, grad_clip=1.0)
CONFIGS = {
    "diloco-keep": DiLoCoConfig(inner_steps=4, optim=ADAMW, codec="int4"),
    "diloco-ef": DiLoCoConfig(inner_steps=4, optim=ADAMW, codec="int4", error_feedback=True),
    "diloco-reset-ef": DiLoCoConfig(
        inner_steps=4, optim=ADAMW, codec="int4", error_feedback=True, inner_state="reset"
    ),
    "streaming": StreamingDiLoCoConfig(inner_steps=4, fragments=2, optim=ADAMW),
    "demo": DeMoConfig(topk=8, lr=1e-3),
}


def make(cfg: object) -> Strategy:
    return build_strategy(cfg, tiny_gpt(), lm_loss)  # type: ignore[arg-type]


def batches(tokens: torch.Tensor, r: int, key: str = "peer-0") -> BatchFn:
    return lambda s: sample_batch(
        tokens, batch_size=4, seq_len=16, seed=5, round=r, worker=key, step=s
    )


def numel(s: Strategy, state: TrainState) -> int:
    names = s.fragment_names(s.round_fragment(state.round))
    return sum(state.params[n].numel() for n in names)


def train(s: Strategy, start: TrainState, batch_fn: BatchFn):
    """One round as covey/peer/worker.py trains it (the strategy already at the round's
    start): commitments every K steps, the contribution, the end local state."""
    committer = Committer(s, start, K)
    for step in range(s.steps_per_round):
        s.inner_step(batch_fn(step))
        committer.after_step(step + 1)
    return committer.commitments, s.make_contribution(), s.local_state()


def two_rounds(cfg: object, tokens: torch.Tensor, accepted: bool = True):
    """A worker's rounds 0 and 1, driven live (adopt after each certificate, as a worker
    does), beside an honest peer whose contribution is always accepted. `accepted`: whether
    round 0 accepted the worker's own contribution. -> (round-1 start state, the worker's
    end state of round 0, its round-1 commitments, contribution and end state)."""
    w, other = make(cfg), make(cfg)
    state = w.init_state()
    for s in (w, other):
        s.begin_round(state)  # no previous round: the deterministic init
    _, mine, end0 = train(w, state, batches(tokens, 0))
    _, theirs, _ = train(other, state, batches(tokens, 0, "peer-1"))
    state = w.apply_round(state, [mine, theirs] if accepted else [theirs])
    # Streaming merges before inner step tau, as the simulator and an overlapping worker do
    getattr(w, "merge_late", w.adopt)(state, accepted=accepted)
    commitments, c1, end1 = train(w, state, batches(tokens, 1))
    return state, end0, commitments, c1, end1


def validate(cfg, start, previous_end, previous_accepted, commitments, c, claimed_end, tokens):
    """A validator's check from committed inputs: the previous end state travels as
    safetensors bytes of what is published of it (`evidence_of`: no parameters when the
    strategy does not carry them) and is parsed against the validator's own template."""
    v = make(cfg)
    prev = None
    if previous_end is not None:
        data = local_state_to_bytes(evidence_of(v, previous_end))
        prev = local_state_from_bytes(data, v.evidence_layout())
    steps = c.inner_steps
    mine = reexecute(
        v,
        start,
        batches(tokens, 1),
        steps,
        K,
        previous_end=prev,
        previous_accepted=previous_accepted,
    )
    end = evidence_commitment(v, claimed_end, start, steps)
    return compare(commitments, c.payload, mine, v.codec, numel(v, start), TOL, end), mine


@pytest.mark.parametrize("name", CONFIGS)
def test_reexecution_from_committed_state_is_bit_identical(name, tokens) -> None:
    cfg = CONFIGS[name]
    assert make(cfg).reexecutable and make(cfg).carries_local_state
    start, end0, commitments, c, end1 = two_rounds(cfg, tokens)
    verdict, mine = validate(cfg, start, end0, True, commitments, c, end1, tokens)
    assert verdict.agree and verdict.exact, verdict.detail
    assert mine.payload == c.payload
    # the start really depends on the committed state: a fresh start is another round
    fresh, _ = validate(cfg, start, None, True, commitments, c, end1, tokens)
    assert not fresh.agree and "commitment 0" in fresh.detail


@pytest.mark.parametrize("name", ["diloco-ef", "demo"])
def test_a_rejected_round_restores_error_feedback_and_the_chain_says_so(name, tokens) -> None:
    cfg = CONFIGS[name]
    start, end0, commitments, c, end1 = two_rounds(cfg, tokens, accepted=False)
    verdict, _ = validate(cfg, start, end0, False, commitments, c, end1, tokens)
    assert verdict.exact, verdict.detail
    # the certificate's flag is part of the committed inputs: claiming "accepted" is caught
    lie, _ = validate(cfg, start, end0, True, commitments, c, end1, tokens)
    assert not lie.agree and lie.segment == 0


@pytest.mark.parametrize("name", CONFIGS)
def test_fabricated_start_state_is_detected(name, tokens) -> None:
    """The worker trains round 1 from a local state of its choosing (moments and residuals
    scaled up, local weights moved) instead of the one its round-0 end state chains to."""
    cfg = CONFIGS[name]
    w = make(cfg)
    start, end0, *_ = two_rounds(cfg, tokens)
    forged = {k: v * 1.5 if v.is_floating_point() else v for k, v in end0.items()}
    w.begin_round(start, forged, True)
    commitments, c, end1 = train(w, start, batches(tokens, 1))
    verdict, _ = validate(cfg, start, end0, True, commitments, c, end1, tokens)
    assert not verdict.agree and verdict.segment == 0, verdict.detail
    assert "commitment 0" in verdict.detail


@pytest.mark.parametrize("name", CONFIGS)
def test_wrong_payload_is_detected(name, tokens) -> None:
    cfg = CONFIGS[name]
    start, end0, commitments, c, end1 = two_rounds(cfg, tokens)
    v = make(cfg)
    noise = torch.randn(numel(v, start), generator=torch.Generator().manual_seed(1))
    wrong = dataclasses.replace(c, payload=v.codec.encode(noise * 10))
    verdict, _ = validate(cfg, start, end0, True, commitments, wrong, end1, tokens)
    assert not verdict.agree and verdict.distance > TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_forged_end_state_is_detected(name, tokens) -> None:
    """An honest payload with a made-up end state (the next round's start derives from it)."""
    cfg = CONFIGS[name]
    start, end0, commitments, c, end1 = two_rounds(cfg, tokens)
    forged = {k: v * 0.5 if v.is_floating_point() else v for k, v in end1.items()}
    verdict, _ = validate(cfg, start, end0, True, commitments, c, forged, tokens)
    assert not verdict.agree, verdict.detail
    assert verdict.segment == len(commitments) - 1  # the last segment ends at the end state


def test_stateless_configs_start_fresh_and_need_no_committed_state(tokens) -> None:
    for cfg in (DDPConfig(), DiLoCoConfig(inner_steps=2, inner_state="reset")):
        s = make(cfg)
        assert s.reexecutable and not s.carries_local_state
    s = make(DiLoCoConfig(inner_steps=2, inner_state="reset"))
    assert isinstance(s, DiLoCo)
    state = s.init_state()
    s.begin_round(state)
    fresh = s.local_state()
    s.inner_step(batches(tokens, 0)(0))
    s.begin_round(state, s.local_state(), True)  # ignored: nothing carries over
    assert all(torch.equal(fresh[k], v) for k, v in s.local_state().items())


def test_begin_round_refuses_a_malformed_previous_state(tokens) -> None:
    s = make(CONFIGS["diloco-ef"])
    state = s.init_state()
    end = s.local_state()
    bad = {k: v for k, v in end.items() if k != "optim/ef/residual"}
    with pytest.raises(ValueError, match="lacks 'optim/ef/residual'"):
        s.begin_round(state, bad, True)
    nan = {**end, "optim/ef/pending": torch.full_like(end["optim/ef/pending"], float("nan"))}
    with pytest.raises(ValueError, match="NaN"):
        s.begin_round(state, nan, True)


def test_streaming_with_error_feedback_is_refused_at_config_load() -> None:
    with pytest.raises(ValueError, match="error_feedback is not supported by Streaming"):
        StreamingDiLoCoConfig(inner_steps=4, fragments=2, error_feedback=True)


# -- over the network: a real coordinator, 4 workers (2 of them cheating) and a validator ------

NETWORK_SPEC = """
name = "reexecutable"
seed = 4
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 6
codec = "int4"
error_feedback = true
[rounds]
deadline_min_s = 8
eval_batches = 1
min_peers = 3  # two cheaters are excluded along the way; w0, w1 and unchained go on
[trust]
min_stake = 10.0
commit_every = 3
"""
CHEATS = ("forged-state", "unchained", "withhold")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """DiLoCo's defaults (inner_state "keep") with error feedback: honest w0 and w1, a
    worker that trains from a forged local state while naming its committed one, one that
    names its forged state, one that never serves its end state, and a validator."""
    from covey.local.cluster import LocalCluster

    tmp = tmp_path_factory.mktemp("reexecutable")
    spec = tmp / "run.toml"
    spec.write_text(NETWORK_SPEC)
    c = LocalCluster(spec, tmp)
    try:
        c.start_coordinator()
        for name in ("w0", "w1", *CHEATS):
            behavior = name if name in CHEATS else "honest"
            c.start_worker(name, "--stake", "100", "--behavior", behavior)
        c.start_validator("v0")
        yield c
    finally:
        c.stop()


def ledger(cluster) -> list:
    from covey.io import audit

    found, _, _ = audit.load(cluster.url)
    return found


def chained(cluster) -> set[tuple[int, str]]:
    """(round, peer) of the contributions whose start is a committed local state."""
    import sqlite3

    db = cluster.data_dir / "coordinator.db"
    if not db.exists():
        return set()
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        query = "SELECT round, peer_id FROM local_states WHERE start_cid IS NOT NULL"
        return set(conn.execute(query))


def wait(cluster, done, what: str) -> None:
    from covey.local.cluster import ClusterError

    try:
        cluster.wait_for(lambda _: done(), 240, what)
    except ClusterError as e:
        names = ("coordinator", "w0", "w1", *CHEATS, "v0")
        raise AssertionError(f"{e}\n" + "\n".join(cluster.tail(n, 20) for n in names)) from None


@pytest.mark.network
@pytest.mark.long  # a 6-peer cluster, ~2 min; test_offpath.py covers this by default
def test_validator_reexecutes_diloco_keep_with_error_feedback(cluster) -> None:
    """Every honest contribution after a worker's first starts from its committed end state
    of the round before; the validator's re-executions of those agree bit for bit (same
    thread count), and no honest contribution is refused."""
    honest = {cluster.ids["w0"], cluster.ids["w1"]}

    def checks() -> list[dict]:
        links = chained(cluster)
        return [
            e.payload
            for e in ledger(cluster)
            if e.type == "verification"
            and e.payload["outcome"] != "expired"  # nobody got to it in time: no outcome
            and e.payload["peer_id"] in honest
            and (e.payload["round"], e.payload["peer_id"]) in links
        ]

    wait(cluster, lambda: len(checks()) >= 2, "2 checks of honest chained contributions")
    assert all(c["outcome"] == "agree" and c["exact"] for c in checks()), checks()
    refused = [
        e.payload
        for e in ledger(cluster)
        if e.type == "contribution rejected" and e.payload["peer_id"] in honest
    ]
    assert not refused, refused
    assert "validators will not be given work" not in cluster.tail("coordinator", 1000)


@pytest.mark.network
@pytest.mark.long  # a 6-peer cluster, ~2 min; test_offpath.py covers this by default
def test_a_local_state_not_chained_is_refused_or_caught(cluster) -> None:
    """Naming a made-up start state is refused at intake by content id; training from one
    while naming the committed state disagrees with the validator at commitment 0."""
    unchained, forged = cluster.ids["unchained"], cluster.ids["forged-state"]

    def refusals() -> list[str]:
        return [
            e.payload["reason"]
            for e in ledger(cluster)
            if e.type == "contribution rejected" and e.payload["peer_id"] == unchained
        ]

    def caught() -> list[dict]:
        return [
            e.payload
            for e in ledger(cluster)
            if e.type == "verification"
            and e.payload["peer_id"] == forged
            and e.payload["outcome"] == "disagree"
        ]

    def convicted() -> bool:  # the referee, too, recomputes from the committed state
        return any(
            e.type == "dispute"
            and e.payload["peer_id"] == forged
            and e.payload["outcome"] == "fraud"
            for e in ledger(cluster)
        )

    wait(cluster, lambda: refusals() and caught(), "both state cheats to be refused or caught")
    assert any("starts from local state" in r for r in refusals()), refusals()
    links = chained(cluster)
    assert all((c["round"], forged) in links for c in caught())  # only chained rounds lie
    wait(cluster, convicted, "the forged state's dispute to end in fraud")


@pytest.mark.network
@pytest.mark.long  # a 6-peer cluster, ~2 min; test_offpath.py covers this by default
def test_only_drawn_contributions_move_their_local_states(cluster) -> None:
    """No contribution's local states (3x the model each) cross the coordinator's link,
    drawn or not: a drawn honest contribution's end state stays with its worker, and the
    validator's check of it, fetched from the worker, completes. A worker that never
    serves its end state is accepted (rounds never wait for evidence), and its drawn
    validator attests, signed, that it did not deliver: the only eligible validator's
    attestation proves it, so it is slashed, excluded and counted as withholding, and
    the ledger replays it."""
    import sqlite3

    import httpx

    from covey.trust.incentives import Book

    honest = {cluster.ids["w0"], cluster.ids["w1"]}
    withholder = cluster.ids["withhold"]

    def on_coordinator(cid: str) -> bool:
        return httpx.head(f"{cluster.url}/v1/blobs/{cid}", timeout=10).status_code == 200

    def checked(sampled: bool) -> list[str]:
        """End states of honest accepted contributions, drawn or not, that a validator
        reported on (agreed) when `sampled`."""
        entries = ledger(cluster)
        accepted = {
            (e.payload["round"], e.payload["peer_id"]): e.payload["sampled"]
            for e in entries
            if e.type == "contribution accepted" and e.payload["peer_id"] in honest
        }
        agreed = {
            (e.payload["round"], e.payload["peer_id"])
            for e in entries
            if e.type == "verification" and e.payload["outcome"] == "agree"
        }
        db = cluster.data_dir / "coordinator.db"
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            ends = {(r, p): cid for r, p, cid in conn.execute(
                "SELECT round, peer_id, end_cid FROM local_states"
            )}  # fmt: skip
        return [
            ends[key]
            for key, drawn in accepted.items()
            if drawn == sampled and key in ends and (key in agreed or not sampled)
        ]

    def slashed() -> list[dict]:
        return [
            e.payload
            for e in ledger(cluster)
            if e.type == "slash" and e.payload["peer_id"] == withholder
        ]

    wait(cluster, lambda: checked(sampled=False), "an undrawn honest contribution")
    wait(cluster, lambda: checked(sampled=True), "a drawn honest contribution, checked")
    assert not any(on_coordinator(cid) for cid in checked(sampled=False) + checked(True))
    wait(cluster, lambda: len(slashed()) >= 1, "the withholder slashed on attestations")
    # each drawn contribution it withheld is its own offence (rounds 0-2 are all drawn)
    assert all(s.get("withheld") is True for s in slashed()), slashed()
    entries = ledger(cluster)
    attested = [
        e.payload
        for e in entries
        if e.type == "verification"
        and e.payload["peer_id"] == withholder
        and e.payload["outcome"] == "withheld"
    ]
    assert attested and attested[0]["attestation"]["worker_id"] == withholder
    account = Book.replay(entries).accounts[withholder]
    slashes = [e for e in entries if e.type == "slash" and e.payload["peer_id"] == withholder]
    assert account.withheld == len(slashes) >= 1 and account.banned, account
    assert account.slashed > 0.0, account
