"""A torchrun group is one peer (covey/peer/group.py): DDP inside, only rank 0 contributes.

Two gloo ranks on 127.0.0.1 (torch.multiprocessing, as torchrun would start them) train a
round in lockstep; the leader's one contribution must equal, to float rounding, what one
process makes from the same batches, and count the whole group's tokens."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from covey.algorithms import build_strategy
from covey.algorithms.base import Strategy
from covey.config import DiLoCoConfig
from covey.data.batches import sample_batch
from covey.models.gpt import lm_loss
from covey.peer.group import Group, Leader, attach, follow, group_from_env, shard
from covey.trust.sketch import Commitment
from tests.conftest import tiny_gpt

CFG = DiLoCoConfig(inner_steps=3, error_feedback=True, codec="topk:0.25")
STEPS = 3


def _batches() -> list[torch.Tensor]:
    tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(9))
    return [
        sample_batch(tokens, batch_size=4, seq_len=16, seed=1, round=0, worker=0, step=s)
        for s in range(STEPS)
    ]


def _strategy() -> Strategy:
    s = build_strategy(CFG, tiny_gpt(), lm_loss)
    s.load_state(s.init_state())
    return s


def _rank(rank: int, world: int, port: int, out: str, mode: str = "ddp") -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    group = group_from_env("cpu")
    assert group is not None and group.world == world
    s = _strategy()
    replica = attach(s, group, mode)
    try:
        if group.leader:
            lead = Leader(s, group, replica)
            lead.begin()
            for b in _batches():
                lead.inner_step(b)
            lead.end()
            c = s.make_contribution()
            lead.stop()
            Path(out, "payload").write_bytes(c.payload)
            Path(out, "tokens").write_text(f"{c.tokens} {c.inner_steps}")
            if replica is not None:  # what this rank holds of the replica's parameters
                held = sum(t.to_local().numel() for t in replica.shards.values())  # type: ignore[attr-defined]
                Path(out, "held").write_text(
                    f"{held} {sum(p.numel() for p in s.model.parameters())} {replica.gathers}"
                )
        else:
            Path(out, f"steps{rank}").write_text(str(follow(s, group, replica)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.network
@pytest.mark.long  # ~15 s of CPU, but two fresh interpreters: ~90 s on a busy machine
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_gloo_ranks_are_one_peer_with_one_contribution(tmp_path: Path, mode: str) -> None:
    """DDP, or FSDP2 (fully_shard: sharded gradients and AdamW moments, gathered into the
    leader's strategy once, when the contribution reads it): the leader's contribution is
    one device's on the whole batches, to 1e-6 (float sums in another order)."""
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path), mode), nprocs=2, join=True)
    single = _strategy()
    for b in _batches():
        single.inner_step(b)
    want = single.make_contribution()
    tokens, steps = map(int, Path(tmp_path, "tokens").read_text().split())
    assert (tokens, steps) == (want.tokens, want.inner_steps) == (3 * 4 * 16, STEPS)
    assert Path(tmp_path, "steps1").read_text() == str(STEPS)  # the follower trained too
    got = single.codec.decode(Path(tmp_path, "payload").read_bytes())
    ref = single.codec.decode(want.payload)
    # the same update as one device on the whole batch, up to the order of float sums
    assert torch.allclose(got, ref, atol=1e-6), float((got - ref).abs().max())
    assert float(ref.abs().max()) > 1e-4  # it really trained
    if mode == "fsdp":  # each rank held about half of the replica (dim-0 shards)
        held, whole, gathers = map(int, Path(tmp_path, "held").read_text().split())
        assert held <= 0.6 * whole, (held, whole)
        assert gathers == 1  # no commitment was read between the steps: no gather per step


