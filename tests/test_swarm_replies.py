"""What a trainer passes on from a server's signed reply is checked first (holes a
malicious server could use). Before, the trainer passed on any reply that decoded, so:

1. framing: a stage-0 server answering forward with hidden states one unit too wide got
   the HONEST stage-1 servers banned: they refused the input (400) and the trainer banned
   each in turn. Now covey.swarm.compute.check_reply refuses the reply (the liar is banned).
2. a crash: a last-stage reply with {"loss": null} raised TypeError in microbatch and ended
   the trainer's worker thread. Now it is refused, and any unforeseen error costs the
   microbatch only.

Also here: StateWatch closes an honest server's clock once its state is agreed, on any
stage and however long ago, and an hf: run without a
tokenizer keeps the run id it had before tokenizers were named. Real HTTP on 127.0.0.1
with the real server request handler."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from random import Random
from typing import Any

import httpx
import pytest
import torch

from covey.swarm import compute
from covey.swarm.averaging import STANDING_ROUNDS, Averaging, AvgRound
from covey.swarm.config import SwarmConfig
from covey.swarm.costs import TrainerCosts
from covey.swarm.routing import Router, StateWatch
from covey.swarm.server import StageServer, _handler
from covey.swarm.trainer import Dropped, SwarmTrainer, TrainerStats
from covey.swarm.wire import build_stage, encode_tensor, pack, unpack
from covey.trust.identity import Identity
from tests.tiny_hf import tiny_llama

CFG = SwarmConfig(
    n_layer=2, n_embd=32, n_head=2, seq_len=16, stages=2, microbatch=4,
    verify_rate=0.0, request_timeout_s=0.5,
)  # fmt: skip


def _server(k: int, behavior: str) -> StageServer:
    s: Any = StageServer.__new__(StageServer)
    s.cfg, s.k, s.stage, s.state = CFG, k, build_stage(CFG, k), "agreed-" + str(k)
    s.lock, s.waiting, s.behavior, s.slowdown, s.emulate_s = threading.Lock(), 0, "honest", 1.0, 0.0
    s.throughput, s.identity, s.busy_s = 0.0, Identity.generate(), 0.0
    if behavior == "wide":  # forward outputs one hidden unit too many

        def run(cfg: SwarmConfig, kk: int, stage: Any, body: bytes) -> bytes:
            out, meta = unpack(compute.forward(cfg, kk, stage, body), 2)
            x = compute.decode_any(out)
            return pack(encode_tensor(torch.cat([x, x[..., :1]], -1), cfg.codec), meta)

        s._run, s._kind = run, "forward"
    elif behavior == "no-loss":  # backward with the loss left out

        def run(cfg: SwarmConfig, kk: int, stage: Any, body: bytes) -> bytes:
            out, meta = unpack(compute.backward(cfg, kk, stage, body), 2)
            m = json.loads(meta)
            m["loss"] = None
            return pack(out, json.dumps(m).encode())

        s._run, s._kind = run, "backward"
    return s


@pytest.fixture
def swarm(request: pytest.FixtureRequest) -> Iterator[dict[str, StageServer]]:
    behaviors: dict[str, tuple[int, str]] = request.param
    servers, https = {}, []
    for name, (k, behavior) in behaviors.items():
        s = _server(k, behavior)
        if hasattr(s, "_run"):  # misbehave through the real handler: wrap handle
            run = s._run

            def handle(
                kind: str,
                kk: int,
                body: bytes,
                check: bool = False,
                s=s,
                run=run,
                real=StageServer.handle,
            ) -> tuple[bytes, str]:
                if kind == s._kind:
                    from covey.swarm.wire import reply_message, sha

                    reply = run(s.cfg, kk, s.stage, body)
                    return reply, s.state + " " + s.identity.sign(
                        reply_message(kk, s.state, sha(body), sha(reply))
                    )
                return real(s, kind, kk, body, check)

            s.handle = handle  # type: ignore[method-assign]
        http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(s))
        http.daemon_threads = True
        threading.Thread(target=http.serve_forever, daemon=True).start()
        s.url = f"http://127.0.0.1:{http.server_address[1]}"
        servers[name], https = s, [*https, http]
    try:
        yield servers
    finally:
        for h in https:
            h.shutdown()
            h.server_close()


def _trainer(servers: dict[str, StageServer]) -> Any:
    t: Any = SwarmTrainer.__new__(SwarmTrainer)
    t.cfg, t.fixed, t.rng, t.lock = CFG, False, Random(0), threading.Lock()
    t.stats, t.evidence, t.name, t.run_id, t.served = TrainerStats(), [], "t", "run", {}
    t.spent = TrainerCosts()
    t.states = StateWatch(grace_s=10.0)
    t.states.agree({0: ["agreed-0"], 1: ["agreed-1"]}, 0.0)
    t.router = Router(seed=0, slow_s=5.0, service_time=True)
    t.http, t.stop, t.chain = httpx.Client(trust_env=False), threading.Event(), threading.local()
    t.urls, t.keys, t.dims = {}, {}, (256, CFG.n_embd)
    for name, s in servers.items():
        t.urls[name], t.keys[name] = s.url, s.identity.public_key
        t.router.add_server(name, s.k)
    t.refresh = lambda: None  # no coordinator: the view stays as it is
    t.tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
    return t


@pytest.mark.parametrize(
    "swarm",
    [{"liar0": (0, "wide"), "honest1a": (1, "honest"), "honest1b": (1, "honest")}],
    indirect=True,
)
def test_a_bad_forward_does_not_get_the_next_stage_banned(swarm: dict[str, Any]) -> None:
    t = _trainer(swarm)
    with pytest.raises(Dropped):  # stage 0's only server is a liar: nothing to pass on
        t.microbatch(0)
    banned = t.router.banned()
    assert not {"honest1a", "honest1b"} & set(banned), f"honest servers banned: {banned}"
    assert "not (4, 16, 32)" in banned["liar0"]  # the liar, for the reply it sent


@pytest.mark.parametrize(
    "swarm", [{"honest0": (0, "honest"), "liar1": (1, "no-loss")}], indirect=True
)
def test_a_last_stage_reply_without_a_loss_does_not_kill_the_worker(swarm: dict[str, Any]) -> None:
    t = _trainer(swarm)
    with pytest.raises(Dropped):  # what train()'s worker catches; a TypeError ended it
        t.microbatch(0)
    assert "names no loss" in t.router.banned()["liar1"]


@pytest.mark.parametrize(
    "swarm", [{"honest0": (0, "honest"), "liar1": (1, "no-loss")}], indirect=True
)
def test_a_trainer_worker_survives_a_reply_without_a_loss(swarm: dict[str, Any]) -> None:
    """train()'s workers go on after the bad reply: the liar is banned, microbatches drop."""
    t = _trainer(swarm)
    t.inflight, t._next, t.report = 1, 0, lambda: None
    stats = t.train(seconds=2.0)
    assert "liar1" in t.router.banned() and stats.dropped >= 1 and stats.microbatches == 0


