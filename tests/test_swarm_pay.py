"""Pay per verified microbatch (covey.swarm.evidence, covey.swarm.paydesk): only evidence of
an agreed check pays, each request once; every lie a trainer or a colluding server could
tell in a report is refused and pays nothing; a drawn spot check recomputes and convicts
two servers that agreed on a reply nobody computed. And a duplicated backward (the check
hop) is not accumulated a second time. In-process coordinator (FastAPI TestClient, signed
requests), real stages, real signatures; the referee fetches states over 127.0.0.1."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from covey.blobs import BlobServer, BlobStore
from covey.swarm import compute
from covey.swarm.wire import (
    build_stage,
    encode_tensor,
    pack,
    reply_message,
    sha,
    state_bytes,
    unpack,
)
from covey.trust.identity import Identity
from tests.treasury_helpers import fund

SETTINGS = dict(n_layer=2, n_embd=16, n_head=2, seq_len=8, stages=2, microbatch=4,
                verify_rate=0.25)  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Desk:
    """A swarm coordinator with servers a, b (stage 0), c (stage 1) synced on stage 0's
    initial state (served by a blob server, for the referee), and a trainer t."""

    def __init__(self, tmp: Path, **settings: Any) -> None:
        from fastapi.testclient import TestClient

        from covey.swarm.app import create_app
        from covey.swarm.config import SwarmConfig
        from covey.swarm.service import SwarmCoordinator

        self.cfg = SwarmConfig(**{**SETTINGS, **settings})
        self.coord = SwarmCoordinator(self.cfg, tmp / "run")
        self.coord._seed_states()  # what start() runs in a thread
        self.client, run = TestClient(create_app(self.coord)), self.coord.run_id
        self.stage = build_stage(self.cfg, 0)
        data = state_bytes(self.stage)
        store = BlobStore(tmp / "states")
        self.state = store.put(data)
        # before the first round the agreed state is the seed's, computed by the coordinator
        assert self.coord.averaging.stages[0].agreed == self.state
        assert self.coord.blobs.has(self.state)  # a server moved to an unserved stage fetches it
        self.blobs = BlobServer(store)
        self.blobs.start()
        self.ids = {n: Identity.generate() for n in "abct"}
        for n, ident in self.ids.items():
            fund(self.coord, ident.public_key, 10.0)  # the owner funds what each stakes
            body = {"run_id": run, "peer_id": ident.peer_id, "public_key": ident.public_key,
                    "name": n, "role": "trainer" if n == "t" else "server", "stake": 10.0,
                    "url": "http://127.0.0.1:9", "blob_url": self.blobs.url,
                    "stage": int(n == "c")}  # fmt: skip
            assert self.post(n, "/v1/swarm/join", body).status_code == 200
        for n in "ab":
            body = {"run_id": run, "peer_id": self.ids[n].peer_id, "stage": 0, "step": 0,
                    "state": self.state, "pending": 0, "throughput": 1.0, "queue": 0}  # fmt: skip
            assert self.post(n, "/v1/swarm/heartbeat", body).status_code == 200
        self.step = 0

    def post(self, who: str, path: str, body: dict) -> Any:
        signed = self.ids[who].sign_request(body, -1, purpose=f"POST {path}")
        return self.client.post(path, json=signed)

    def pid(self, who: str) -> str:
        return self.ids[who].peer_id

    def vouch(self, *servers: str, microbatches: int = 1) -> None:
        """Trainer t reports SERVERS served these microbatches (pending samples count only
        as far as a trainer vouches for them)."""
        body = {"run_id": self.coord.run_id, "peer_id": self.pid("t"), "samples": 0,
                "loss": None, "reroutes": 0, "banned": {},
                "served": {self.pid(n): microbatches for n in servers}}  # fmt: skip
        assert self.post("t", "/v1/swarm/report", body).status_code == 200

    def request(self) -> bytes:
        self.step += 1
        g = torch.Generator().manual_seed(self.step)
        return pack(encode_tensor(torch.randint(0, 256, (4, 8), generator=g), "int8"))

    def reply(self, who: str, request: bytes, out: bytes | None = None, state: str = "") -> dict:
        """Server `who`'s signed reply (honest unless `out` is given)."""
        out = out if out is not None else compute.forward(self.cfg, 0, self.stage, request)
        state = state or self.state
        sig = self.ids[who].sign(reply_message(0, state, sha(request), sha(out)))
        return {"server": self.pid(who), "state": state, "sig": sig,
                "reply": base64.b64encode(out).decode()}  # fmt: skip

    def check(self, request: bytes, first: dict, second: dict) -> dict:
        return {"stage": 0, "kind": "forward", "request": base64.b64encode(request).decode(),
                "replies": [first, second]}  # fmt: skip

    def report(self, checks: list, served: dict | None = None, who: str = "t") -> Any:
        body = {"run_id": self.coord.run_id, "peer_id": self.pid(who), "samples": 4,
                "loss": 3.0, "reroutes": 0, "banned": {}, "served": served or {},
                "checks": checks}  # fmt: skip
        return self.post(who, "/v1/swarm/report", body)

    def close(self) -> None:
        self.blobs.close()
        self.coord._stop.set()
        self.coord.db.close()


