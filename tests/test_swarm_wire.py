"""Every SWARM coordinator endpoint against a dishonest peer's bodies: unknown fields,
wrong types, missing fields, oversized strings, lists and mappings, negative or huge
numbers, another peer's id. Each is refused with a 4xx and changes nothing: the books
(covey.swarm.books' tables), the ledger, the peers and the in-memory state are the same
after it, while the honest body of the same endpoint, sent last, is taken (so the test
can fail). The schemas are covey.protocol.swarm; the signature is checked over the body
as sent, so each lie below is signed by its sender's own key."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from covey.protocol import swarm as wire
from covey.swarm.wire import state_bytes
from tests.test_swarm_faults_attacks import _sum
from tests.test_swarm_pay import Desk

LIST = {"x": [1]}  # no field of any body takes an object with this key


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def desk(tmp_path: Path) -> Iterator[Desk]:
    d = Desk(tmp_path, spot_check_rate=0.0, target_samples=8)
    yield d
    d.close()


def books(desk: Desk) -> dict[str, Any]:
    """Everything a refused request must leave as it was."""
    db = desk.coord.db
    tables = [r["name"] for r in db.query("SELECT name FROM sqlite_master WHERE type='table'")]
    out: dict[str, Any] = {
        t: [tuple(r) for r in db.query(f"SELECT * FROM {t}")]
        for t in sorted(tables)
        if t.startswith("swarm_") or t in ("ledger", "peers", "meta")
    }
    with desk.coord.lock:
        out["memory"] = json.dumps(desk.coord._snapshot(), sort_keys=True, default=str)
        out["servers"] = sorted(
            (p, s.stage, s.step, s.state, s.pending, s.served, s.url)
            for p, s in desk.coord.servers.items()
        )
        out["disputes"] = list(desk.coord.disputes)
    return out


def honest_bodies(desk: Desk) -> dict[str, tuple[str, dict[str, Any]]]:
    """Per endpoint: who sends it and a body the coordinator takes."""
    run, pid = desk.coord.run_id, desk.pid
    newcomer = desk.ids["c"]  # re-joins: an honest join of a registered server
    req = desk.request()
    check = desk.check(req, desk.reply("a", req), desk.reply("b", req))
    gsum = _sum(desk.coord._shapes(0), 4)
    state = desk.state
    return {
        "/v1/swarm/join": ("c", {
            "run_id": run, "peer_id": newcomer.peer_id, "public_key": newcomer.public_key,
            "role": "server", "name": "c", "stake": 10.0, "url": "http://127.0.0.1:9",
            "blob_url": desk.blobs.url, "stage": 1, "device": "cpu"}),
        "/v1/swarm/heartbeat": ("a", {
            "run_id": run, "peer_id": pid("a"), "stage": 0, "step": 0, "state": state,
            "pending": 0, "throughput": 1.0, "queue": 0}),
        "/v1/swarm/report": ("t", {
            "run_id": run, "peer_id": pid("t"), "samples": 4, "loss": 3.0, "reroutes": 0,
            "banned": {}, "served": {pid("a"): 1}, "measured": {pid("a"): 2.0}, "next": 3,
            "checks": [check]}),
        "/v1/swarm/round": ("a", {
            "run_id": run, "peer_id": pid("a"), "stage": 0, "round": 0,
            "cid": hashlib.sha256(gsum).hexdigest(), "samples": 4,
            "data": base64.b64encode(gsum).decode()}),
        "/v1/swarm/dispute": ("t", {
            "run_id": run, "peer_id": pid("t"), "stage": 0, "kind": "forward",
            "request": check["request"], "replies": check["replies"]}),
        "/v1/swarm/state": ("a", {
            "run_id": run, "peer_id": pid("a"), "stage": 0, "cid": state,
            "data": base64.b64encode(state_bytes(desk.stage)).decode()}),
    }  # fmt: skip


def lies(path: str, good: dict[str, Any], other: str) -> dict[str, dict[str, Any]]:
    """A dishonest peer's variants of `good` (`other`: another peer's id)."""
    out = {
        "unknown field": {**good, "admin": True},
        "another peer's id": {**good, "peer_id": other},
        "run id of another run": {**good, "run_id": "0" * 16},
        "run id too long": {**good, "run_id": "0" * 4096},
    }
    for key in good:
        out[f"{key} of the wrong type"] = {**good, key: LIST}
        if MODELS[path].model_fields[key].is_required():
            out[f"{key} missing"] = {k: v for k, v in good.items() if k != key}
    huge, neg = 2**63, -1
    numbers = {
        "/v1/swarm/join": {"stake": [-1.0, 1e16, "10"], "stage": [neg, huge, 1.5, True]},
        "/v1/swarm/heartbeat": {
            "stage": [neg, huge], "step": [-2, huge, 0.5], "pending": [neg, huge, "4"],
            "throughput": [-1.0, 1e7, True], "queue": [neg, huge]},
        "/v1/swarm/report": {
            "samples": [neg, huge, 4.0], "reroutes": [neg, huge], "next": [neg, huge],
            "loss": ["3.0", True]},
        "/v1/swarm/round": {"stage": [neg, huge, "0"], "round": [neg, huge],
                            "samples": [neg, huge, 4.0, True]},
        "/v1/swarm/dispute": {"stage": [neg, huge, "0"], "kind": ["sideways", 1]},
        "/v1/swarm/state": {"stage": [neg, huge]},
    }[path]  # fmt: skip
    for key, values in numbers.items():
        for v in values:
            out[f"{key}={v!r}"] = {**good, key: v}
    big, replies = "a" * 100_000, good.get("replies", [])
    sizes = {
        "/v1/swarm/join": {"name": ["a" * 65, "two words", ""], "device": ["x" * 81],
                           "url": ["http://" + "a" * 300, "ftp://x", "u"],
                           "blob_url": ["javascript:alert(1)"], "public_key": ["ab" * 33]},
        "/v1/swarm/heartbeat": {"state": ["s0", "a" * 65, big]},
        "/v1/swarm/report": {
            "banned": [{other: "x" * 201}, {"not a peer": "why"}],
            "served": [{f"{i:032x}": 1 for i in range(257)}, {other: 10_001}],
            "measured": [{f"{i:032x}": 1.0 for i in range(257)}],
            "checks": [[{}] * 257, "paid please"]},
        "/v1/swarm/round": {"cid": ["a" * 63, big], "data": ["***", "a b"]},
        "/v1/swarm/dispute": {
            "replies": [replies * 2, replies[:1], []],
            "request": ["not base64!"]},
        "/v1/swarm/state": {"cid": ["z" * 64], "data": ["%%"]},
    }[path]  # fmt: skip
    for key, values in sizes.items():
        for i, v in enumerate(values):
            out[f"{key} oversized or malformed #{i}"] = {**good, key: v}
    if path == "/v1/swarm/dispute":
        reply = {**good["replies"][0], "extra": 1}
        out["a reply with an unknown field"] = {**good, "replies": [reply, good["replies"][1]]}
        out["a reply with a long sig"] = {
            **good,
            "replies": [{**good["replies"][0], "sig": "ab" * 65}, good["replies"][1]],
        }
    return out


MODELS: dict[str, type[wire.Request]] = {
    "/v1/swarm/join": wire.SwarmJoin, "/v1/swarm/heartbeat": wire.SwarmHeartbeat,
    "/v1/swarm/report": wire.SwarmReport, "/v1/swarm/round": wire.SwarmRoundReport,
    "/v1/swarm/dispute": wire.SwarmDispute, "/v1/swarm/state": wire.SwarmStateUpload,
}  # fmt: skip


_ADDRESSES = iter(range(1, 1 << 20))


def _post(desk: Desk, who: str, path: str, body: dict[str, Any]) -> Any:
    """Signed by `who`, from an address of its own: joins are rate-limited per address
    (a 429 would hide whether the body itself is refused)."""
    from fastapi.testclient import TestClient

    n = next(_ADDRESSES)
    client = TestClient(desk.client.app, client=(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}", 1))
    signed = desk.ids[who].sign_request(body, -1, purpose=f"POST {path}")
    return client.post(path, json=signed)


ENDPOINTS = ["/v1/swarm/join", "/v1/swarm/heartbeat", "/v1/swarm/report",
             "/v1/swarm/round", "/v1/swarm/dispute", "/v1/swarm/state"]  # fmt: skip


def _open_round(desk: Desk) -> None:
    """A round open to a and b on stage 0 (round 0), so a's sum is honest."""
    desk.vouch("a", "b", microbatches=1)
    for n in "ab":
        body = {"run_id": desk.coord.run_id, "peer_id": desk.pid(n), "stage": 0, "step": 0,
                "state": desk.state, "pending": 4, "throughput": 1.0, "queue": 0}  # fmt: skip
        assert desk.post(n, "/v1/swarm/heartbeat", body).status_code == 200
    desk.coord.tick(desk.coord._last_payout + 0.1)
    rnd = desk.coord.averaging.stages[0].round
    assert rnd is not None and rnd.id == 0, rnd


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_dishonest_peers_bodies_are_refused_and_change_nothing(desk: Desk, path: str) -> None:
    _open_round(desk)
    who, good = honest_bodies(desk)[path]
    other = desk.pid("b") if who != "b" else desk.pid("a")
    before = books(desk)
    refused: dict[str, int] = {}
    cases = lies(path, good, other)
    if path == "/v1/swarm/join":  # b's id and key, signed by c's key
        cases["another peer's id and key"] = {
            **good, "peer_id": other, "public_key": desk.ids["b"].public_key}  # fmt: skip
    for why, body in cases.items():
        r = _post(desk, who, path, body)
        refused[why] = r.status_code
        assert 400 <= r.status_code < 500, (why, r.status_code, r.text[:300])
        assert "error" in r.json(), why
        after = books(desk)
        changed = [k for k in before if before[k] != after[k]]
        assert not changed, (why, changed)
    # a body the schema refuses is a 422 naming its problems; another peer's id fails the
    # signature (a join: the id is not its key's hash); another run's id, a 409
    assert refused.pop("another peer's id") == (400 if path == "/v1/swarm/join" else 401)
    assert refused.pop("run id of another run") == 409
    if path == "/v1/swarm/join":
        assert refused.pop("another peer's id and key") == 401
    assert set(refused.values()) == {422}, refused
    # the truth is taken: the refusals were for the lies, not for the endpoint
    r = _post(desk, who, path, good)
    assert r.status_code == 200, r.text
    if path == "/v1/swarm/report":  # its check is paid, its counts are shown
        assert r.json()["checks"] == ["paid"] and desk.coord.unpaid
        assert desk.coord.trainers[desk.pid("t")]["next"] == 3
    if path == "/v1/swarm/round":
        assert set(desk.coord.averaging.stages[0].round.reports) == {desk.pid("a")}  # type: ignore[union-attr]


