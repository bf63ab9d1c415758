"""Attacks on evidence on draw (covey.coordinator.intake): a
coordinator that stops while it fetches a drawn contribution's local states must not book
the honest peer as withholding (twice would exclude it), and peers that fill the
coordinator's shared fetch pool must not turn a drawn check into a failure of the
coordinator's own ("lost", no strike): the states are fetched with a client of their own."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from covey.config import load_run_config
from covey.coordinator.intake import evidence_grace_s
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
        n = next(n for n, what in self.coord.uploads.sizes.items() if what == "local state")
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


def test_peers_filling_the_fetch_pool_cannot_void_a_drawn_check(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(min_peers=1, new=0) + "[limits]\nrequest_timeout_s = 2.0\n")
    coord = Coordinator(load_run_config(spec), tmp_path / "data")
    try:
        cheat = Peer(coord, "cheat")
        sybils = [Peer(coord, f"sybil{i}") for i in range(POOL)]
        coord.tick(time.time())
        rnd = coord.open_round()
        assert rnd is not None and cheat.id in rnd.members
        asked = threading.Semaphore(0)
        results: dict[str, Any] = {}
        for s in sybils:  # they trickle their (valid, undrawn) payloads
            k = s.k_drawn(want=False)
            pl = s.payload(k)
            s.server.trickle.add(content_id(pl))
            s.server.hook = lambda cid: asked.release()
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

        cheat.server.hook = fill_pool
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


def build_with(tmp_path: Path, new: int = 0, extra: str = "") -> Coordinator:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(min_peers=1, new=new) + extra)
    return Coordinator(load_run_config(spec), tmp_path / "data")


def test_secured_contributions_do_not_stretch_a_stallers_grace(tmp_path: Path) -> None:
    """The grace grows with the fetches under way, not with the round's secured ones: one
    staller among six secured drawn contributions holds the close only its own grace."""
    coord = build_with(tmp_path, new=100)  # every contribution is drawn (new_peer_rate 1.0)
    try:
        honest = [Peer(coord, f"honest{i}") for i in range(6)]
        staller = Peer(coord, "staller")
        coord.tick(time.time())
        for p in honest:
            out = p.submit(0)
            assert isinstance(out, dict), out  # drawn, states fetched at once: secured
        rows = coord.db.query("SELECT evidence FROM local_states")
        assert [r["evidence"] for r in rows] == ["secured"] * 6
        coord.rounds._secure = lambda req: None  # its states trickle: the fetch is in flight
        assert isinstance(staller.submit(0), dict)
        overdue(coord)
        sub = coord.db.one(
            "SELECT submitted_at FROM contributions WHERE peer_id = ?", (staller.id,)
        )["submitted_at"]
        size = len(staller.end_state())
        alone = evidence_grace_s(coord.cfg.limits.request_timeout_s, size)  # the only fetch left
        now_bound = evidence_grace_s(coord.cfg.limits.request_timeout_s, size, 7)
        print(f"state {size} B: grace alone {alone:.1f} s, granted now {now_bound:.1f} s")
        coord.tick(sub + alone + 1)
        assert coord.state.round == 1, (
            f"round still open {alone + 1:.1f} s after the only pending fetch began: the staller "
            f"gets {now_bound:.1f} s because 6 finished fetches count as sharing its link"
        )
    finally:
        coord.stop()


def test_a_withheld_fetch_is_cut_at_the_close(tmp_path: Path) -> None:
    """A stalled fetch refused at the close is cut short: its request thread and
    connections are free within seconds of the commit, not after the client's own bound
    (hours at 124M), so stallers cannot pile up the coordinator's request threads."""
    extra = "[limits]\nrequest_timeout_s = 3.0\n"
    coord = build_with(tmp_path, new=100, extra=extra)
    release = threading.Event()
    outs: list[Any] = []
    try:
        stallers = [Peer(coord, f"stall{i}") for i in range(4)]
        honest = Peer(coord, "honest")
        coord.tick(time.time())
        assert isinstance(honest.submit(0), dict)  # drawn, secured: the round has one
        asked = threading.Semaphore(0)

        def hold(p: Peer) -> Any:
            end = content_id(p.end_state())

            def hook(cid: str) -> None:
                if cid == end:
                    asked.release()
                    release.wait(120)  # headers never come: each read waits out the timeout

            return hook

        threads = []
        for p in stallers:
            p.server.hook = hold(p)
            t = threading.Thread(target=lambda p=p: outs.append(p.submit(0)), daemon=True)
            t.start()
            threads.append(t)
        for _ in stallers:
            assert asked.acquire(timeout=30)
        overdue(coord)
        size = len(stallers[0].end_state())
        grace = evidence_grace_s(3.0, size, len(stallers) + 1)
        coord.tick(time.time() + grace + 1)  # past the grace: committed, all four withheld
        assert coord.state.round == 1
        assert all(account(coord, p.id).withheld == 1 for p in stallers)
        t0 = time.time()
        for t in threads:
            t.join(max(0.1, 6 - (time.time() - t0)))
        alive = sum(t.is_alive() for t in threads)
        assert alive == 0, (
            f"{alive} of {len(threads)} submissions refused as withheld still hold a request "
            f"thread and a connection {time.time() - t0:.0f} s after their round committed"
        )
    finally:
        release.set()
        coord.stop()


def test_restart_lost_books_consistently_and_the_peer_goes_on(tmp_path: Path) -> None:
    """Lost at a restart: the round commits in the same attempt without it, the peer
    starts fresh in the next round and is accepted; the ledger verifies."""
    coord = build(tmp_path)
    peer, other = ChainPeer(coord, "lost"), ChainPeer(coord, "other")
    coord.tick(time.time())
    assert isinstance(other.submit(other.k_drawn(want=False)), dict)
    coord.rounds._secure = lambda req: None
    assert isinstance(peer.submit(peer.k_drawn(want=True)), dict)
    coord.stop()
    coord = build(tmp_path)
    peer.coord = other.coord = coord
    try:
        row = coord.db.one("SELECT evidence FROM local_states WHERE peer_id = ?", (peer.id,))
        assert row["evidence"] == "lost"
        overdue(coord)
        coord.tick(time.time())  # nothing pending: commits at once with `other`
        assert coord.state.round == 1
        cert = coord.certificate(0)
        assert [a.peer_id for a in cert.accepted] == [other.id]
        coord.tick(time.time())  # opens round 1
        # the worker got 401 (replayed nonce) on its retry -> submitted=False -> fresh start
        chained = peer.submit(peer.k_drawn(want=False, start=500), chain=True)
        assert isinstance(chained, Rejected) and chained.status == 422, chained
        fresh = peer.submit(peer.k_drawn(want=False, start=900), chain=False)
        assert isinstance(fresh, dict), fresh
        assert isinstance(other.submit(other.k_drawn(want=False, start=77)), dict)
        overdue(coord)
        coord.tick(time.time())
        assert coord.state.round == 2
        acc = account(coord, peer.id)
        assert acc.withheld == 0 and not acc.banned
    finally:
        coord.stop()
    audit.verify(coord.data_dir)