@pytest.fixture
def desk(tmp_path: Path) -> Iterator[Desk]:
    d = Desk(tmp_path, spot_check_rate=0.0)
    yield d
    d.close()


def test_an_agreed_check_pays_both_servers_once_and_a_trainers_word_pays_nothing(
    desk: Desk,
) -> None:
    req = desk.request()
    honest = desk.check(req, desk.reply("a", req), desk.reply("b", req))
    r = desk.report([honest], served={desk.pid("a"): 10_000, desk.pid("b"): 10_000})
    assert r.status_code == 200 and r.json()["checks"] == ["paid"]
    one = 4 * 8  # tokens of a microbatch; the routed server is paid for 1 / verify_rate
    assert desk.coord.unpaid == {desk.pid("a"): 4 * one, desk.pid("b"): one}
    assert "paid already" in desk.report([honest]).json()["checks"][0]  # replayed
    desk.coord.pay(now=0.0)
    book = desk.coord.accounts.book
    assert book.accounts[desk.pid("a")].balance == pytest.approx(book.work_reward(4 * one))
    assert book.accounts[desk.pid("b")].balance == pytest.approx(book.work_reward(one))


def test_every_lie_in_a_check_is_refused_and_pays_nothing(desk: Desk) -> None:
    req = desk.request()
    a, b = desk.reply("a", req), desk.reply("b", req)
    wrong = compute.forward(desk.cfg, 0, desk.stage, desk.request())  # another request's
    b_out = base64.b64decode(b["reply"])
    forged = {**b, "sig": desk.ids["t"].sign(reply_message(0, desk.state, sha(req), sha(b_out)))}
    lies = {
        "trainer signs for b": desk.check(req, a, forged),
        "a's reply swapped": desk.check(req, {**a, "reply": base64.b64encode(wrong).decode()}, b),
        "both signed, disagree": desk.check(req, a, desk.reply("b", req, out=wrong)),
        "one server twice": desk.check(req, a, a),
        "trainer as server": desk.check(req, a, desk.reply("t", req)),
        "other stage's server": desk.check(req, a, desk.reply("c", req)),
        "more replies": {**desk.check(req, a, b), "replies": [a, b, b]},
        "stage out of range": {**desk.check(req, a, b), "stage": 5},
        "kind": {**desk.check(req, a, b), "kind": "sideways"},
        "not base64": {**desk.check(req, a, b), "request": "***"},
        "not an object": "paid please",
    }
    r = desk.report(list(lies.values()))
    assert r.status_code == 200, r.text
    outcomes = dict(zip(lies, r.json()["checks"], strict=True))
    assert all(o.startswith("refused") for o in outcomes.values()), outcomes
    assert "signature" in outcomes["trainer signs for b"]
    assert "signature" in outcomes["a's reply swapped"]
    assert "disagree" in outcomes["both signed, disagree"]
    assert desk.coord.unpaid == {}
    # a server is no trainer: it cannot report (and pay itself); bodies that are no list: 422
    assert desk.report([desk.check(req, a, b)], who="a").status_code == 403
    assert desk.report("checks").status_code == 422  # type: ignore[arg-type]
    assert desk.report([{}] * 257).status_code == 422
    assert desk.report([desk.check(req, a, b)]).json()["checks"] == ["paid"]  # the truth pays
    paid = dict(desk.coord.unpaid)
    # a state no majority ever agreed on is parked, then refused once its time is up
    odd = "f" * 64
    fake = desk.check(req, desk.reply("a", req, state=odd), desk.reply("b", req, state=odd))
    assert desk.report([fake]).json()["checks"] == ["parked"]
    desk.coord.tick(desk.coord._last_payout + 3 * desk.cfg.round_timeout_s)
    assert desk.coord._parked == [] and desk.coord.unpaid in ({}, paid)  # (paid out, or not)
    book = desk.coord.accounts.book
    assert book.accounts[desk.pid("a")].balance <= book.work_reward(4 * 32)


