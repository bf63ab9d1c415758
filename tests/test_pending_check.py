"""A plain round's hash check run behind the next round (covey.peer.pending_check): the
worker adopts the weights it computed at once; before it publishes the next round's
contribution it waits for the check, and a state the certificate refutes is caught there:
the work trained from it is not published and the worker re-syncs from the canonical
state. In one process, with a Worker given what `_setup` would give it minus the network
(the certified state is in its store, where `_download_state` finds it without a fetch);
tests/test_network.py runs the matching path across real processes."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from covey.algorithms import Contribution, TrainState, build_strategy
from covey.blobs import BlobClient, BlobStore
from covey.config import DiLoCoConfig
from covey.memory import shapes_only
from covey.peer.pending_check import CheckTimeout, PendingCheck
from covey.peer.worker import Worker, WorkerOptions
from covey.protocol import schemas
from covey.protocol.checkpoint import state_to_file

WIDTH = 16


def _strategy() -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4))
    cfg = DiLoCoConfig(method="diloco", inner_steps=2, outer_momentum=0.5)
    return build_strategy(cfg, model, lambda m, b: m(b).pow(2).mean())


def _trained(strategy: Any, state: TrainState) -> Contribution:
    strategy.begin_round(state)
    for i in range(2):
        g = torch.Generator().manual_seed(100 * state.round + i)
        strategy.inner_step(torch.randn(8, WIDTH, generator=g))
    return strategy.make_contribution()


class Recorded(Worker):
    """A Worker whose network-facing steps of `_finish` are recorded, not sent."""

    published: list[int]

    def _seal(self, local: Any) -> None:
        pass

    def _publish(self, info: schemas.RoundInfo, c: Contribution, *_: Any) -> bool:
        self.published.append(info.round)
        return True

    def _await_certificate(self, info: schemas.RoundInfo) -> schemas.Certificate | None:
        return None  # the round ends there: what matters is whether it was published


def _worker(strategy: Any, tmp_path: Path) -> Recorded:
    w = Recorded.__new__(Recorded)
    w.opts = WorkerOptions(coordinator="http://127.0.0.1:9")
    w.name, w.peer_id, w.published = "w", "p" * 64, []
    w.strategy, w.leader = strategy, None
    w.cfg = SimpleNamespace(trust=SimpleNamespace(sharded_above_peers=0))
    w.store_dir = tmp_path
    w.store = BlobStore(tmp_path / "blobs", 1 << 30)
    w.server = object()  # serves: keeps the state it computed in its store
    w.blob_url, w.blobs = None, BlobClient()
    w.template = shapes_only(strategy.init_state())
    w._published, w._served_state, w._pending = [], None, None
    w._chain = w._local = None
    w._trained_since_adopt = False
    w.stop = threading.Event()
    return w


def _certificate(round_: int, start: TrainState, new: TrainState, cid: str) -> Any:
    c = schemas.AcceptedContribution(
        peer_id="q" * 64, cid="e" * 64, size=1, tokens=64, inner_steps=2, fragment=None,
        weight=1.0, providers=[],
    )  # fmt: skip
    return schemas.Certificate(
        run_id="r", round=round_, attempt=0, start_hash=start.digest(), new_hash=new.digest(),
        new_cid=cid, new_size=1, accepted=[c], rejected=[], closed_at=0.0, reason="",
    )  # fmt: skip


def _info(round_: int, start_hash: str) -> schemas.RoundInfo:
    return schemas.RoundInfo.model_validate({
        "run_id": "r", "round": round_, "attempt": 0, "phase": "open", "member": True,
        "start_hash": start_hash, "start_cid": "c" * 64, "start_size": 1,
        "deadline_in_s": 60, "assignment": {"inner_steps": 2, "data_key": "k"},
    })  # fmt: skip


def _round(tmp_path: Path, corrupt: bool) -> tuple[Recorded, Any, Contribution, TrainState]:
    """Round 0 applied by the worker with its check deferred: its start state is W_0, or
    with `corrupt` W_0 with one weight flipped while its hash still says W_0 (the state
    the certificate must refute). -> the worker, round 0's certificate, round 1's work
    (trained from the worker's new state) and the certified new state."""
    strategy = _strategy()
    w0 = strategy.init_state()
    payload = _trained(strategy, w0)
    certified = strategy.apply_round(w0, [payload])
    w = _worker(strategy, tmp_path)
    # the certified state is served by the coordinator: here, already in the worker's store
    scratch = w.store.scratch()
    cid, _ = state_to_file(certified, scratch)
    w.store.adopt(scratch, cid)
    cert = _certificate(0, w0, certified, cid)
    cert.accepted[0].cid = w.store.put(payload.payload)  # the accepted contribution
    start = TrainState({n: t.clone() for n, t in w0.params.items()}, {}, 0)
    if corrupt:
        first = next(iter(start.params))
        start.params[first].view(-1)[0] += 1.0
    w.state, w.state_hash = start, w0.digest()
    state, digest, resynced = w._round_result(cert, consume=True, defer=True)
    assert (digest, resynced) == (certified.digest(), False)  # adopted before the check
    assert w._pending is not None
    w.state, w.state_hash = state, digest
    strategy.adopt(state)
    work = _trained(strategy, state)
    return w, cert, work, certified


def _applied(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp_path / "applied.jsonl").read_text().splitlines()]