def test_an_honest_servers_clock_closes_once_its_state_is_agreed_on_any_stage() -> None:
    w = StateWatch(grace_s=10.0)
    w.agree({0: ["a0", "a1"], 1: ["b0", "b1"]}, now=0.0)
    assert w.usable("srv", 0, "a2", now=1.0)  # ahead on stage 0 for a moment (honest)
    w.agree({0: ["a0", "a1", "a2"], 1: ["b0", "b1"]}, now=2.0)  # ... and agreed
    assert w.usable("srv", 1, "b1", now=50.0)  # moved by the rebalancer to stage 1
    assert w.usable("srv", 1, "b2", now=100.0), f"honest server refused; clocks {w.clocks}"
    history = ["s0", "s1"]
    w.agree({2: list(history)}, now=0.0)
    assert w.usable("srv2", 2, "s2", now=1.0)
    for i in range(2, 20):  # rounds go by; the coordinator keeps the last 16 agreed ids
        history = [*history, f"s{i}"][-16:]
        w.agree({2: list(history)}, now=10.0 * i)
        assert w.usable("srv2", 2, f"s{i}", now=10.0 * i + 5)
    assert w.usable("srv2", 2, "s20", now=200.0), f"honest server refused; clocks {w.clocks}"


def test_an_hf_run_without_a_tokenizer_keeps_its_run_id(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "llama", vocab_size=320)
    cfg = SwarmConfig(model=f"hf:{model}")  # resolved to covey's bytes where it is made
    assert cfg.tokenizer == "bytes"
    data = cfg.model_dump(mode="json")
    del data["tokenizer"], data["tokenizer_digest"]  # the spec before tokenizers were named
    del data["data_fingerprint"]  # nor data fingerprints
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    assert cfg.run_id == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert SwarmConfig.model_validate(cfg.model_dump(mode="json")).run_id == cfg.run_id


