"""Evidence on draw (covey.coordinator.intake): a stateful contribution's local states cross
the coordinator's link only when it is drawn for verification, and then a worker that has
learnt it was drawn (its blob server sees the request) can neither walk away, nor draw
again, nor stall past the round without a strike; and the coordinator's own failures are
never booked against it. An in-process coordinator driven by hand, and test peers whose
blob servers on 127.0.0.1 do what each test says."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

import covey.blobs.store as store_mod
from covey.config import load_run_config
from covey.coordinator.auth import _RECEIVED_AT
from covey.coordinator.intake import Withheld, evidence_grace_s
from covey.coordinator.rejected import Rejected
from covey.coordinator.service import Coordinator
from covey.io import audit
from covey.protocol import schemas
from covey.protocol.content import content_id
from covey.trust.certify import sample
from covey.trust.identity import Identity, request_purpose
from covey.trust.incentives import Book
from covey.trust.ledger import read_entries

SPEC = """
name = "evidence"
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 4
[rounds]
min_peers = {min_peers}
deadline_min_s = 600
deadline_max_s = 600
dead_after_s = 600
heartbeat_s = 60
lease_s = 600
eval_every = 100000
checkpoint_every = 100000
eval_batches = 1
[trust]
new_peer_contributions = {new}
sample_rate = 0.5
"""
RATE = 0.5


class BlobServer:
    """A worker's blob server: serves `blobs`, records every cid asked for (`requested`:
    how a worker learns it was drawn), runs `hook(cid)` before answering (a stall); sends
    the `trickle` cids at ~80 KiB/s (holding the connection) and ends the connection after
    the `close` cids."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.requested: list[str] = []
        self.hook: Callable[[str], None] | None = None
        self.trickle: set[str] = set()
        self.close: set[str] = set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                cid = self.path.rsplit("/", 1)[-1]
                server.requested.append(cid)
                if server.hook is not None:
                    server.hook(cid)
                data = server.blobs.get(cid)
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, end = 0, len(data) - 1
                if rng := self.headers.get("Range"):
                    a, b = rng.split("=")[1].split("-")
                    start, end = int(a), int(b)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(end - start + 1))
                if cid in server.close:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                body = data[start : end + 1]
                piece = 32 << 10 if cid in server.trickle else len(body) or 1
                for i in range(0, len(body), piece):
                    self.wfile.write(body[i : i + piece])
                    if cid in server.trickle:
                        self.wfile.flush()
                        time.sleep(0.4)  # the trickle itself: what this server is for

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


def signed(key: Identity, body: dict[str, Any], path: str, round_: int = -1) -> dict[str, Any]:
    return key.sign_request(body, round_, purpose=request_purpose(path))


