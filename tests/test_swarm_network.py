"""SWARM over real HTTP: a swarm coordinator and stage servers as processes on
127.0.0.1, a trainer in this process. One swarm per module (2 stages x 2 servers); the tests
run in order and each leaves it usable for the next: a microbatch equals in-process, a
SIGKILLed server is routed around, an adversarial server is caught and slashed."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from covey.io import audit
from covey.swarm.launch import Swarm, status, wait_for
from covey.swarm.ledger_evidence import recompute_disputes
from tests.swarm_helpers import SETTINGS, four_servers

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    yield from four_servers(tmp_path_factory.mktemp("swarm"), SETTINGS)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trainer(swarm: Swarm, name: str):  # type: ignore[no-untyped-def]
    from covey.swarm.trainer import SwarmTrainer

    return SwarmTrainer(swarm.url, name=name, inflight=2, progress=lambda _: None)


def test_a_microbatch_through_two_stages_equals_in_process(swarm: Swarm) -> None:
    """Loss and per-parameter gradient norms of one microbatch sent hop by hop through the
    servers equal the pure core's (covey.swarm.stage) on the same int8 wire."""
    from covey.data.batches import sample_batch
    from covey.swarm import compute
    from covey.swarm.pipeline import int8_wire, train_microbatch
    from covey.swarm.wire import build_stage, encode_tensor, pack, unpack

    t = trainer(swarm, "exact")
    try:
        t.refresh()
        cfg = t.cfg
        batch = sample_batch(t.tokens, batch_size=4, seq_len=cfg.seq_len, seed=0, round=0,
                             worker="exact", step=0)  # fmt: skip
        h0 = t.hop(0, "forward", pack(encode_tensor(batch[:, :-1], "int8")), 4)
        out0, _ = unpack(h0.reply, 2)
        h1 = t.hop(1, "backward", pack(out0, encode_tensor(batch[:, 1:], "")), 4)
        grad1, _ = unpack(h1.reply, 2)
        h2 = t.hop(0, "backward", pack(encode_tensor(batch[:, :-1], ""), grad1), 4)
        (_, meta1), (_, meta0) = compute.parse_reply(h1.reply), compute.parse_reply(h2.reply)
    finally:
        t.close()
    stages = [build_stage(cfg, 0), build_stage(cfg, 1)]
    loss = train_microbatch(stages, batch, int8_wire(64))
    assert meta1["loss"] == pytest.approx(loss, rel=1e-5)
    assert meta1["sketch"] == pytest.approx(stages[1].last_sketch, rel=1e-4)
    assert meta0["sketch"] == pytest.approx(stages[0].last_sketch, rel=1e-3)


def test_sigkill_of_a_server_mid_step_reroutes_and_loses_no_accepted_update(
    swarm: Swarm,
) -> None:
    t = trainer(swarm, "churn")
    start = _accumulated(swarm.url)
    done: dict[str, object] = {}
    run = threading.Thread(target=lambda: done.update(stats=t.train(samples=64)), daemon=True)
    try:
        run.start()
        wait_for(lambda: t.stats.samples >= 24, 60, "training to start")
        swarm.kill("b1")
        run.join(timeout=120)
        assert not run.is_alive(), "the trainer hung after a server was killed"
    finally:
        t.stop.set()
        t.close()
    assert t.stats.samples >= 64
    assert t.router.reroutes >= 1  # b1's in-flight hops went elsewhere

    def settled() -> dict | None:
        s = status(swarm.url)
        if s is None or any(b["open_round"] is not None for b in s["averaging"]):
            return None
        steps = {b["stage"]: (b["step"], b["agreed"]) for b in s["averaging"]}
        live = [x for x in s["servers"]]
        ok = all((x["step"], x["state"]) == steps[x["stage"]] for x in live)
        return s if ok and len(live) == 3 else None

    s = wait_for(settled, 30, "survivors to apply every committed round")
    # every accepted (committed) round was applied by every survivor of its stage
    assert all(b["rounds"] >= 1 for b in s["averaging"])
    assert "b1" not in {x["name"] for x in s["servers"]}
    # checked hops (verify_rate 0.5) count once: no stage took in more samples than were
    # trained (dropped microbatches may have reached some stages' backward, and a rerouted
    # hop may have been accumulated by the server whose reply was lost: at least once)
    mb = SETTINGS["microbatch"]
    bound = t.stats.samples + (t.stats.dropped + t.router.reroutes) * mb
    assert all(b - a <= bound for a, b in zip(start, _accumulated(swarm.url), strict=True))
    assert t.stats.checks >= 1 and t.stats.paid_checks >= 1
    # the decentralization multiplier (covey.swarm.costs): the servers' compute of used
    # hops is useful, checks' duplicates redundant, the killed server's hops churn; the
    # coordinator sums what its trainers reported and adds its servers' idle time
    mine = t.spent.as_dict()
    assert mine["useful_s"] > 0 and mine["parts_s"]["redundant"] > 0, mine
    # the killed server's refused hops cost their wall time, which can round to 0.000 s
    assert t.spent.costs.churn_s > 0 and mine["evidence_bytes"] > 0, mine
    run_costs = s["costs"]
    assert run_costs["useful_s"] == pytest.approx(mine["useful_s"], abs=1e-3), run_costs
    assert run_costs["parts_s"]["network"] > 0 and run_costs["multiplier"] > 1, run_costs
    text = httpx.get(f"{swarm.url}/metrics").text
    assert "covey_decentralization_multiplier " in text