def test_a_server_moved_to_another_stage_is_no_voter_of_its_old_one() -> None:
    """The vote on a stage's state counts as voters at least the live servers that
    reported to its last round; one the rebalancer moved to another stage is not one of
    them any more. It was: the two servers left could not agree on their state, so it was
    never agreed, and trainers refused their replies at every switch-over after it (the
    bench's homogeneous runs at 0.90x; docs/benchmarks/2026-11-26.md, SWARM)."""
    avg = Averaging(2, target_samples=1000, round_timeout_s=10.0)
    book = avg.stages[0]
    book.last = AvgRound(0, 0, 0, ["a", "b", "c"], 0.0, status="committed")
    book.last.reports = {p: {"cid": "x", "samples": 4, "url": "", "norm": 1.0} for p in "abc"}
    book.step = 1
    avg.state("a", 0, 1, "s1")
    avg.state("b", 0, 1, "s1")
    live = {"a": (0, 1, 0), "b": (0, 1, 0), "c": (0, 1, 0)}  # c is still on stage 0
    avg.tick(live, set(), now=1.0)
    assert book.quorum == 3 and book.agreed == "s1"  # two of three
    book.last.reports["d"] = {"cid": "x", "samples": 4, "url": "", "norm": 1.0}
    avg.tick({**live, "d": (0, 1, 0)}, set(), now=2.0)
    assert book.quorum == 4 and book.agreed is None  # two of four: no majority
    avg.tick({**live, "d": (1, 0, 0)}, set(), now=3.0)  # d moved to stage 1
    assert book.quorum == 3 and book.agreed == "s1"


def test_two_colluders_cannot_carry_a_stage_whose_honest_servers_are_slow() -> None:
    """A hole once open: three honest servers and two colluders all report to step 0's
    round. Two honest ones are slower than round_timeout_s, so step 1's round has h1 and
    the colluders only. The vote at step 2 counted that round's three reporters, and the
    colluders' state was agreed (every honest server then resynced to it). Now the voters
    are the live servers that reported to one of the stage's last rounds, and the slow ones
    catch up by applying the round they missed: the honest state is agreed."""
    servers = ["h1", "h2", "h3", "m1", "m2"]
    av = Averaging(1, target_samples=10, round_timeout_s=10.0)
    for p in servers:
        av.state(p, 0, 0, "s0")
    av.tick({p: (0, 0, 10) for p in servers}, set(), 1000.0)
    r = av.stages[0].round
    assert r is not None
    for p in servers:
        assert av.report(p, 0, r.id, f"sum-{p}", 10, "u", 1.0) == "ok"
    av.tick({p: (0, 0, 10) for p in servers}, set(), 1001.0)
    book = av.stages[0]
    assert book.step == 1 and book.quorum == 5
    for p, cid in (("h1", "honest-1"), ("m1", "X1"), ("m2", "X1")):
        av.state(p, 0, 1, cid)
    live = {"h1": (0, 1, 10), "m1": (0, 1, 10), "m2": (0, 1, 10)}
    live |= {"h2": (0, 0, 10), "h3": (0, 0, 10)}  # still applying step 0's round
    av.tick(live, set(), 1012.0)  # past the wait for the slow: a round of the three opens
    r = book.round
    assert r is not None and sorted(r.members) == ["h1", "m1", "m2"]
    for p in r.members:
        av.report(p, 0, r.id, f"sum-{p}", 10, "u", 1.0)
    av.tick(live, set(), 1013.0)
    assert book.step == 2
    for p, cid in (("h1", "honest-2"), ("m1", "X2"), ("m2", "X2")):
        av.state(p, 0, 2, cid)
    live |= {"h2": (0, 1, 10), "h3": (0, 1, 10)}  # applied step 0's round at last
    av.tick(live, set(), 1014.0)
    assert book.agreed != "X2", "two colluders of five servers set the stage's agreed state"
    assert book.quorum == 5 and book.agreed is None
    # the slow ones apply step 1's round, which they missed, and vote for the honest state
    for p in ("h2", "h3"):
        d = av.directive(p, 0, 1, "honest-1")
        assert d["apply"]["step"] == 1 and "resync" not in d
        av.state(p, 0, 2, "honest-2")
    assert book.agreed == "honest-2"
    assert av.directive("m1", 0, 2, "X2")["resync"] == "honest-2"
    assert "resync" not in av.directive("h2", 0, 2, "honest-2")


