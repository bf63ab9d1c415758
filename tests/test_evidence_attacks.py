"""Attacks on evidence off the critical path (covey.coordinator.intake): the coordinator
fetches no drawn contribution's local states, so a coordinator that stops with a drawn
contribution recorded books nobody as withholding, however often; many drawn peers (or
stallers) neither delay the close nor void a drawn check; no request thread waits on a
staller; and a restart keeps the chain and the ledger consistent."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from covey.config import load_run_config
from covey.coordinator.rejected import Rejected
from covey.coordinator.service import Coordinator
from covey.io import audit
from covey.protocol.content import content_id
from tests.test_evidence import SPEC, Peer, account, overdue


class ChainPeer(Peer):
    """A Peer that continues its local-state chain: it names its last end state."""

    start: str | None = None
    round_no: int = 0

    def end_state(self) -> bytes:
        n = self.coord.rounds.evidence_size  # a published end state's size
        seed = (self.id + f"/{self.round_no}").encode()
        return (seed * (n // len(seed) + 1))[:n]

    def submit(
        self, k: int, start_cid: str | None = None, chain: bool = True
    ) -> dict[str, Any] | Rejected:
        """Submit payload k, naming its previous accepted end state (unless not `chain`)."""
        rnd = self.coord.open_round()
        assert rnd is not None
        self.round_no = rnd.round
        out = super().submit(k, self.start if chain else start_cid)
        self.start = content_id(self.end_state()) if isinstance(out, dict) else None
        return out


def build(tmp_path: Path, new: int = 0, min_peers: int = 1) -> Coordinator:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(min_peers=min_peers, new=new))
    return Coordinator(load_run_config(spec), tmp_path / "data")


def crash_after_recording(coord: Coordinator, peer: Peer) -> None:
    """The peer's drawn contribution is recorded (its check pending); the coordinator
    stops before the round closes."""
    out = peer.submit(peer.k_drawn(want=True))
    assert isinstance(out, dict), out
    row = coord.db.one("SELECT evidence FROM local_states WHERE peer_id = ?", (peer.id,))
    assert row["evidence"] == "pending"
    coord.stop()


def test_a_restart_while_fetching_evidence_counts_against_nobody(tmp_path: Path) -> None:
    """Stopped with a drawn contribution recorded: at the restart it is still in its round,
    which commits with it, sampled; nothing counts against its peer."""
    coord = build(tmp_path)
    peer = Peer(coord, "honest")
    coord.tick(time.time())
    crash_after_recording(coord, peer)
    coord = build(tmp_path)
    try:
        overdue(coord)
        coord.tick(time.time())
        assert coord.state.round == 1
        acc = account(coord, peer.id)
        assert acc.withheld == 0 and acc.rejected == 0 and acc.contributions == 1
    finally:
        coord.stop()


def test_two_restarts_do_not_exclude_an_honest_peer(tmp_path: Path) -> None:
    """Two rounds, each stopped with the peer's drawn contribution recorded: both commit
    after the restart, chained, and the peer is neither withholding nor excluded."""
    coord = build(tmp_path)
    peer = ChainPeer(coord, "honest")
    for i in range(2):
        coord.tick(time.time())
        assert isinstance(peer.submit(peer.k_drawn(want=True, start=1000 * i)), dict)
        coord.stop()
        coord = build(tmp_path)
        peer.coord = coord
        overdue(coord)
        coord.tick(time.time())
        assert coord.state.round == i + 1
    try:
        acc = account(coord, peer.id)
        assert acc.withheld == 0 and not acc.banned and acc.contributions == 2
    finally:
        coord.stop()


def test_peers_filling_the_fetch_pool_cannot_void_a_drawn_check(tmp_path: Path) -> None:
    """Many drawn peers at once (once enough to fill a shared fetch pool): each is
    accepted at once and sampled; none of their servers is asked for a local state."""
    coord = build(tmp_path, new=100, min_peers=5)  # every contribution is drawn
    try:
        peers = [Peer(coord, f"p{i}") for i in range(5)]
        coord.tick(time.time())
        for p in peers:
            assert isinstance(p.submit(p.k_drawn(want=True)), dict)
        coord.tick(time.time())
        assert coord.state.round == 1
        for p in peers:
            assert content_id(p.end_state()) not in p.server.requested
        rows = coord.db.query("SELECT status FROM verifications")
        assert [r["status"] for r in rows] == ["pending"] * 5
    finally:
        coord.stop()


def test_secured_contributions_do_not_stretch_a_stallers_grace(tmp_path: Path) -> None:
    """Six prompt drawn peers and one whose server stalls every request: the round
    commits as soon as all submitted; the staller's contribution is in it, its check
    pending for its validators."""
    coord = build(tmp_path, new=100, min_peers=7)
    release = threading.Event()
    try:
        peers = [Peer(coord, f"honest{i}") for i in range(6)]
        staller = Peer(coord, "staller")
        end = content_id(staller.end_state())
        staller.server.hook = lambda cid: release.wait(60) if cid == end else None
        coord.tick(time.time())
        for p in [*peers, staller]:
            assert isinstance(p.submit(p.k_drawn(want=True)), dict)
        coord.tick(time.time())
        assert coord.state.round == 1 and end not in staller.server.requested
    finally:
        release.set()
        coord.stop()


def test_a_withheld_fetch_is_cut_at_the_close(tmp_path: Path) -> None:
    """No request thread waits on a staller: a drawn contribution's submission is answered
    without a request to its server for its states, so stallers pile up nothing."""
    coord = build(tmp_path, new=100)
    release = threading.Event()
    try:
        staller = Peer(coord, "staller")
        end = content_id(staller.end_state())
        staller.server.hook = lambda cid: release.wait(60) if cid == end else None
        coord.tick(time.time())
        t0 = time.monotonic()
        assert isinstance(staller.submit(staller.k_drawn(want=True)), dict)
        assert time.monotonic() - t0 < 50  # under the staller's 60 s hold
        assert end not in staller.server.requested
        busy = [t for t in threading.enumerate() if "fetch" in t.name.lower()]
        assert not busy, busy
    finally:
        release.set()
        coord.stop()


def test_restart_lost_books_consistently_and_the_peer_goes_on(tmp_path: Path) -> None:
    """A restart with a drawn contribution recorded: the round commits in the same attempt
    with it, the peer continues its chain in the next round and is accepted; the ledger
    verifies."""
    coord = build(tmp_path, min_peers=2)
    peer, other = ChainPeer(coord, "drawn"), ChainPeer(coord, "other")
    coord.tick(time.time())
    assert isinstance(other.submit(other.k_drawn(want=False)), dict)
    assert isinstance(peer.submit(peer.k_drawn(want=True)), dict)
    coord.stop()
    coord = build(tmp_path, min_peers=2)
    try:
        overdue(coord)
        coord.tick(time.time())
        assert coord.state.round == 1
        coord.tick(time.time())
        for p in (peer, other):
            p.coord = coord
            assert isinstance(p.submit(p.k_drawn(want=False, start=1000)), dict)
        coord.tick(time.time())
        assert coord.state.round == 2
    finally:
        coord.stop()
    audit.verify(coord.data_dir)