def _accumulated(url: str) -> list[int]:
    """Samples each stage took in: in committed rounds, and pending on live servers."""
    s = status(url)
    assert s is not None
    return [b["samples"] + sum(x["pending"] for x in s["servers"] if x["stage"] == b["stage"])
            for b in s["averaging"]]  # fmt: skip


@pytest.mark.parametrize(
    "behavior",
    [
        "noise",
        # one request in five answered slightly wrong (1.4x the tolerance): caught on the
        # first such request that is also a duplicated hop (verify_rate 0.5 here)
        "subtle",
        # claims each agreed state but keeps its first weights: its replies differ from
        # b0's once a round is applied (~20-60 s of training)
        pytest.param("stale", marks=pytest.mark.long),
    ],
)
def test_an_adversarial_server_is_caught_and_slashed(swarm: Swarm, behavior: str) -> None:
    name = f"liar-{behavior}"
    swarm.start_server(name, "--behavior", behavior, "--stage", "1")
    s = swarm.ready([name])
    liar = next(x for x in s["servers"] if x["name"] == name)
    assert liar["stage"] == 1  # beside b0, the honest server left on stage 1
    t = trainer(swarm, "checker")
    run = threading.Thread(target=lambda: t.train(seconds=90), daemon=True)
    try:
        run.start()
        wait_for(lambda: (st := status(swarm.url)) and liar["peer_id"] in st["banned"], 90,
                 "the liar to be banned")  # fmt: skip
    finally:
        t.stop.set()
        run.join(timeout=30)
        t.close()
    assert liar["peer_id"] in t.router.banned()
    db = sqlite3.connect(swarm.workdir / "run" / "swarm.db")
    rows = db.execute("SELECT type, payload FROM ledger WHERE type IN ('dispute', 'slash')")
    kinds = [(k, p) for k, p in rows if liar["peer_id"] in p]
    db.close()
    assert [k for k, _ in kinds] == ["dispute", "slash"]
    honest = [x["peer_id"] for x in status(swarm.url)["servers"]]  # type: ignore[index]
    assert liar["peer_id"] not in honest
    # the conviction's evidence (both signed replies, the request, the state) is kept, and
    # `covey ledger verify --recompute` recomputes the reply from it over HTTP
    report = audit.verify(swarm.url, recompute=True, recomputers=[recompute_disputes])
    assert report.swarm_convictions >= 1, report
    assert report.swarm_recomputed == report.swarm_convictions


@pytest.mark.long
def test_swarm_demo_runs_with_kills(tmp_path: Path) -> None:
    """`covey swarm demo` end to end: servers of mixed speeds, one SIGKILLed every 15 s and
    restarted, the trainer finishes its minute and trains."""
    import subprocess
    import sys

    from covey.swarm.launch import free_port

    cmd = [sys.executable, "-m", "covey", "swarm", "demo", "--minutes", "1", "--kill-every",
           "15", "--servers", "4", "--port", str(free_port())]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "SIGKILL" in out.stdout and "trainer:" in out.stdout