def test_a_deferred_check_that_matches_serves_the_state_and_lets_the_round_publish(
    tmp_path: Path,
) -> None:
    w, cert, work, certified = _round(tmp_path, corrupt=False)
    f = w._finish(_info(1, cert.new_hash), [work], 0.0, 0.0, 0.0, [], False)
    assert w.published == [1] and f.submitted
    assert w._pending is None
    assert _applied(tmp_path) == [
        {"round": 0, "weights_hash": cert.new_hash, "certificate": cert.new_hash, "matched": True}
    ]
    assert w._served_state == cert.new_cid and w.store.has(cert.new_cid)  # joiners fetch it
    assert w.state is not None and w.state.digest() == certified.digest()


def test_a_deferred_check_that_mismatches_discards_the_work_and_resyncs(tmp_path: Path) -> None:
    w, cert, work, certified = _round(tmp_path, corrupt=True)
    f = w._finish(_info(1, cert.new_hash), [work], 0.0, 0.0, 0.0, [], False)
    # the contribution trained from the refuted state is never published
    assert w.published == [] and not f.submitted and f.certificate is None
    assert w._settle(f, adopt=True) == "aborted"
    [row] = _applied(tmp_path)
    assert row["round"] == 0 and not row["matched"] and row["weights_hash"] != cert.new_hash
    # back on the canonical state, and the model reloads it before the round starts over
    assert w.state is not None and w.state.digest() == certified.digest()
    assert w.state_hash == cert.new_hash and w._trained_since_adopt
    w._sync_state(cert.new_cid, cert.new_hash, 1, [])
    model = dict(w.strategy.model.named_parameters())
    assert all(torch.equal(model[n].detach(), t) for n, t in certified.params.items())
    # the round trained again from it is published
    again = _trained(w.strategy, w.state)
    w._finish(_info(1, cert.new_hash), [again], 0.0, 0.0, 0.0, [], False)
    assert w.published == [1]


def test_a_pending_check_hands_over_its_outcome_and_errors() -> None:
    state = TrainState({"w": torch.arange(6.0)}, {}, 2)
    served: list[str] = []
    ok = PendingCheck(2, state, state.digest(), lambda s, d: served.append(d)).start()
    out = ok.result(30)
    assert out.matched and out.digest == state.digest() and served == [state.digest()]
    bad = PendingCheck(2, state, "0" * 64, lambda s, d: served.append(d)).start()
    assert not bad.result(30).matched and len(served) == 1  # a refuted state is not served

    def fails(s: TrainState, d: str) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        PendingCheck(2, state, state.digest(), fails).start().result(30)
    gate = threading.Event()
    slow = PendingCheck(2, state, state.digest(), lambda s, d: gate.wait(30)).start()
    with pytest.raises(CheckTimeout):
        slow.result(0.05)
    gate.set()
    assert slow.result(30).matched


def test_the_round_path_bench_times_both_orders_of_the_same_round() -> None:
    """`covey bench roundpath`'s measurement on a small state: every part timed, and the
    check behind the round found the state the first order hashed (it raises otherwise)."""
    from covey.bench.round_path import preset_params, round_fraction, time_round_path

    r = time_round_path(4096, workers=3)
    for part in ("apply", "digest", "serve", "before", "after", "start_check", "behind"):
        assert r[f"{part}_s"] > 0 and f"{part}_ms_per_m" in r
    assert r["parameters_m"] == 0.004 and r["workers"] == 3
    assert round_fraction(1.0, 100, 0.09) == pytest.approx(0.1)
    assert preset_params("nano") > 0
