"""Streaming DiLoCo's overlap on real workers (covey/peer/overlap.py).

A worker trains round r+1's first tau steps while round r's contribution is published and
its result fetched, and merges that result before step tau, exactly where the simulator
merges it. The unit tests check the late-apply bookkeeping against the simulator's and a
validator's re-execution bit for bit; the network test runs a coordinator, two overlapping
workers and a validator on 127.0.0.1 and replays every certified round in process with the
simulator's schedule: same contribution bytes, same weights hash."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from covey.algorithms import StreamingDiLoCo, TrainState, build_strategy
from covey.config import InnerOptim, StreamingDiLoCoConfig
from covey.data.batches import sample_batch
from covey.models.gpt import lm_loss
from covey.peer.overlap import SideCommitter, Transfer, TransferTimeout, speculation_fails
from covey.protocol import schemas
from covey.trust.committer import Committer
from covey.trust.verify import compare, local_state_from_bytes, local_state_to_bytes, reexecute
from tests.conftest import tiny_gpt

K = 2  # commit every 2 steps: commitments at 0 and 2 fall before step tau = 3
CFG = StreamingDiLoCoConfig(
    inner_steps=8, fragments=2, overlap_steps=3, optim=InnerOptim(name="adamw", lr=1e-3)
)


def make() -> StreamingDiLoCo:
    s = build_strategy(CFG, tiny_gpt(), lm_loss)
    assert isinstance(s, StreamingDiLoCo)
    return s


def batches(tokens: torch.Tensor, r: int, key: str):  # type: ignore[no-untyped-def]
    return lambda step: sample_batch(
        tokens, batch_size=4, seq_len=16, seed=5, round=r, worker=key, step=step
    )


def round0(tokens: torch.Tensor, s: StreamingDiLoCo, other: StreamingDiLoCo):  # type: ignore[no-untyped-def]
    """Round 0 for `s` and a peer, both fresh -> (round-1 start state, s's end state)."""
    state = s.init_state()
    cs = []
    for w, key in ((s, "me"), (other, "them")):
        w.begin_round(state)
        for step in range(w.steps_per_round):
            w.inner_step(batches(tokens, 0, key)(step))
        cs.append(w.make_contribution())
    return s.apply_round(state, cs), s.local_state()


def test_late_merge_on_an_overlapping_worker_equals_the_simulator_and_a_validator(
    tokens: torch.Tensor,
) -> None:
    torch.manual_seed(0)
    live, sim, peer, peer2 = make(), make(), make(), make()
    start1, end0 = round0(tokens, live, peer)
    start1_sim, _ = round0(tokens, sim, peer2)
    assert start1.digest() == start1_sim.digest()
    batch = batches(tokens, 1, "me")
    tau = CFG.overlap_steps
    # the worker: tau steps before round 1's start is known, then the late merge
    committer = SideCommitter(live, None, K)
    for step in range(tau):
        live.inner_step(batch(step))
        committer.after_step(step + 1)
    with pytest.raises(RuntimeError, match="not known yet"):
        committer.commitments  # noqa: B018
    live.merge_late(start1, accepted=True)
    committer.start(start1)
    for step in range(tau, live.steps_per_round):
        live.inner_step(batch(step))
        committer.after_step(step + 1)
    claim = committer.commitments
    c_live = live.make_contribution()
    end1 = live.local_state()
    # the simulator (covey/sim/simulator.py _train_round): adopt the pending result at tau
    for step in range(sim.steps_per_round):
        if step == tau:
            sim.adopt(start1_sim)
        sim.inner_step(batch(step))
    assert sim.make_contribution().payload == c_live.payload
    # a validator, from the committed inputs: W_1 and the round-0 end state as bytes
    v = make()
    prev = local_state_from_bytes(local_state_to_bytes(end0), v.local_state(copy=False))
    mine = reexecute(v, start1, batch, c_live.inner_steps, K, previous_end=prev)
    numel = sum(start1.params[n].numel() for n in v.fragment_names(v.round_fragment(1)))
    from covey.trust.evidence import evidence_commitment

    # the end as a worker publishes it: its hash is the end state's content id
    end = evidence_commitment(live, end1, start1, c_live.inner_steps)
    verdict = compare(claim, c_live.payload, mine, v.codec, numel, 0.0, end)
    assert verdict.agree and verdict.exact, verdict.detail
    # a merge at step 0 (the old network behavior) is another round: the check can fail
    early = make()
    early.begin_round(start1)  # fresh start, no merge: differs at commitment 0
    early.load_local_state(prev)
    early.adopt(start1)
    wrong = Committer(early, start1, K)
    for step in range(early.steps_per_round):
        early.inner_step(batch(step))
        wrong.after_step(step + 1)
    bad = compare(wrong.commitments, early.make_contribution().payload, mine, v.codec, numel,
                  0.0, end)  # fmt: skip
    assert not bad.exact


def test_side_commitments_equal_inline_ones(tokens: torch.Tensor) -> None:
    """Sketched on a side thread from copies, the commitments are Committer's, bit for bit."""
    a, b = make(), make()
    state = a.init_state()
    a.begin_round(state)
    b.begin_round(state)
    inline, side = Committer(a, state, K), SideCommitter(b, state, K)
    for step in range(a.steps_per_round):
        a.inner_step(batches(tokens, 0, "me")(step))
        b.inner_step(batches(tokens, 0, "me")(step))
        inline.after_step(step + 1)
        side.after_step(step + 1)
    assert side.commitments == inline.commitments and len(side.commitments) == 2
    assert side.recorded == inline.recorded


def test_a_merge_past_step_tau_is_refused(tokens: torch.Tensor) -> None:
    s, other = make(), make()
    start1, _ = round0(tokens, s, other)
    for step in range(CFG.overlap_steps + 1):
        s.inner_step(batches(tokens, 1, "me")(step))
    with pytest.raises(RuntimeError, match="due before inner step 3, 4 steps already taken"):
        s.merge_late(start1)


def _info(**kw: object) -> schemas.RoundInfo:
    base: dict[str, object] = dict(
        run_id="r", phase="open", round=5, start_hash="ab" * 32, member=True,
        assignment={"inner_steps": 4, "data_key": "k5"},
    )  # fmt: skip
    return schemas.RoundInfo.model_validate({**base, **kw})


@pytest.mark.parametrize(
    ("change", "chained", "why"),
    [
        ({}, True, None),
        ({}, False, "did not record"),
        ({"round": 6}, True, "round 5 is not open"),
        ({"phase": "waiting"}, True, "round 5 is not open"),
        ({"member": False}, True, "not a member"),
        ({"assignment": {"inner_steps": 4, "data_key": "other"}}, True, "data key is other"),
        ({"assignment": {"inner_steps": 3, "data_key": "k5"}}, True, "assigns 3 steps, 3 done"),
        ({"start_hash": "cd" * 32}, True, "starts from cdcd"),
    ],
)
def test_steps_trained_ahead_stand_only_on_the_predicted_round(
    change: dict[str, object], chained: bool, why: str | None
) -> None:
    got = speculation_fails(
        _info(**change), round_=5, data_key="k5", state_hash="ab" * 32, steps_ahead=3,
        chained=chained,
    )  # fmt: skip
    assert got == why if why is None else why in (got or "")


def test_a_transfer_hands_back_its_value_its_error_and_its_deadline() -> None:
    assert Transfer("ok", lambda: 7).start().result(5.0) == 7

    def boom() -> int:
        raise ValueError("upload refused")

    with pytest.raises(ValueError, match="upload refused"):
        Transfer("err", boom).start().result(5.0)
    release = threading.Event()
    slow = Transfer("slow", lambda: release.wait(30)).start()
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="unfinished after 0 s"):
        slow.result(0.3)
    stop = threading.Event()
    stop.set()  # a stopping worker does not wait out the deadline
    with pytest.raises(TransferTimeout, match="stopping"):
        slow.result(30.0, stop)
    assert time.monotonic() - t0 < 10
    release.set()
    assert slow.join(5.0)


