"""SWARM's missed fraud over real processes: a swarm coordinator and three stage servers on
127.0.0.1 (a0 on stage 0; on stage 1 a "subtle" liar and its accomplice, "shade", which
answers the liar's requests half as wrong: within the tolerance of both the truth and the
lie), a trainer in this process. Every check of stage 1 pairs the two, so their replies
agree and the trainer reports them as paid evidence; every piece of evidence is spot
checked (spot_check_rate 1). The first spot check of a lie convicts the liar (slashed,
banned) and makes the accomplice pay a missed fraud (validator_slash_fraction of its stake,
not banned); `covey ledger verify --recompute` checks and recomputes both over HTTP.
The fast in-process version of this verdict: tests/test_swarm_pay.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from covey.io import audit
from covey.swarm.launch import Swarm, status, wait_for
from covey.swarm.ledger_evidence import recompute_disputes
from covey.trust.ledger import read_entries
from tests.swarm_helpers import SETTINGS, corpus_text

pytestmark = [pytest.mark.network, pytest.mark.long]


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    data = tmp_path / "data.txt"
    data.write_text(corpus_text() * 2)
    settings = {**SETTINGS, "spot_check_rate": 1.0,
                "data_paths": [str(data)]}  # fmt: skip
    s = Swarm(tmp_path, settings)
    try:
        s.start_coordinator()
        s.start_server("a0", "--emulate-s", "0.01", "--stage", "0", "--stake", "10")
        for name in ("liar", "shade"):
            s.start_server(name, "--emulate-s", "0.01", "--stage", "1", "--stake", "10",
                           "--behavior", "subtle" if name == "liar" else name)  # fmt: skip
        s.ready(["a0", "liar", "shade"])
        yield s
    finally:
        s.close()


def test_a_server_that_agreed_with_a_convicted_reply_pays_a_missed_fraud(swarm: Swarm) -> None:
    from covey.swarm.trainer import SwarmTrainer

    torch.set_num_threads(1)
    ids = {x["name"]: x["peer_id"] for x in status(swarm.url)["servers"]}  # type: ignore[index]
    t = SwarmTrainer(swarm.url, name="t", inflight=2, progress=lambda _: None)
    run = threading.Thread(target=lambda: t.train(seconds=120), daemon=True)
    try:
        run.start()
        wait_for(lambda: (st := status(swarm.url)) and ids["liar"] in st["banned"], 120,
                 "the liar to be convicted by a spot check")  # fmt: skip
    finally:
        t.stop.set()
        run.join(timeout=30)
        t.close()
    st = status(swarm.url)
    assert st is not None and ids["shade"] not in st["banned"]  # penalised, not banned
    entries = read_entries(swarm.workdir / "run" / "swarm.db")
    by = [(e.type, e.payload.get("kind"), e.payload["peer_id"]) for e in entries
          if e.type in ("verification", "dispute", "slash", "penalty")]  # fmt: skip
    assert ("dispute", None, ids["liar"]) in by and ("slash", None, ids["liar"]) in by
    assert ("penalty", "missed fraud", ids["shade"]) in by, by
    (penalty,) = [e.payload for e in entries if e.type == "penalty"]
    assert penalty["amount"] == pytest.approx(0.2 * 10)  # validator_slash_fraction x stake
    report = audit.verify(swarm.url, recompute=True, recomputers=[recompute_disputes])
    shade = report.summary["accounts"][ids["shade"]]
    assert not shade["banned"] and shade["slashed"] == pytest.approx(2.0), shade
    assert report.swarm_convictions >= 1
    assert report.swarm_recomputed == report.swarm_convictions