def test_a_spot_check_convicts_two_servers_that_agree_on_a_reply_nobody_computed(
    tmp_path: Path,
) -> None:
    desk = Desk(tmp_path, spot_check_rate=1.0)
    try:
        req = desk.request()
        assert desk.report([desk.check(req, desk.reply("a", req), desk.reply("b", req))]).json()[
            "checks"
        ] == ["paid"]  # recomputed by the referee: both right
        req = desk.request()
        fake = compute.forward(desk.cfg, 0, desk.stage, desk.request())  # not this request's
        lie = desk.check(req, desk.reply("a", req, out=fake), desk.reply("b", req, out=fake))
        out = desk.report([lie]).json()["checks"]
        assert "convicted" in out[0]
        book = desk.coord.accounts.book
        assert book.accounts[desk.pid("a")].banned and book.accounts[desk.pid("b")].banned
        assert desk.coord.unpaid == {}  # their earlier verified pay is void too
        desk.coord.pay(now=0.0)
        assert book.accounts[desk.pid("a")].balance <= 10.0
    finally:
        desk.close()


def test_a_check_hop_is_not_accumulated_a_second_time() -> None:
    from covey.swarm.config import SwarmConfig
    from covey.swarm.server import StageServer

    cfg = SwarmConfig(**SETTINGS)
    server = StageServer("http://127.0.0.1:9", name="s")
    try:
        server.cfg, server.k, server.state = cfg, 0, "s0"
        server.stage = stage = build_stage(cfg, 0)
        ids = torch.randint(0, 256, (4, 8))
        body = pack(encode_tensor(ids, "plain"), encode_tensor(torch.randn(4, 8, 16), "plain"))
        first, _ = server.handle("backward", 0, body)
        grads = [p.grad.clone() for p in stage.params]  # type: ignore[union-attr]
        assert stage.samples == 4
        again, _ = server.handle("backward", 0, body, check=True)
        assert compute.reply_distance(first, again) == 0.0  # the same answer, signed
        assert stage.samples == 4  # ... but counted once
        assert all(torch.equal(p.grad, g) for p, g in zip(stage.params, grads, strict=True))
        server.handle("backward", 0, body)
        assert stage.samples == 8
    finally:
        server.tmp.cleanup()