def test_a_server_that_stops_reporting_stops_voting() -> None:
    """A live server that reports to none of a stage's last STANDING_ROUNDS rounds is no
    voter: a stuck or withholding one cannot hold up the stage's agreement for ever."""
    av = Averaging(1, target_samples=10, round_timeout_s=10.0)
    book = av.stages[0]
    t = 1000.0
    for step in range(STANDING_ROUNDS + 1):
        live = {p: (0, step, 10) for p in ("a", "b", "c")}
        voting = ("a", "b") if step else ("a", "b", "c")  # c stops after step 0
        for p in voting:
            av.state(p, 0, step, f"s{step}")
        t += 11.0  # past the wait for a last round's member that has not applied it (c)
        av.tick(live, set(), t)
        assert book.agreed == (f"s{step}" if step else None) and book.quorum == (3 if step else 0)
        r = book.round
        assert r is not None and r.step == step
        for p in voting:
            av.report(p, 0, r.id, f"sum-{p}-{step}", 10, "u", 1.0)
        t += 11.0  # the round closes at its deadline without c
        av.tick(live, set(), t)
    assert book.step == STANDING_ROUNDS + 1 and book.quorum == 2
    av.state("a", 0, book.step, "last")
    assert book.agreed is None  # one of two
    av.state("b", 0, book.step, "last")
    assert book.agreed == "last"


def test_servers_with_no_work_in_a_round_do_not_carry_the_vote() -> None:
    """A hole once open: the vote counted every server's state, voters or not. Two
    colluders and three fresh sybil keys outvoted three honest servers, who were then told
    to resync to the colluders' state. Only the voters' states count now."""
    servers = ["h1", "h2", "h3", "m1", "m2"]
    av = Averaging(1, target_samples=10, round_timeout_s=10.0)
    for p in servers:
        av.state(p, 0, 0, "s0")
    live = {p: (0, 0, 10) for p in servers}
    av.tick(live, set(), 1000.0)
    r = av.stages[0].round
    assert r is not None
    for p in servers:
        assert av.report(p, 0, r.id, f"sum-{p}", 10, "u", 1.0) == "ok"
    av.tick(live, set(), 1001.0)
    book = av.stages[0]
    assert book.step == 1
    sybils = ["y1", "y2", "y3"]  # joined stage 0 just now: no round behind them
    live = {p: (0, 1, 0) for p in servers + sybils}
    for p in ("h1", "h2", "h3"):
        av.state(p, 0, 1, "honest-1")
    for p in ("m1", "m2", *sybils):
        av.state(p, 0, 1, "X1")
    av.tick(live, set(), 1002.0)
    assert book.quorum == 5  # the voters: the round's five reporters
    assert book.agreed != "X1", "2 colluders + 3 non-voting sybils set the stage's state"
    assert "resync" not in av.directive("h1", 0, 1, "honest-1")


def test_no_sybil_majority_before_the_first_round() -> None:
    """Step 0 (no round yet): any majority of heartbeats set the agreed state, and every
    honest server holding the seeded weights was told to resync to it. Nobody votes now
    before the first round: the agreed state is the seed's, which the coordinator builds
    from the spec (nothing is agreed until it has)."""
    av = Averaging(1, target_samples=10, round_timeout_s=10.0)
    for p in ("h1", "h2"):
        av.state(p, 0, 0, "seeded")
    for p in ("y1", "y2", "y3"):
        av.state(p, 0, 0, "X0")
    assert av.stages[0].agreed is None
    assert av.directive("h1", 0, 0, "seeded").get("resync") != "X0"
    av.seed(0, "seeded")
    assert av.stages[0].agreed == "seeded"
    assert "resync" not in av.directive("h1", 0, 0, "seeded")
    assert av.directive("y1", 0, 0, "X0")["resync"] == "seeded"