# -- over the network ---------------------------------------------------------------------

SPEC = """
name = "test-overlap"
seed = 3
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "streaming"
inner_steps = 8
fragments = 2
overlap_steps = 3
outer_momentum = 0.5
[rounds]
min_peers = 2
target_compute_s = 30
deadline_min_s = 20
deadline_max_s = 60
eval_batches = 1
eval_every = 100
[trust]
sample_rate = 1.0
commit_every = 2
"""


def _replay(cluster, certs: list[dict]) -> None:  # type: ignore[no-untyped-def]
    """Every certified round recomputed in this process with the simulator's schedule
    (the result merged before step tau; covey/sim/simulator.py _train_round) on the peers'
    own data keys: the same contribution bytes (content ids) and weights hash."""
    from covey.algorithms import build_aggregator
    from covey.data.batches import assignment_batches
    from covey.data.corpus import load_corpus
    from covey.models.source import build_run_model
    from covey.protocol.content import content_id
    from covey.protocol.rounds import data_key

    cfg = cluster.config
    d = cfg.data
    corpus = load_corpus(list(d.paths), d.val_fraction, d.tokenizer, d.text_column)
    model, loss_fn, _, seq_len = build_run_model(
        cfg.model, cfg.seed, tokenizer_vocab=corpus.vocab_size, seq_len=d.seq_len
    )
    agg = build_aggregator(cfg.trust.aggregation, cfg.trust.trim_fraction, cfg.trust.clip_factor)
    state = TrainState({n: p.detach().clone() for n, p in model.named_parameters()})
    assert state.digest() == certs[0]["start_hash"]
    import copy

    peers: dict[str, StreamingDiLoCo] = {}
    pending: dict[str, TrainState] = {}
    tau = cfg.algorithm.overlap_steps
    for cert in certs:
        r = cert["round"]
        contributions = []
        for a in cert["accepted"]:
            pid = a["peer_id"]
            if pid not in peers:  # a fresh peer starts from the canonical state
                peers[pid] = build_strategy(cfg.algorithm, copy.deepcopy(model), loss_fn, agg)
                peers[pid].load_state(state)
            s = peers[pid]
            batch = assignment_batches(cfg, corpus, seq_len, r, data_key(cluster.run_id, r, pid))
            for step in range(a["inner_steps"]):
                if step == tau and pid in pending:
                    s.adopt(pending.pop(pid))
                s.inner_step(batch(step))
            c = s.make_contribution()
            assert content_id(c.payload) == a["cid"], f"round {r}: {a['name']}'s bytes differ"
            contributions.append(c)
        assert len(contributions) == 2, f"round {r} accepted {len(contributions)} peers"
        state = peers[next(iter(peers))].apply_round(state, contributions)
        assert state.digest() == cert["new_hash"], f"round {r}: weights differ"
        pending = {pid: state for pid in peers}


