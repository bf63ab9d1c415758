"""Attacks on evidence on draw, after its second review (covey.coordinator.intake): a
coordinator that stops while it fetches a drawn contribution's local states must not book
the honest peer as withholding (twice would exclude it), and peers that fill the
coordinator's shared fetch pool must not turn a drawn check into a failure of the
coordinator's own ("lost", no strike): the states are fetched with a client of their own."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import tests.test_evidence as te
from covey.config import load_run_config
from covey.coordinator.auth import _RECEIVED_AT
from covey.coordinator.intake import evidence_grace_s
from covey.coordinator.service import Coordinator
from covey.coordinator.views import Rejected
from covey.protocol import schemas
from covey.protocol.content import content_id
from covey.trust.identity import request_purpose
from tests.test_evidence import SPEC, Peer, account, overdue, signed


class ChainPeer(Peer):
    start: str | None = None
    round_no: int = 0

    def end_state(self) -> bytes:
        n = next(n for n, what in self.coord.uploads.sizes.items() if what == "local state")
        seed = (self.id + f"/{self.round_no}").encode()
        return (seed * (n // len(seed) + 1))[:n]

    def submit(self, k: int, chain: bool = True) -> dict[str, Any] | Rejected:
        rnd = self.coord.open_round()
        assert rnd is not None
        self.round_no = rnd.round
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
        if chain and self.start is not None:
            body["local_state_cid"] = self.start
        path = f"/v1/rounds/{rnd.round}/contributions"
        raw = signed(self.key, body, path, rnd.round)
        token = _RECEIVED_AT.set(request_purpose(path))
        try:
            out = self.coord.submit(rnd.round, schemas.ContributionRequest.model_validate(raw), raw)
            self.start = content_id(end)
            return out
        except Rejected as e:
            self.start = None
            return e
        finally:
            _RECEIVED_AT.reset(token)


def build(tmp_path: Path) -> Coordinator:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(min_peers=1, new=0))
    return Coordinator(load_run_config(spec), tmp_path / "data")


def crash_after_recording(coord: Coordinator, peer: Peer) -> None:
    """The peer's drawn contribution is recorded; the coordinator dies before _secure ends."""
    coord.rounds._secure = lambda req: None  # the process is gone: nothing runs after the record
    out = peer.submit(peer.k_drawn(want=True))
    assert isinstance(out, dict), out
    row = coord.db.one("SELECT evidence FROM local_states WHERE peer_id = ?", (peer.id,))
    assert row["evidence"] == "pending"
    coord.stop()


def test_a_restart_while_fetching_evidence_counts_against_nobody(tmp_path: Path) -> None:
    coord = build(tmp_path)
    peer = Peer(coord, "honest")  # serves both its states, at once, for as long as asked
    coord.tick(time.time())
    crash_after_recording(coord, peer)

    coord = build(tmp_path)  # restart: the round is open again with a fresh deadline
    peer.coord = coord
    try:
        assert coord.open_round() is not None
        again = peer.submit(peer.k_drawn(want=False, start=5000))  # the worker's retry
        assert isinstance(again, Rejected) and again.status == 409
        overdue(coord)
        grace = evidence_grace_s(coord.cfg.limits.request_timeout_s, len(peer.end_state()))
        coord.tick(time.time() + grace + 1)
        acc = account(coord, peer.id)
        # the peer served everything it was asked for (nothing was asked after the crash):
        assert acc.withheld == 0, (
            f"honest peer booked as withholding after a coordinator restart "
            f"(withheld={acc.withheld}, banned={acc.banned})"
        )
    finally:
        coord.stop()