def test_checks_on_made_up_states_cannot_fill_the_coordinators_memory(desk: Desk) -> None:
    from covey.swarm.paydesk import MAX_PARKED

    req = desk.request()
    odd = "e" * 64
    fake = desk.check(req, desk.reply("a", req, state=odd), desk.reply("b", req, state=odd))
    for _ in range(MAX_PARKED // 256):
        assert desk.report([fake] * 256).json()["checks"] == ["parked"] * 256
    assert "too many" in desk.report([fake]).json()["checks"][0]
    assert len(desk.coord._parked) == MAX_PARKED


def _sybil_sum(shapes: list, samples: int, scale: float = 1.0) -> bytes:
    g = torch.Generator().manual_seed(1)
    t = {f"g.{i}": scale * torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    t["samples"] = torch.tensor([samples], dtype=torch.int64)
    return save(t)


def test_sybil_servers_without_vouched_work_get_no_vote(tmp_path: Path) -> None:
    """A hole once open: a server that no trainer sent work joined an averaging
    round (synced servers are members whatever their pending count), reported a zero sum
    claiming samples, and so became a voter; two such sybils outvoted the honest server,
    which was told to resync to their state. Only samples trainers vouched for vote now."""
    torch.set_num_threads(1)
    desk = Desk(tmp_path, spot_check_rate=0.0, target_samples=8)
    try:
        coord, run = desk.coord, desk.coord.run_id
        desk.ids["d"] = Identity.generate()  # a second sybil key on stage 0
        fund(coord, desk.ids["d"].public_key, 10.0)  # funded: it bonds what it holds
        body = {"run_id": run, "peer_id": desk.pid("d"), "public_key": desk.ids["d"].public_key,
                "name": "d", "role": "server", "stake": 10.0, "url": "http://127.0.0.1:9",
                "blob_url": desk.blobs.url, "stage": 0}  # fmt: skip
        assert desk.post("d", "/v1/swarm/join", body).status_code == 200

        def beat(n: str, step: int, state: str, pending: int = 0) -> dict:
            b = {"run_id": run, "peer_id": desk.pid(n), "stage": 0, "step": step,
                 "state": state, "pending": pending, "throughput": 1.0, "queue": 0}  # fmt: skip
            r = desk.post(n, "/v1/swarm/heartbeat", b)
            assert r.status_code == 200
            return r.json()

        desk.vouch("a", microbatches=2)  # only a served trainers: 8 samples = the target
        for n in "abd":
            beat(n, 0, desk.state, pending=8)  # b, d claim pending work nobody vouched for
        coord.tick(coord._last_payout + 0.1)
        rnd = coord.averaging.stages[0].round
        assert rnd is not None
        shapes = coord._shapes(0)
        for n, data, k in [
            ("a", _sybil_sum(shapes, 8), 8),
            ("b", _sybil_sum(shapes, 4, 0.0), 4),
            ("d", _sybil_sum(shapes, 4, 0.0), 4),
        ]:
            desk.post(n, "/v1/swarm/round", {
                "run_id": run, "peer_id": desk.pid(n), "stage": 0, "round": rnd.id,
                "cid": hashlib.sha256(data).hexdigest(), "samples": k,
                "data": base64.b64encode(data).decode()})  # fmt: skip
        coord.tick(coord._last_payout + 0.2)
        book = coord.averaging.stages[0]
        assert book.step == 1
        honest, bogus = "a" * 64, "f" * 64
        beat("a", 1, honest)
        beat("b", 1, bogus)
        beat("d", 1, bogus)
        coord.tick(coord._last_payout + 0.3)
        # the sybils never served a sample a trainer vouched for: they must not vote ...
        assert desk.pid("b") not in book.voters and desk.pid("d") not in book.voters
        # ... and so cannot make the honest server resync to their weights
        assert book.agreed != bogus
        assert "resync" not in beat("a", 1, honest)
    finally:
        desk.close()


def _shifted(desk: Desk, request: bytes, direction: torch.Tensor, amount: float) -> bytes:
    """The honest forward reply to `request` moved `amount` (relative L2) along `direction`."""
    honest = compute.forward(desk.cfg, 0, desk.stage, request)
    out, meta = unpack(honest, 2)
    x = compute.decode_any(out).float()
    moved = x + amount * x.norm() * direction / direction.norm()
    return pack(encode_tensor(moved, desk.cfg.codec), meta)


def test_a_server_whose_reply_agreed_with_a_convicted_one_pays_a_missed_fraud(
    tmp_path: Path,
) -> None:
    """A spot check of agreed evidence: a's reply is 1.6x the tolerance off the truth, b's
    shades toward it (within the tolerance of both the truth and a's). The referee
    convicts a (slash, ban); b agreed with a lie: it loses validator_slash_fraction of its
    stake (a "missed fraud" penalty, not banned), on the ledger's own grounds, which
    `covey ledger verify` replays and which fail without the agreement entry."""
    from covey.io import audit
    from covey.swarm.ledger_evidence import recompute_disputes
    from covey.trust.incentives import Book
    from covey.trust.ledger import LedgerError, read_entries
    from covey.trust.swarm_evidence import check_disputes

    desk = Desk(tmp_path, spot_check_rate=1.0)
    try:
        req = desk.request()
        honest = compute.forward(desk.cfg, 0, desk.stage, req)
        shape = compute.decode_any(unpack(honest, 2)[0]).shape
        d = torch.randn(shape, generator=torch.Generator().manual_seed(7))
        tol = desk.cfg.tolerance
        lie, shade = _shifted(desk, req, d, 1.6 * tol), _shifted(desk, req, d, 0.8 * tol)
        assert compute.reply_distance(lie, honest) > tol
        assert compute.reply_distance(shade, honest) <= tol
        assert compute.reply_distance(shade, lie) <= tol  # they agree: the check passes
        book = desk.coord.accounts.book
        stake_b = book.accounts[desk.pid("b")].stake
        check = desk.check(req, desk.reply("a", req, out=lie), desk.reply("b", req, out=shade))
        out = desk.report([check]).json()["checks"]
        assert "convicted" in out[0] and desk.pid("a")[:8] in out[0], out
        a, b = book.accounts[desk.pid("a")], book.accounts[desk.pid("b")]
        assert a.banned and not b.banned
        fraction = book._policy().validator_slash_fraction
        assert fraction > 0 and b.stake == pytest.approx(stake_b * (1 - fraction))
        assert desk.coord.unpaid == {}  # the check paid nobody
        entries = read_entries(desk.coord.db.path)
        kinds = [(e.type, e.payload.get("kind"), e.payload["peer_id"]) for e in entries[-4:]]
        assert kinds == [
            ("verification", None, desk.pid("a")),
            ("dispute", None, desk.pid("a")),
            ("slash", None, desk.pid("a")),
            ("penalty", "missed fraud", desk.pid("b")),
        ]
        assert entries[-3].payload["validator_id"] == desk.pid("t")  # the witness: the trainer
        report = audit.verify(desk.coord.db.path)
        assert report.entries == len(entries) and report.swarm_convictions == 1
        # the evidence: both signed replies, the request and the state, kept as blobs
        ev = entries[-3].payload["evidence"]
        assert [r["server"] for r in ev["replies"]] == [desk.pid("a"), desk.pid("b")]
        assert ev["request"] == sha(req) and ev["state"] == desk.state

        def fetch(cid: str, cap: int) -> bytes:
            return desk.coord.blobs.get(cid)

        assert recompute_disputes(entries, fetch) == 1  # the conviction stands, recomputed
        # a coordinator that convicts b on the same evidence, its distance made up: the
        # ledger cannot tell, the recomputation can
        framed = {**entries[-3].payload, "peer_id": desk.pid("b"),
                  "evidence": {**ev, "distances": {desk.pid("b"): 1.0}}}  # fmt: skip
        forged = [*entries[:-3], dataclasses.replace(entries[-3], payload=framed)]
        with pytest.raises(LedgerError, match="no SWARM conviction of"):  # b "agreed" with a
            check_disputes(forged)
        forged = [*entries[:-4], dataclasses.replace(entries[-3], payload=framed)]
        assert len(check_disputes(forged)) == 1
        with pytest.raises(LedgerError, match="an honest server was convicted"):
            recompute_disputes(forged, fetch)
        # ... one that writes b as agreeing with a's item with no conviction behind it
        bare = [*entries[:-3], dataclasses.replace(entries[-3], payload={
            k: v for k, v in entries[-3].payload.items() if k != "evidence"})]  # fmt: skip
        with pytest.raises(LedgerError, match="is no validator, and no SWARM conviction"):
            check_disputes(bare)
        # ... and one that cites a reply b never signed
        wrong = {**ev, "replies": [ev["replies"][0], {**ev["replies"][1], "reply": sha(lie)}]}
        forged = [*entries[:-3], dataclasses.replace(entries[-3], payload={
            **entries[-3].payload, "evidence": wrong})]  # fmt: skip
        with pytest.raises(LedgerError, match="not signed by it"):
            check_disputes(forged)
        replay, kept = Book(), [e for e in entries if e.type != "verification"]
        with pytest.raises(LedgerError, match="agreed on no contribution"):
            for k, e in enumerate(kept):
                replay.apply(dataclasses.replace(e, index=k))
    finally:
        desk.close()