@pytest.mark.network
@pytest.mark.slow
def test_overlapping_workers_commit_agree_with_the_validator_and_the_simulator(
    tmp_path: Path,
) -> None:
    from covey.io import audit
    from covey.local.cluster import LocalCluster

    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        cluster.start_worker("w0", "--threads", "1")
        cluster.start_worker("w1", "--threads", "1")
        cluster.start_validator("v0", "--threads", "1")
        cluster.wait_for(lambda s: s["committed_rounds"] >= 5, 240, "5 committed rounds")
        give_up = time.monotonic() + 120
        checks: list[str] = []
        while time.monotonic() < give_up and checks.count("agree") < 2:
            found, _, _ = audit.load(cluster.url)
            checks = [e.payload["outcome"] for e in found if e.type == "verification"]
            time.sleep(0.5)
        certs = [cluster.get(f"/v1/rounds/{r}/certificate") for r in range(5)]
        # SIGTERM while a transfer is (most likely) in flight: a clean, bounded exit
        import signal

        cluster.signal("w0", signal.SIGTERM)
        assert cluster.wait_exit("w0", 60) == 0, cluster.tail("w0")
    assert checks.count("agree") >= 2, (checks, cluster.tail("v0"))
    assert "disagree" not in checks and "fraud" not in checks, checks
    for w in ("w0", "w1"):
        lines = (tmp_path / "peers" / w / "rounds.jsonl").read_text().splitlines()
        rounds = [json.loads(line) for line in lines]
        # after round 0 every round trained its first tau steps during the last one's transfer
        assert [r["ahead"] for r in rounds[1:4]] == [3, 3, 3], rounds
    torch.set_num_threads(1)  # as the workers: bit-identical results
    _replay(cluster, certs)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.long
def test_a_worker_killed_mid_transfer_comes_back_and_nothing_is_corrupted(
    tmp_path: Path,
) -> None:
    """SIGKILL while the worker trains ahead (tau = 3 of its 4 steps per round: its transfer
    is in flight most of the time), then a restart with the same key and store: the run goes
    on, every round either worker applied matches its certificate, the validator agrees."""
    import signal

    from covey.io import audit
    from covey.local.cluster import LocalCluster

    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        cluster.start_worker("w0", "--threads", "1")
        cluster.start_worker("w1", "--threads", "1")
        cluster.start_validator("v0", "--threads", "1")
        cluster.wait_for(lambda s: s["committed_rounds"] >= 2, 240, "2 committed rounds")
        cluster.signal("w1", signal.SIGKILL)
        cluster.wait_exit("w1", 10)
        killed_at = cluster.status()["committed_rounds"]
        cluster.start_worker("w1", "--threads", "1")
        status = cluster.wait_for(
            lambda s: s["committed_rounds"] >= killed_at + 4, 240, "4 rounds after the kill"
        )
        last = status["committed_rounds"]
        certs = [cluster.get(f"/v1/rounds/{r}/certificate") for r in range(last)]
        found, _, _ = audit.load(cluster.url)
        checks = [e.payload["outcome"] for e in found if e.type == "verification"]
    assert "disagree" not in checks and "fraud" not in checks, checks
    by_round = {c["round"]: c["new_hash"] for c in certs}
    late = [c for c in certs if c["round"] >= killed_at + 2]
    assert all(len(c["accepted"]) == 2 for c in late), "w1 did not come back into the rounds"
    for w in ("w0", "w1"):
        path = tmp_path / "peers" / w / "applied.jsonl"
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)  # a line cut by the kill would fail here
            assert rec["matched"], (w, rec)
            if rec["round"] in by_round:
                assert rec["weights_hash"] == by_round[rec["round"]]