def test_two_restarts_do_not_exclude_an_honest_peer(tmp_path: Path) -> None:
    coord = build(tmp_path)
    peer, other = Peer(coord, "honest"), ChainPeer(coord, "other")
    try:
        for i in range(2):
            coord.tick(time.time())
            rnd = coord.open_round()
            assert rnd is not None and rnd.round == i, rnd
            assert isinstance(other.submit(other.k_drawn(want=False, start=777 * (i + 1))), dict)
            coord.rounds._secure = lambda req: None  # crash right after the record
            out = peer.submit(peer.k_drawn(want=True, start=10000 * (i + 1)))
            assert isinstance(out, dict), out
            coord.stop()
            coord = build(tmp_path)
            peer.coord = other.coord = coord
            overdue(coord)
            grace = evidence_grace_s(coord.cfg.limits.request_timeout_s, len(peer.end_state()))
            coord.tick(time.time() + grace + 1)  # commits with `other` only
            assert coord.state.round == i + 1
        acc = account(coord, peer.id)
        assert not acc.banned, f"banned after two coordinator restarts (withheld={acc.withheld})"
    finally:
        coord.stop()


POOL = 16  # BlobClient: max(16, 4 * parallel)


class Server:
    """A blob server: `trickle` cids go out at ~80 KiB/s (headers at once), `close` cids
    end their connection; `on_get(cid)` runs before answering."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.requested: list[str] = []
        self.trickle: set[str] = set()
        self.close: set[str] = set()
        self.on_get: Any = None
        me = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                cid = self.path.rsplit("/", 1)[-1]
                me.requested.append(cid)
                if me.on_get is not None:
                    me.on_get(cid)
                data = me.blobs.get(cid)
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                if cid in me.close:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                if cid in me.trickle:
                    for i in range(0, len(data), 32 << 10):
                        self.wfile.write(data[i : i + (32 << 10)])
                        self.wfile.flush()
                        time.sleep(0.4)
                else:
                    self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


def _peer(coord: Coordinator, name: str) -> Peer:
    p = Peer.__new__(Peer)
    srv = Server()
    # Peer.__init__ makes its own BlobServer; register ours instead
    orig = te.BlobServer
    te.BlobServer = lambda: srv  # type: ignore[assignment]
    try:
        Peer.__init__(p, coord, name)
    finally:
        te.BlobServer = orig
    return p


def test_peers_filling_the_fetch_pool_cannot_void_a_drawn_check(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(min_peers=1, new=0) + "[limits]\nrequest_timeout_s = 2.0\n")
    coord = Coordinator(load_run_config(spec), tmp_path / "data")
    try:
        cheat = _peer(coord, "cheat")
        sybils = [_peer(coord, f"sybil{i}") for i in range(POOL)]
        coord.tick(time.time())
        rnd = coord.open_round()
        assert rnd is not None and cheat.id in rnd.members
        asked = threading.Semaphore(0)
        results: dict[str, Any] = {}
        for s in sybils:  # they trickle their (valid, undrawn) payloads
            k = s.k_drawn(want=False)
            pl = s.payload(k)
            s.server.trickle.add(content_id(pl))
            s.server.on_get = lambda cid: asked.release()
            s._k = k  # type: ignore[attr-defined]
        k = cheat.k_drawn(want=True)
        payload = cheat.payload(k)
        cheat.server.close.add(content_id(payload))
        threads: list[threading.Thread] = []

        def fill_pool(cid: str) -> None:  # as the coordinator pulls the cheat's payload
            if cid != content_id(payload) or threads:
                return
            for s in sybils:
                t = threading.Thread(target=lambda s=s: results.__setitem__(s.id, s.submit(s._k)))
                t.start()
                threads.append(t)
            for _ in range(POOL - 1):  # every connection but the cheat's own is busy
                assert asked.acquire(timeout=20)
            time.sleep(0.5)  # the last sybil queues for the connection the cheat frees

        cheat.server.on_get = fill_pool
        out = cheat.submit(k)
        for t in threads:
            t.join(60)
        end = content_id(cheat.end_state())
        print("cheat:", out, "| state asked:", end in cheat.server.requested)
        print("sybils accepted:", sum(isinstance(v, dict) for v in results.values()), "/", POOL)
        overdue(coord)
        coord.tick(time.time())
        acc = account(coord, cheat.id)
        assert not (isinstance(out, Rejected) and out.status == 503 and acc.withheld == 0), (
            f"drawn, states never delivered, yet no strike: {out.message!r}; "
            f"withheld={acc.withheld}; sybils accepted: "
            f"{sum(isinstance(v, dict) for v in results.values())}/{POOL}"
        )
    finally:
        coord.stop()