class Peer:
    """A worker that joins `coord` and submits contributions by hand."""

    def __init__(self, coord: Coordinator, name: str) -> None:
        self.coord, self.key, self.server = coord, Identity.generate(), BlobServer()
        self.id = self.key.peer_id
        body = {
            "run_id": coord.run_id, "peer_id": self.id, "public_key": self.key.public_key,
            "name": name, "step_time_s": 0.01, "accepts_connections": True,
            "blob_url": self.server.url,
        }  # fmt: skip
        raw = signed(self.key, body, "/v1/join")
        token = _RECEIVED_AT.set(request_purpose("/v1/join"))
        try:
            coord.join(schemas.JoinRequest.model_validate(raw), raw)
        finally:
            _RECEIVED_AT.reset(token)

    def payload(self, k: int) -> bytes:
        """A valid payload; k varies its bytes, so its content id, so its draw."""
        strategy, state = self.coord.rounds.strategy, self.coord.state
        numel = sum(
            state.params[n].numel()
            for n in strategy.fragment_names(strategy.round_fragment(state.round))
        )
        salt = int(self.id[:6], 16) * 1e-12
        return strategy.codec.encode(torch.full((numel,), 1e-6 * (k + 1) + salt))

    def end_state(self) -> bytes:
        n = next(n for n, what in self.coord.uploads.sizes.items() if what == "local state")
        seed = self.id.encode()
        return (seed * (n // len(seed) + 1))[:n]

    def k_drawn(self, want: bool, start: int = 0) -> int:
        """A payload whose draw is `want` (the test knows the coordinator's key)."""
        rnd = self.coord.open_round()
        assert rnd is not None
        k = start
        while True:
            cid = content_id(self.payload(k))
            if (
                sample(self.coord.identity, self.coord.run_id, rnd.round, self.id, cid, RATE)[0]
                == want
            ):
                return k
            k += 1

    def submit(
        self, k: int, start_cid: str | None = None, **lies: Any
    ) -> dict[str, Any] | Rejected:
        """Submit payload k to the open round, naming `start_cid` as its start state; `lies`
        replace fields of the body before it is signed (a dishonest peer's own request)."""
        rnd = self.coord.open_round()
        assert rnd is not None
        payload, end = self.payload(k), self.end_state()
        self.server.blobs[content_id(payload)] = payload
        self.server.blobs[content_id(end)] = end
        body = {
            "run_id": self.coord.run_id, "round": rnd.round, "attempt": rnd.attempt,
            "peer_id": self.id, "cid": content_id(payload), "start_hash": self.coord.state_hash,
            "size": len(payload), "tokens": 1,
            "inner_steps": rnd.assignments[self.id]["inner_steps"],
            "end_state_cid": content_id(end), "end_state_size": len(end),
        }  # fmt: skip
        if start_cid is not None:
            body["local_state_cid"] = start_cid
        body.update(lies)
        path = f"/v1/rounds/{rnd.round}/contributions"
        raw = signed(self.key, body, path, rnd.round)
        token = _RECEIVED_AT.set(request_purpose(path))
        try:
            return self.coord.submit(
                rnd.round, schemas.ContributionRequest.model_validate(raw), raw
            )
        except Rejected as e:
            return e
        finally:
            _RECEIVED_AT.reset(token)


@pytest.fixture
def make(tmp_path: Path):
    made: list[Coordinator] = []

    def build(min_peers: int = 1, new: int = 0) -> Coordinator:
        spec = tmp_path / "run.toml"
        spec.write_text(SPEC.format(min_peers=min_peers, new=new))
        made.append(Coordinator(load_run_config(spec), tmp_path / "data"))
        return made[-1]

    yield build
    for coord in made:
        coord.stop()


def entries_of(coord: Coordinator, peer_id: str) -> list[Any]:
    found = read_entries(coord.data_dir / "coordinator.db")
    return [e for e in found if e.payload.get("peer_id") == peer_id]


def account(coord: Coordinator, peer_id: str) -> Any:
    return Book.replay(read_entries(coord.data_dir / "coordinator.db")).accounts[peer_id]


def overdue(coord: Coordinator) -> None:
    """The open round's deadline passes."""
    with coord.db.transaction() as c:
        c.execute("UPDATE rounds SET deadline = ? WHERE status = 'open'", (time.time() - 1,))


def test_only_a_drawn_contribution_moves_its_states_and_it_cannot_draw_again(make) -> None:
    """Undrawn: its end state is never asked for. Drawn and not delivered: refused as
    withheld, and a second submission to the round (another payload, another draw) is
    refused without asking for anything, in this attempt and the next."""
    coord = make(min_peers=1)
    honest, cheat = Peer(coord, "honest"), Peer(coord, "cheat")
    coord.tick(time.time())
    undrawn = honest.submit(honest.k_drawn(want=False))
    assert isinstance(undrawn, dict), undrawn
    assert content_id(honest.end_state()) not in honest.server.requested
    k = cheat.k_drawn(want=True)
    end = content_id(cheat.end_state())
    cheat.server.hook = lambda cid: cheat.server.blobs.pop(end, None)  # withholds it
    first = cheat.submit(k)
    assert isinstance(first, Rejected) and "not delivered" in first.message, first
    asked = len(cheat.server.requested)
    again = cheat.submit(cheat.k_drawn(want=False, start=k + 1))
    assert isinstance(again, Rejected) and again.status == 409, again
    assert len(cheat.server.requested) == asked  # refused before anything was fetched
    withheld = [e for e in entries_of(coord, cheat.id) if e.payload.get("withheld") is True]
    assert len(withheld) == 1 and account(coord, cheat.id).withheld == 1


def test_what_a_dishonest_peer_names_for_its_local_states(make) -> None:
    """A size that is not the run's local-state size, another peer's end state as its
    start, and bytes that do not hash to the end state it named (served under that id):
    the first two are refused before anything is fetched or drawn, the third is withheld."""
    coord = make(min_peers=1)
    honest, liar = Peer(coord, "honest"), Peer(coord, "liar")
    coord.tick(time.time())
    assert isinstance(honest.submit(honest.k_drawn(want=False)), dict)
    end = liar.end_state()
    size = liar.submit(liar.k_drawn(want=True), end_state_size=len(end) + 1)
    assert isinstance(size, Rejected) and size.status == 422, size
    assert "not a local state" in size.message and not liar.server.requested[1:]
    other = content_id(honest.end_state())
    start = liar.submit(liar.k_drawn(want=True, start=50), start_cid=other)
    assert isinstance(start, Rejected) and "starts from local state" in start.message, start
    assert content_id(end) not in liar.server.requested
    k = liar.k_drawn(want=True, start=100)
    forged = b"x" * len(end)  # the right size, the wrong bytes, under the named id
    liar.server.hook = lambda cid: liar.server.blobs.update({cid: forged} if cid == end_cid else {})
    end_cid = content_id(end)
    wrong = liar.submit(k)
    assert isinstance(wrong, Withheld) and "not delivered" in wrong.message, wrong
    assert account(coord, liar.id).withheld == 1
    assert not coord.blobs.has(end_cid)


def test_a_stall_past_the_grace_is_withheld_and_the_round_goes_on(make) -> None:
    """A drawn worker that serves its state slowly holds the round's close only within
    `evidence_grace_s`; past it the round commits without it, books it as withheld, and
    its submission is refused when the stalled fetch finally ends."""
    coord = make(min_peers=2)
    honest, cheat = Peer(coord, "honest"), Peer(coord, "cheat")
    coord.tick(time.time())
    assert isinstance(honest.submit(honest.k_drawn(want=False)), dict)
    asked, release = threading.Event(), threading.Event()
    end = content_id(cheat.end_state())

    def stall(cid: str) -> None:
        if cid == end:
            asked.set()
            release.wait(60)

    cheat.server.hook = stall
    out: list[Any] = []
    submitting = threading.Thread(target=lambda: out.append(cheat.submit(cheat.k_drawn(True))))
    submitting.start()
    try:
        assert asked.wait(30), "the coordinator never asked for the drawn state"
        overdue(coord)
        coord.tick(time.time())  # within the grace: the round waits for the evidence
        assert coord.open_round() is not None
        grace = evidence_grace_s(coord.cfg.limits.request_timeout_s, len(cheat.end_state()))
        coord.tick(time.time() + grace + 1)  # past it: the round commits without it
        assert coord.open_round() is None and coord.state.round == 1
    finally:
        release.set()
        submitting.join(60)
    assert isinstance(out[0], Rejected) and out[0].status == 409, out
    mine = entries_of(coord, cheat.id)
    assert not [e for e in mine if e.type == "contribution accepted"]
    assert [e for e in mine if e.payload.get("withheld") is True]
    accepted = [e for e in entries_of(coord, honest.id) if e.type == "contribution accepted"]
    assert len(accepted) == 1


def test_a_slow_state_within_the_grace_is_waited_for_and_checked(make) -> None:
    """The same slow transfer, ended within the grace: the round waited, and the drawn
    contribution goes in sampled, its states on the coordinator for the validator."""
    coord = make(min_peers=1)
    peer = Peer(coord, "slow")
    coord.tick(time.time())
    asked, release = threading.Event(), threading.Event()
    end = content_id(peer.end_state())
    peer.server.hook = lambda cid: (asked.set(), release.wait(60)) if cid == end else None
    out: list[Any] = []
    submitting = threading.Thread(target=lambda: out.append(peer.submit(peer.k_drawn(True))))
    submitting.start()
    assert asked.wait(30)
    overdue(coord)
    coord.tick(time.time())
    assert coord.open_round() is not None  # waiting for the evidence
    release.set()
    submitting.join(60)
    assert isinstance(out[0], dict), out
    coord.tick(time.time())
    assert coord.state.round == 1 and coord.blobs.has(end)
    accepted = [e for e in entries_of(coord, peer.id) if e.type == "contribution accepted"]
    assert [a.payload["sampled"] for a in accepted] == [True]


class DiskFull:
    """covey.blobs.store's view of `os`: writes fail with ENOSPC while `full` is set."""

    full = False

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: Any) -> int:
        if self.full:
            raise OSError(28, "No space left on device")
        return os.write(fd, data)

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        if self.full:
            raise OSError(28, "No space left on device")
        return os.pwrite(fd, data, offset)


def test_the_coordinators_own_failure_is_not_the_peers(make, monkeypatch) -> None:
    """The coordinator's disk fills while it stores a drawn worker's state: the worker
    is refused (503, "lost"), nothing counts against it, and it may submit again in the
    round's next attempt."""
    coord = make(min_peers=1)
    peer = Peer(coord, "honest")
    disk = DiskFull()
    monkeypatch.setattr(store_mod, "os", disk)
    end = content_id(peer.end_state())
    for attempt in range(2):
        coord.tick(time.time())
        peer.server.hook = lambda cid: setattr(disk, "full", cid == end)
        refused = peer.submit(peer.k_drawn(want=True, start=1000 * attempt))
        disk.full = False
        assert isinstance(refused, Rejected) and refused.status == 503, refused
        assert "no fault of the peer's" in refused.message
        overdue(coord)
        coord.tick(time.time())  # nothing accepted: aborted, the round reopens
        assert coord.open_round() is None or coord.open_round().attempt == attempt + 1
    acc = account(coord, peer.id)
    assert acc.withheld == 0 and not acc.banned and acc.rejected == 2


def test_balances_written_by_an_older_covey_still_verify(make) -> None:
    """ledger-balances.json from before the `withheld` count: it reads as 0."""
    coord = make(min_peers=1)
    peer = Peer(coord, "w")
    coord.tick(time.time())
    assert isinstance(peer.submit(peer.k_drawn(want=False)), dict)
    overdue(coord)
    coord.tick(time.time())
    coord.stop()
    audit.verify(coord.data_dir)
    path = coord.data_dir / "ledger-balances.json"
    old = json.loads(path.read_text())
    for a in old["accounts"].values():
        del a["counts"]["withheld"]
    path.write_text(json.dumps(old))
    audit.verify(coord.data_dir)
    old["accounts"][peer.id]["counts"]["rejected"] = 7  # still compared, field by field
    path.write_text(json.dumps(old))
    with pytest.raises(audit.LedgerError, match="rejected"):
        audit.verify(coord.data_dir)
