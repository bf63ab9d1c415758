"""Attacks on SWARM's stale-weights defences.

Each test is a hole that a malicious server or a careless deployment could use, kept as a
regression test now that it is closed. All in-process or 127.0.0.1, well under a second each.

1. A server that signs the stage's PREVIOUS agreed state was used forever and never
   compared (checked_hop skipped the comparison when two replies named different states).
   Now the previous state is usable only for `grace_s` after the newest was first seen, and
   of two replies on different states only the one on the newest agreed state is used.
2. One reply on the agreed state cleared every clock of a server, so a server answering on
   made-up states, with one agreed-state reply per grace period, was used indefinitely. Now
   a clock closes only when its own state is agreed.
3. A reply whose signature did not verify was used, and the referee (rightly) ignores
   unsigned replies, so a liar that signed badly was never convicted. Now trainers verify
   every reply against the server's key from the servers view, and ban on failure.
4. A peer parsing the coordinator's spec filled in tokenizer_digest from ITS OWN files when
   the spec had none, so trainers could tokenize differently. Now the tokenizer is resolved
   where the spec is made ('bytes' or 'hf:DIR' with its digest) and never again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from random import Random
from typing import Any

import httpx
import pytest
import torch

from covey.swarm import compute
from covey.swarm.config import SwarmConfig
from covey.swarm.routing import StateWatch
from covey.swarm.trainer import Dropped, Hop, SwarmTrainer, TrainerStats, _keyed
from covey.swarm.wire import WireError, build_stage, encode_tensor, pack, reply_message, sha
from covey.trust.identity import Identity
from tests.tiny_hf import tiny_llama, tiny_tokenizer

CFG = SwarmConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16, stages=2, microbatch=4)


def _replies() -> tuple[bytes, bytes, bytes]:
    """(request, an honest forward reply on the stage's weights, one on other weights)."""
    idx = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    body = pack(encode_tensor(idx, "int8"))
    honest = compute.forward(CFG, 0, build_stage(CFG, 0), body)
    other = CFG.model_copy(update={"seed": CFG.seed + 1})
    garbage = compute.forward(other, 0, build_stage(other, 0), body)
    assert compute.reply_distance(honest, garbage) > CFG.tolerance
    return body, honest, garbage


def _bare_trainer(cfg: SwarmConfig = CFG) -> Any:
    """A SwarmTrainer without a coordinator: only what checked_hop and _send read."""
    t: Any = SwarmTrainer.__new__(SwarmTrainer)
    t.cfg, t.fixed, t.rng, t.lock = cfg, False, Random(0), threading.Lock()
    t.stats, t.evidence, t.name, t.run_id = TrainerStats(), [], "t", "run"
    t.states = StateWatch(grace_s=10.0, agreed={0: ["s1", "s2"]})
    t.urls, t.keys, t.http, t.dims = {}, {}, httpx.Client(), (256, cfg.n_embd)
    t.client = None  # a dispute would fail loudly: none is expected in these tests
    return t


def test_a_server_signing_the_previous_agreed_state_is_not_used_for_ever() -> None:
    w = StateWatch(grace_s=10.0, agreed={0: ["s1", "s2"]})
    assert w.usable("lazy", 0, "s1", now=0.0)  # a round's switch-over: fine for a while
    # s2 has been agreed for 100 s (ten grace periods): "s1" is no switch-over any more
    assert not w.usable("lazy", 0, "s1", now=100.0)


def test_a_checked_hop_never_uses_garbage_signed_on_the_previous_state() -> None:
    body, honest, garbage = _replies()
    t = _bare_trainer(CFG.model_copy(update={"verify_rate": 1.0}))
    hops = iter([Hop("liar", "s1", garbage, "sig"), Hop("honest", "s2", honest, "sig")])
    t.hop = lambda k, kind, body, rows, exclude=None: next(hops)
    try:
        h = t.checked_hop(0, "forward", body, 4)
    except Dropped:
        return  # refusing the microbatch is an answer too
    assert h.server == "honest", f"used {h.server}'s reply on superseded state {h.state}"


def test_one_agreed_reply_does_not_reset_the_clock_of_made_up_states() -> None:
    w = StateWatch(grace_s=10.0, agreed={0: ["s1", "s2"]})
    used = []
    for t in range(100):
        if t % 9 == 0:
            w.usable("m", 0, "s2", now=float(t))  # one honest reply now and then
        else:
            used.append(w.usable("m", 0, f"made-up-{t % 3}", now=float(t)))
    # an honest server's new state is agreed within grace_s: these never were
    assert not any(used[20:]), "replies on never-agreed states used after 100 s"


SERVER = Identity.generate()  # the key the servers view names for "srv"


@pytest.fixture(params=["garbage", "another key", "another state", "its key"])
def signer(request: pytest.FixtureRequest) -> Iterator[tuple[str, bytes, str]]:
    """A real HTTP server on 127.0.0.1 answering an honest reply on the agreed state "s2",
    signed as the param says: bytes that verify under no key, another server's key, its
    own key over another state than the header names, or its own key honestly."""
    body, honest, _ = _replies()
    how = request.param
    signer = Identity.generate() if how == "another key" else SERVER
    signed_state = "s1" if how == "another state" else "s2"
    sig = signer.sign(reply_message(0, signed_state, sha(body), sha(honest)))
    header = "s2 " + ("00" * 64 if how == "garbage" else sig)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(honest)))
            self.send_header("X-Covey-Signature", header)
            self.end_headers()
            self.wfile.write(honest)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", body, how
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.network
def test_a_reply_whose_signature_does_not_verify_is_not_used(signer: Any) -> None:
    url, body, how = signer
    t = _bare_trainer()
    t.urls, t.keys = {"srv": url}, {"srv": SERVER.public_key}
    if how == "its key":
        assert t._send("srv", 0, "forward", body).state == "s2"
        return
    # unsigned, it can never be disputed (the referee settles signed replies only), so a
    # liar that signs badly would be compared, disagree, and never be convicted
    with pytest.raises(WireError, match="does not verify"):
        t._send("srv", 0, "forward", body)


def test_a_server_whose_key_is_not_its_id_is_not_routed_to() -> None:
    """The servers view names each server's key; one that does not hash to its peer id
    (a coordinator bug, or a view tampered with) leaves the server out of routing."""
    good = {"peer_id": SERVER.peer_id, "public_key": SERVER.public_key}
    assert _keyed(good)
    assert not _keyed({**good, "public_key": Identity.generate().public_key})
    assert not _keyed({**good, "public_key": "not hex"}) and not _keyed({"peer_id": "x"})


def test_a_trainer_does_not_fill_in_its_own_tokenizer_digest(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "llama", vocab_size=320)
    coordinator = SwarmConfig(model=f"hf:{model}")  # its copy has no tokenizer.json
    spec = coordinator.model_dump(mode="json")
    assert coordinator.tokenizer_source() == "bytes" and not spec["tokenizer_digest"]
    tiny_tokenizer(model, vocab_size=300)  # this trainer's copy of the directory has one
    received = SwarmConfig.model_validate(spec)
    assert received.run_id == coordinator.run_id, "the spec a trainer parses is another run"
    assert received.tokenizer_source() == "bytes", "this trainer tokenizes unlike the others"
