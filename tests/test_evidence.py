"""Evidence off the critical path (covey.coordinator.intake): a stateful contribution's local
states never cross the coordinator's link at intake, drawn or not; a drawn one is recorded
(no second submission in its round), its round never waits for its states, and its states
stay on the worker's blob server for the drawn validators (tests/test_offpath.py: their
fetch, withholding and late conviction). An in-process coordinator driven by hand, and
test peers whose blob servers on 127.0.0.1 do what each test says."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from covey.blobs import BlobClient, BlobError
from covey.config import load_run_config
from covey.coordinator.auth import _RECEIVED_AT
from covey.coordinator.rejected import Rejected
from covey.coordinator.service import Coordinator
from covey.io import audit
from covey.protocol import schemas
from covey.protocol.content import content_id
from covey.trust.certify import sample
from covey.trust.identity import Identity, request_purpose
from covey.trust.incentives import Book
from covey.trust.ledger import read_entries
from tests.treasury_helpers import fund

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
min_stake = 0.0  # these peers join unfunded: what is tested is the evidence, not the stake
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

    def __init__(self, coord: Coordinator, name: str, stake: float = 0.0) -> None:
        self.coord, self.key, self.server = coord, Identity.generate(), BlobServer()
        self.id = self.key.peer_id
        fund(coord, self.key.public_key, stake)  # the run's owner funds what it bonds
        body = {
            "run_id": coord.run_id, "peer_id": self.id, "public_key": self.key.public_key,
            "name": name, "step_time_s": 0.01, "accepts_connections": True,
            "blob_url": self.server.url, "stake": stake,
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
        n = self.coord.rounds.evidence_size  # a published end state's size
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
    """Undrawn or drawn, no end state is asked for at intake: both are accepted, and the
    drawn one's states stay with its worker. A second submission to the round (another
    payload, another draw) is refused without asking for anything."""
    coord = make(min_peers=1)
    honest, drawn = Peer(coord, "honest"), Peer(coord, "drawn")
    coord.tick(time.time())
    undrawn = honest.submit(honest.k_drawn(want=False))
    assert isinstance(undrawn, dict), undrawn
    assert content_id(honest.end_state()) not in honest.server.requested
    k = drawn.k_drawn(want=True)
    first = drawn.submit(k)
    assert isinstance(first, dict), first
    end = content_id(drawn.end_state())
    assert end not in drawn.server.requested and not coord.blobs.has(end)
    asked = len(drawn.server.requested)
    again = drawn.submit(drawn.k_drawn(want=False, start=k + 1))
    assert isinstance(again, Rejected) and again.status == 409, again
    assert len(drawn.server.requested) == asked  # refused before anything was fetched
    assert account(coord, drawn.id).withheld == 0


def test_what_a_dishonest_peer_names_for_its_local_states(make) -> None:
    """A size that is not the run's local-state size, another peer's end state as its
    start: refused before anything is fetched or drawn. Bytes that do not hash to the end
    state it named (served under that id) are accepted at intake, which fetches nothing,
    and no validator's fetch takes them (the blob client checks the content id)."""
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
    end_cid = content_id(end)
    forged = b"x" * len(end)  # the right size, the wrong bytes, under the named id
    liar.server.hook = lambda cid: liar.server.blobs.update({cid: forged} if cid == end_cid else {})
    assert isinstance(liar.submit(k), dict)
    assert end_cid not in liar.server.requested and not coord.blobs.has(end_cid)
    with BlobClient(timeout_s=5, retries=1) as client, pytest.raises(BlobError):
        client.fetch(end_cid, [liar.server.url], size=len(end))


def test_a_stall_past_the_grace_is_withheld_and_the_round_goes_on(make) -> None:
    """A drawn worker whose blob server stalls every request holds nothing: the round
    commits at its deadline with the drawn contribution in it, sampled, and nothing was
    asked of the stalling server (its validators ask it later, with their own deadline:
    tests/test_offpath.py)."""
    coord = make(min_peers=2)
    honest, staller = Peer(coord, "honest"), Peer(coord, "staller")
    coord.tick(time.time())
    assert isinstance(honest.submit(honest.k_drawn(want=False)), dict)
    release = threading.Event()
    end = content_id(staller.end_state())
    staller.server.hook = lambda cid: release.wait(60) if cid == end else None
    try:
        assert isinstance(staller.submit(staller.k_drawn(True)), dict)
        overdue(coord)
        coord.tick(time.time())  # the deadline: the round commits, nothing is waited for
        assert coord.open_round() is None and coord.state.round == 1
    finally:
        release.set()
    assert end not in staller.server.requested
    mine = entries_of(coord, staller.id)
    assert [e.payload["sampled"] for e in mine if e.type == "contribution accepted"] == [True]
    assert not [e for e in mine if e.payload.get("withheld") is True]


def test_a_slow_state_within_the_grace_is_waited_for_and_checked(make) -> None:
    """A slow provider is not waited for either: the round commits as soon as every member
    submitted, the drawn contribution sampled and assigned for checking, its states on the
    worker, none on the coordinator."""
    coord = make(min_peers=1)
    peer = Peer(coord, "slow")
    coord.tick(time.time())
    end = content_id(peer.end_state())
    peer.server.trickle.add(end)
    assert isinstance(peer.submit(peer.k_drawn(True)), dict)
    coord.tick(time.time())
    assert coord.state.round == 1 and not coord.blobs.has(end)
    accepted = [e for e in entries_of(coord, peer.id) if e.type == "contribution accepted"]
    assert [a.payload["sampled"] for a in accepted] == [True]
    pending = coord.db.query("SELECT status FROM verifications WHERE peer_id = ?", (peer.id,))
    assert [r["status"] for r in pending] == ["pending"]


def test_the_coordinators_own_failure_is_not_the_peers(make) -> None:
    """The coordinator stops and restarts with a drawn check still open: the check is
    still there for a validator, the contribution stands, and nothing counts against its
    worker (the coordinator never held its states, so has nothing to lose of them)."""
    coord = make(min_peers=1)
    peer = Peer(coord, "honest")
    coord.tick(time.time())
    assert isinstance(peer.submit(peer.k_drawn(want=True)), dict)
    coord.tick(time.time())
    assert coord.state.round == 1
    coord.stop()
    again = make(min_peers=1)
    assert again.state.round == 1
    pending = again.db.query("SELECT status FROM verifications WHERE peer_id = ?", (peer.id,))
    assert [r["status"] for r in pending] == ["pending"]
    acc = account(again, peer.id)
    assert acc.withheld == 0 and not acc.banned and acc.rejected == 0


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