def _committing_rank(rank: int, world: int, port: int, out: str) -> None:
    """An fsdp group whose leader commits after every step (GroupCommitter, k = 1), as the
    worker does: the commitments, the end commitment made from the gathered whole state
    for comparison, and how many gathers and partial sketches the replica made."""
    import json

    from covey.peer.group import GroupCommitter
    from covey.trust.sketch import commitment_of

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    group = group_from_env("cpu")
    assert group is not None
    s = build_strategy(CFG, tiny_gpt(), lm_loss)
    state = s.init_state()
    s.load_state(state)
    replica = attach(s, group, "fsdp")
    assert replica is not None
    try:
        if not group.leader:
            Path(out, f"steps{rank}").write_text(str(follow(s, group, replica)))
            return
        lead = Leader(s, group, replica)
        committer = GroupCommitter(lead, state, 1)
        lead.begin()
        held = []  # what the leader holds for training after each step's commitment
        for i, b in enumerate(_batches()):
            lead.inner_step(b)
            committer.after_step(i + 1)
            held.append(replica.device_bytes())
        sketched = replica.gathers
        lead.end()  # the contribution's gather: the whole state in the leader's strategy
        whole = commitment_of(s.local_state(copy=False), state.params, STEPS)
        lead.stop()
        record = {
            "commitments": [c.to_dict() for c in committer.recorded],
            "whole_end": whole.to_dict(),
            "gathers_while_committing": sketched,
            "gathers": replica.gathers,
            "sketches": replica.sketches,
            "held": held,
            "held_at_end": replica.device_bytes(),
            "param_bytes": sum(p.numel() * p.element_size() for p in s.model.parameters()),
            "on_the_device": sorted({str(p.device) for p in s.model.parameters()}),
        }
        Path(out, "commitments.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def one_device_commitments() -> list[Commitment]:
    """One device taking the steps of `_batches()` from the spec's initial state, a
    commitment after every step: what a group's commitments are held to."""
    from covey.trust.committer import Committer

    single = build_strategy(CFG, tiny_gpt(), lm_loss)
    start = single.init_state()
    single.load_state(start)
    want = Committer(single, start, 1)
    for i, b in enumerate(_batches()):
        single.inner_step(b)
        want.after_step(i + 1)
    return want.recorded


@pytest.mark.network
@pytest.mark.long  # two fresh interpreters: ~90 s on a busy machine
def test_fsdp_commitments_are_sketched_shard_by_shard_without_a_gather(tmp_path: Path) -> None:
    """Commitments between the round's start and end under fsdp: each rank sketches its own
    shards and the leader sums the partial sketches. No gather before the round's end (1 per
    round, not one per commitment); the last commitment equals, to float64 rounding, the one
    made from the whole state gathered afterwards, and every commitment is the one a single
    device makes on the same batches, to the float rounding of the group's training.
    Between commitments the leader's strategy holds nothing on the training device (its
    canonical copy is parked in host memory: on this CPU test, booked as parked), only the
    replica's shards."""
    import json

    from covey.trust.sketch import NO_HASH, Commitment, commitment_distance

    mp.spawn(_committing_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    record = json.loads(Path(tmp_path, "commitments.json").read_text())
    got = [Commitment.from_dict(c) for c in record["commitments"]]
    assert [c.step for c in got] == list(range(STEPS + 1))
    assert all(c.hash == NO_HASH for c in got[1:]) and got[0].hash != NO_HASH
    assert record["gathers_while_committing"] == 0 and record["gathers"] == 1
    assert record["sketches"] == STEPS  # one partial sketch per commitment after step 0
    # between commitments the leader's device holds its shards: the canonical parameters
    # and moments are parked in host memory; a shard is about half of the parameters and
    # of AdamW's two moments (3 model sizes in all)
    whole_bytes = record["param_bytes"]
    for held in record["held"]:
        assert held["canonical"] == 0, held
        assert 0 < held["shards"] <= 0.6 * 3 * whole_bytes, (held, whole_bytes)
        assert held["start"] <= 0.6 * whole_bytes
    # at the round's end the gathered parameters are on the device (the contribution is
    # computed there), the gathered moments in host memory
    assert record["held_at_end"]["canonical"] == whole_bytes, record["held_at_end"]
    assert record["on_the_device"] == ["cpu"]
    whole = Commitment.from_dict(record["whole_end"])
    assert commitment_distance(got[-1], whole) < 1e-12, commitment_distance(got[-1], whole)
    assert any(abs(v) > 1e-6 for v in got[-1].sketch["params"])  # it trained
    want = one_device_commitments()
    assert got[0] == want[0]  # the start: the same state, the same hash
    for a, b in zip(got[1:], want[1:], strict=True):
        assert commitment_distance(a, b) < 1e-4, (a.step, commitment_distance(a, b))


def test_a_one_rank_fsdp_group_commits_the_bits_of_one_device() -> None:
    """The real path in this process (a gloo group of one over an in-memory store): the
    leader's commitments are sketched by ShardedReplica.sketch, without a gather before the
    round's end, and equal one device's bit for bit; between them its strategy's canonical
    copy is parked (nothing of it booked on the training device), and the gather at the
    round's end puts the parameters back."""
    from covey.peer.group import GroupCommitter

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = Group(0, 1, torch.device("cpu"))
        s = build_strategy(CFG, tiny_gpt(), lm_loss)
        state = s.init_state()
        s.load_state(state)
        replica = attach(s, group, "fsdp")
        assert replica is not None
        lead = Leader(s, group, replica)
        got = GroupCommitter(lead, state, 1)
        lead.begin()
        held = []
        for i, b in enumerate(_batches()):
            lead.inner_step(b)
            got.after_step(i + 1)
            held.append(replica.device_bytes()["canonical"])
        gathers = replica.gathers
        lead.end()
        lead.stop()
    finally:
        dist.destroy_process_group()
    assert (gathers, replica.gathers, replica.sketches) == (0, 1, STEPS)
    assert held == [0] * STEPS
    params = sum(p.numel() * p.element_size() for p in s.model.parameters())
    assert replica.device_bytes()["canonical"] == params  # gathered back at the round's end
    assert got.recorded == one_device_commitments()
    assert any(abs(v) > 1e-6 for v in got.recorded[-1].sketch["params"])  # it trained


def test_shard_rows_are_dim0_chunks_and_partial_sketches_sum_to_the_whole() -> None:
    """What a rank of an fsdp group sketches: its rows of every tensor at their global
    indices (covey.peer.fsdp.ShardedReplica.sketch). Partial sketches summed in rank order
    are the whole state's commitment to float64 rounding; one rank's is the same bits."""
    from covey.peer.fsdp import shard_rows
    from covey.trust.sketch import (
        add_piece,
        commitment_distance,
        commitment_from_sketches,
        commitment_of,
        sketch_groups,
    )

    assert [shard_rows(5, 2, r) for r in range(2)] == [(0, 3), (3, 2)]
    assert [shard_rows(2, 4, r) for r in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]
    s = _strategy()
    start = {n: p.detach().clone() for n, p in s.model.named_parameters()}
    for b in _batches():
        s.inner_step(b)
    local = s.local_state(copy=False)
    whole = commitment_of(local, start, STEPS)
    groups = sketch_groups(local)
    for world in (1, 2, 3):
        total = torch.zeros(len(groups), 64, dtype=torch.float64)
        for rank in range(world):
            mine = torch.zeros_like(total)
            for g, keys in enumerate(groups):
                offset = 0
                for key in keys:
                    t = local[key].detach().float()
                    if key.startswith("param/"):
                        t = t - start[key[len("param/") :]]
                    first, count = shard_rows(t.shape[0], world, rank)
                    row = t[0].numel() if t.dim() > 1 else 1
                    piece = t[first : first + count].reshape(-1)
                    add_piece(mine[g], offset + first * row, piece)
                    offset += t.numel()
            total += mine
        got = commitment_from_sketches(STEPS, whole.hash, list(total))
        assert commitment_distance(got, whole) < 1e-14
        if world == 1:
            assert got.sketch == whole.sketch
    assert any(abs(v) > 1e-6 for v in whole.sketch["params"])


def test_shard_takes_strided_rows_and_refuses_too_few() -> None:
    batch = torch.arange(12).reshape(6, 2)
    assert shard(batch, 1, 3).tolist() == [[2, 3], [8, 9]]
    assert torch.equal(torch.cat([shard(batch, r, 2) for r in range(2)]).sort(0).values, batch)
    with pytest.raises(ValueError, match="3 rows cannot feed 4 ranks"):
        shard(batch[:3], 0, 4)


def test_not_under_torchrun_is_a_one_device_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert group_from_env("cpu") is None


def test_only_rank_0_leads() -> None:
    with pytest.raises(ValueError, match="rank 1 is not the group's leader"):
        Leader(_strategy(), Group(1, 2, torch.device("cpu")))


GROUP_SPEC = """
name = "group-peer"
seed = 5
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 16
paths = ["{corpus}"]
[algorithm]
method = "diloco"
inner_steps = 3
codec = "fp32"
inner_state = "reset"
[rounds]
deadline_min_s = 3
eval_batches = 1
"""


@pytest.mark.network
@pytest.mark.long  # three interpreters and a coordinator: minutes on a busy 2-core machine
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_covey_worker_under_torchrun_is_one_peer(tmp_path: Path, mode: str) -> None:
    """`torchrun --nproc-per-node 2 -m covey worker`: the coordinator sees one peer (rank
    0's identity), which trains certified rounds; rank 1 never connects, and both exit 0.
    It commits after every step (under fsdp: sketched shard by shard by both ranks)."""
    import subprocess
    import sys

    from covey.local.cluster import LocalCluster

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"row {i}: {i * 31 % 97} lazy dogs\n" for i in range(3000)))
    spec = tmp_path / "run.toml"
    spec.write_text(GROUP_SPEC.format(corpus=corpus) + "[trust]\ncommit_every = 1\n")
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        log = open(tmp_path / "group.log", "wb")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
        cmd += ["-m", "covey", "worker", "--coordinator", cluster.url, "--name", "g"]
        cmd += ["--identity", str(cluster.key("g")), "--run-id", cluster.run_id]
        cmd += ["--device", "cpu", "--max-rounds", "2", "--store-dir", str(tmp_path / "g")]
        cmd += ["--group", mode]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            status = cluster.wait_for(
                lambda s: s.get("committed_rounds", 0) >= 2 or s.get("round", 0) >= 2,
                300,
                "two rounds from the group peer",
            )
            assert proc.wait(120) == 0, (tmp_path / "group.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        peers = cluster.status()["peers"]
        assert [p["peer_id"] for p in peers] == [cluster.ids["g"]], peers
        assert status is not None


# -- a dead rank does not hang the group ---------------------------------------------------------


def _doomed_rank(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 leads a round whose second step comes after the test SIGKILLed rank 1; it
    must fail with GroupLost naming rank 1 (exit 3), within the group's timeout."""
    import sys

    from covey.peer.group import GroupLost

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    group = group_from_env("cpu", timeout_s=30.0)
    assert group is not None
    s = _strategy()
    attach(s, group)
    batches = _batches()
    if not group.leader:
        Path(out, "pid1").write_text(str(os.getpid()))
        follow(s, group)  # killed in here
        return
    lead = Leader(s, group)
    lead.begin()
    lead.inner_step(batches[0])
    Path(out, "stepped").write_text("1")
    deadline = time.monotonic() + 120  # the test kills rank 1 once it sees "stepped"
    while not Path(out, "killed").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    try:
        lead.inner_step(batches[1])
        lead.end()
    except GroupLost as e:
        Path(out, "lost").write_text(f"{time.monotonic() - t0:.1f} {e}")
        lead.stop()  # a broken group: returns at once, nothing to release
        sys.exit(3)
    Path(out, "lost").write_text("no error")


@pytest.mark.network
@pytest.mark.long  # two fresh interpreters and an 8 s liveness window: ~60 s when loaded
def test_a_killed_rank_fails_the_leader_naming_it_instead_of_hanging(tmp_path: Path) -> None:
    import signal

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_doomed_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        _wait_file(tmp_path / "stepped", procs, 240)
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
        (tmp_path / "killed").write_text("1")
        procs[0].join(120)
        assert procs[0].exitcode == 3, (procs[0].exitcode, _read(tmp_path / "lost"))
        took, message = _read(tmp_path / "lost").split(" ", 1)
        assert "rank 1 lost" in message and "STEP" in message, message
        assert float(took) < 60  # well inside the group's 30 s timeout + liveness window
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def _wait_file(path: Path, procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        dead = [p.exitcode for p in procs if p.exitcode is not None]
        assert not dead, f"a rank exited ({dead}) before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.1)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else "(nothing written)"


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's child with RANK=`rank` (read from /proc; Linux)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(d.name)
    return None


@pytest.mark.network
@pytest.mark.long  # three interpreters and a coordinator: minutes on a busy 2-core machine
def test_a_group_peer_that_loses_a_rank_is_a_no_show(tmp_path: Path) -> None:
    """`torchrun ... -m covey worker` whose rank 1 is SIGKILLed mid-round: the group exits
    non-zero (rank 0 names rank 1), leaves the run, and the coordinator accepts no
    contribution from it for any round after the one the kill interrupted."""
    import signal
    import subprocess
    import sys

    from covey.local.cluster import LocalCluster

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"row {i}: {i * 31 % 97} lazy dogs\n" for i in range(3000)))
    spec = tmp_path / "run.toml"
    spec.write_text(GROUP_SPEC.format(corpus=corpus))
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        log = open(tmp_path / "group.log", "wb")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
        cmd += ["-m", "covey", "worker", "--coordinator", cluster.url, "--name", "g"]
        cmd += ["--identity", str(cluster.key("g")), "--run-id", cluster.run_id]
        cmd += ["--device", "cpu", "--slowdown", "3", "--store-dir", str(tmp_path / "g")]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            status = cluster.wait_for(
                lambda s: s.get("committed_rounds", 0) >= 1, 300, "a round from the group peer"
            )
            victim = _rank_pid(proc.pid, 1)
            assert victim is not None, "rank 1 not found under torchrun"
            killed_in = int(cluster.status().get("round", 0))
            os.kill(victim, signal.SIGKILL)
            code = proc.wait(150)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        text = (tmp_path / "group.log").read_text(errors="replace")
        assert code != 0, text[-3000:]
        assert "the group broke during" in text and "rank 1 lost" in text, text[-3000:]
        cluster.wait_for(
            lambda s: all(p.get("state") != "live" for p in s.get("peers", [])),
            60,
            "the group peer to be gone",
        )
        accepted = [
            e["payload"]["round"]
            for e in cluster.get("/v1/ledger", limit=5000)
            if e["type"] == "contribution accepted"
            and e["payload"].get("peer_id") == cluster.ids["g"]
        ]
        assert accepted and max(accepted) <= killed_in, (accepted, killed_in, status)


def test_a_bad_group_mode_is_a_clear_error() -> None:
    from typer.testing import CliRunner

    from covey.cli import app

    result = CliRunner().invoke(app, ["worker", "--group", "zero"])
    assert result.exit_code == 2 and "--group must be ddp or fsdp, got 'zero'" in result.output
