"""A lying shard aggregator (covey.peer.cheater_aggregator), judged in one process from
committed inputs: for each way it lies (one worker's payload dropped, noise on a few
coordinates) its publish names the true board and reads, so the coordinator takes it; the
drawn checker's honest hash sends it to the referee, which convicts it; the slash's evidence
holds on the ledger alone (covey.trust.shard_evidence.check_slashes) and its shard is
recomputed from the signed board and the blobs (`recompute`, as `covey ledger verify
--recompute` does); the shard passes to the next aggregator. The real processes' side:
tests/test_shards_network.py."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from covey.algorithms.aggregation import l2_norm
from covey.blobs import BlobStore
from covey.coordinator.sharding import ShardBoard, assign_shards
from covey.peer.aggregator import computed_from, shard_purpose
from covey.peer.cheater_aggregator import LyingAggregator
from covey.trust.identity import Identity
from covey.trust.ledger import LedgerError
from covey.trust.shard_evidence import board_digest, check_slashes, recompute
from tests.test_shard_evidence import RUN_ID, _fetch, _honest, _ledger, _world

SHARD = 1


def _view(w: dict[str, Any], liar: str, checker: str) -> dict[str, Any]:
    """The board of round 0 as `GET /v1/shards/0` shows it, `liar` first for SHARD."""
    norms = [l2_norm(w["codec"].decode(w["blobs"][c], w["numel"])) for _, c, _ in w["inputs"]]
    shards = []
    for s in range(w["plan"].count):
        a, b = w["plan"].span(s)
        shards.append({"index": s, "start": a, "end": b, "aggregator": liar,
                       "checker": checker, "published": None, "agreed": False})  # fmt: skip
    inputs = {
        "codec": w["codec"].name,
        "start_cid": w["start_cid"],
        "contributions": [
            {"peer_id": p, "cid": c, "size": len(w["blobs"][c])} for p, c, _ in w["inputs"]
        ],
        "weights": [x for _, _, x in w["inputs"]],
        "norms": norms,
    }
    return {"round": 0, "start_hash": w["template"].digest(), "numel": w["numel"],
            "shards": shards, "inputs": inputs}  # fmt: skip


def _liar(w: dict[str, Any], mode: str, tmp: Path) -> LyingAggregator:
    agg = LyingAggregator(
        "http://127.0.0.1:9",  # never reached: its reads come from the blobs here
        w["agg"],
        RUN_ID,
        w["strategy"],
        w["cfg"].algorithm,
        BlobStore(tmp),
        "",
        mode=mode,
    )
    agg._read = lambda cid: lambda a, b: w["blobs"][cid][a:b]  # type: ignore[method-assign]
    return agg


@pytest.mark.parametrize("mode", ["drop", "noise"])
def test_a_lying_aggregator_is_convicted_from_committed_inputs(mode: str, tmp_path: Path) -> None:
    w = _world()
    checker = Identity.generate()
    keys = {w["agg"].peer_id: w["agg"], checker.peer_id: checker}
    view = _view(w, w["agg"].peer_id, checker.peer_id)
    truth, reads, fields = _honest(w, 0, SHARD)
    liar = _liar(w, mode, tmp_path)
    _, _, lie = liar.compute(view, SHARD, w["template"])
    # slightly wrong, but signed over the true board and the true bytes read
    assert lie != truth
    assert liar.last_reads == reads
    assert computed_from(view, SHARD) == board_digest(**fields)
    # the coordinator's board takes its publish, and the drawn checker's hash convicts it
    slashed: list[tuple[int, str, dict[str, Any]]] = []
    board = ShardBoard(
        RUN_ID,
        Identity.generate(),
        public_key=lambda p: keys[p].public_key if p in keys else None,
        is_banned=lambda p: any(p == s[1] for s in slashed),
        referee=lambda r, s: truth if s == SHARD else "0" * 64,
        reads=lambda r, s: reads,
        slash=lambda r, p, why, ev: slashed.append((r, p, ev)),
        check_rate=1.0,
        publish_timeout_s=30.0,
    )
    beacon = next(  # a draw that makes the liar first for the shard (any beacon is public)
        b
        for b in (hashlib.sha256(str(i).encode()).hexdigest() for i in range(100))
        if assign_shards(b, 0, w["plan"].count, list(keys))[SHARD][0] == w["agg"].peer_id
    )
    board.open(0, view["start_hash"], beacon, w["plan"], list(keys), view["inputs"], 0.0)

    def signed(who: Identity, action: str, value: str) -> dict[str, Any]:
        body = {"run_id": RUN_ID, "peer_id": who.peer_id, "index": SHARD, "hash": value,
                "cid": "c", "url": "", "board": computed_from(view, SHARD),
                "reads": reads}  # fmt: skip
        return who.sign_request(body, 0, purpose=shard_purpose(0, action))

    assert board.publish(0, signed(w["agg"], "publish", lie))["ok"]
    got = board.check(0, signed(checker, "check", truth), 1.0)
    assert got["outcome"] == "fraud" and got["next"] == checker.peer_id
    ((r, who, ev),) = slashed
    assert (r, who) == (0, w["agg"].peer_id)
    assert ev["published"]["hash"] == lie and ev["truth"] == truth and ev["shard"] == SHARD
    assert [c for _, c, _ in ev["board"]["inputs"]] == [c for _, c, _ in w["inputs"]]
    # the verdict, from the ledger and the blobs alone
    verdicts, pending = check_slashes(_ledger(w, 0, ev, [0]))
    assert [(v.aggregator, v.shard, v.published, v.truth) for v in verdicts] == [
        (w["agg"].peer_id, SHARD, lie, truth)
    ] and not pending
    recompute(verdicts, w["spec"], _fetch(w))  # stands: the shard is not what it published
    # the liar's shard went to the next aggregator; an honest publish there is taken
    assert board.view(0)["shards"][SHARD]["aggregator"] == checker.peer_id


def test_an_honest_shard_is_not_a_lie(tmp_path: Path) -> None:
    """The same aggregator with no mode computes the true shard; a slash over it is void."""
    w = _world()
    truth, _, _ = _honest(w, 0, SHARD)
    view = _view(w, w["agg"].peer_id, "")
    liar = _liar(w, "noise", tmp_path)
    liar.mode = None
    assert liar.compute(view, SHARD, w["template"])[2] == truth and not liar._wrong
    with pytest.raises(ValueError, match="mode"):
        _liar(w, "lazy", tmp_path)
    with pytest.raises(LedgerError, match="carries no shard evidence"):
        check_slashes(_ledger(w, 0, {"kind": "none"}, [0]))