def test_a_malformed_body_names_its_problems(desk: Desk) -> None:
    who, good = honest_bodies(desk)["/v1/swarm/report"]
    r = _post(desk, who, "/v1/swarm/report", {**good, "samples": -1, "spare": 1})
    assert r.status_code == 422
    problems = r.json()["problems"]
    assert any("samples" in p for p in problems) and any("spare" in p for p in problems)


def test_nan_and_infinity_are_refused(desk: Desk) -> None:
    """JSON has no NaN, but Python's encoder writes it: a loss or a measurement of NaN or
    Infinity would poison the medians and the status page."""
    who, good = honest_bodies(desk)["/v1/swarm/report"]
    before = books(desk)
    for key, value in (("loss", float("nan")), ("loss", float("inf")),
                       ("measured", {desk.pid("a"): float("inf")})):  # fmt: skip
        signed = desk.ids[who].sign_request({**good, key: value}, -1,
                                            purpose="POST /v1/swarm/report")  # fmt: skip
        raw = json.dumps(signed)  # NaN / Infinity tokens
        r = desk.client.post("/v1/swarm/report", content=raw,
                             headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 422, (key, value, r.text)
    assert books(desk) == before


def test_a_reply_meta_from_a_server_is_checked_by_its_schema() -> None:
    """The JSON in a stage server's reply to a trainer (covey.protocol.swarm.ReplyMeta)."""
    from covey.swarm.compute import parse_reply
    from covey.swarm.wire import WireError, pack

    def meta(m: Any) -> bytes:
        return pack(b"", json.dumps(m).encode())

    assert parse_reply(meta({"loss": 2.5, "sketch": [1.0, 2.0]}))[1]["loss"] == 2.5
    for bad in ({"loss": float("nan"), "sketch": []}, {"loss": "1", "sketch": []},
                {"sketch": [0.0] * 5000}, {"loss": None}, {"sketch": [], "admin": 1},
                ["sketch"], {"sketch": ["x"]}):  # fmt: skip
        with pytest.raises(WireError):
            parse_reply(meta(bad))


@pytest.mark.parametrize("role", ["server", "trainer"])
def test_a_name_no_join_would_take_is_refused_at_the_command_line(role: str) -> None:
    """Refused before anything starts, in one line, not as a 422 at the first join."""
    import subprocess
    import sys

    extra = ["--samples", "1"] if role == "trainer" else []
    out = subprocess.run(
        [sys.executable, "-m", "covey", "swarm", role, "--coordinator", "http://127.0.0.1:9",
         "--name", "my server", *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "--name may use letters, digits and _.-" in out.stderr
