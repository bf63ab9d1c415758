"""Slash evidence of sharded aggregation, judged in-process on a ledger built here
(covey.trust.shard_evidence; the real coordinator's side is tests/test_shards_network.py).
A slash whose round is not certified yet is still recomputed (a
frame cannot hide as pending); malformed evidence is a LedgerError, not a traceback."""

from __future__ import annotations

from typing import Any

import pytest
import tomllib
import torch

from covey.algorithms import TrainState, build_strategy
from covey.algorithms.aggregation import build_aggregator, l2_norm
from covey.algorithms.shards import (
    codec_align,
    flat_state,
    new_shard,
    plan_shards,
    shard_hash,
)
from covey.config import RunConfig
from covey.data.tokenizer import load_tokenizer
from covey.models.source import build_run_model
from covey.protocol.checkpoint import state_to_bytes
from covey.protocol.content import content_id
from covey.trust.identity import Identity
from covey.trust.ledger import Entry, LedgerError
from covey.trust.shard_evidence import (
    board_digest,
    board_fields,
    check_slashes,
    evidence,
    publish_purpose,
    read_inputs,
    recompute,
)

SPEC = """
name = "shards"
seed = 5
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 32
[algorithm]
method = "diloco"
inner_steps = 4
codec = "int4"
inner_state = "reset"
[trust]
min_stake = 1
sharded_above_peers = 2
shards = 4
"""
RUN_ID = "0123456789abcdef"


def _world() -> dict[str, Any]:
    spec = tomllib.loads(SPEC)
    cfg = RunConfig.model_validate(spec)
    vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    model, loss_fn, _, _ = build_run_model(
        cfg.model, cfg.seed, tokenizer_vocab=vocab, seq_len=cfg.data.seq_len
    )
    t = cfg.trust
    strategy = build_strategy(
        cfg.algorithm,
        model,
        loss_fn,
        build_aggregator(t.aggregation, t.trim_fraction, t.clip_factor),
    )
    names, codec = list(strategy.names), strategy.codec
    template = TrainState({n: p.detach().clone() for n, p in model.named_parameters()})
    numel = sum(template.params[n].numel() for n in names)
    plan = plan_shards(numel, t.shards, codec_align(codec) or 1)
    g = torch.Generator().manual_seed(0)
    blobs = {}
    workers = [Identity.generate() for _ in range(2)]
    agg = Identity.generate()
    inputs = []
    for i, w in enumerate(sorted(workers, key=lambda k: k.peer_id)):
        data = codec.encode(torch.randn(numel, generator=g) * 1e-3 * (i + 1))
        blobs[content_id(data)] = data
        inputs.append((w.peer_id, content_id(data), float(100 - i)))
    start_bytes = state_to_bytes(template)
    blobs[content_id(start_bytes)] = start_bytes
    return dict(
        spec=spec,
        cfg=cfg,
        strategy=strategy,
        names=names,
        codec=codec,
        template=template,
        numel=numel,
        plan=plan,
        blobs=blobs,
        workers=workers,
        agg=agg,
        inputs=inputs,
        start_cid=content_id(start_bytes),
    )


def _honest(w: dict[str, Any], round: int, shard: int) -> tuple[str, str, dict]:
    """(hash, reads digest, board) an honest aggregator computes and signs."""
    a, b = w["plan"].span(shard)
    norms = [l2_norm(w["codec"].decode(w["blobs"][c], w["numel"])) for _, c, _ in w["inputs"]]
    board = board_fields(round, w["template"].digest(), (a, b), w["numel"], w["inputs"], norms)
    readers = [lambda x, y, d=w["blobs"][cid]: d[x:y] for _, cid, _ in w["inputs"]]
    slices, reads = read_inputs(w["codec"], w["numel"], (a, b), readers)
    params, _ = flat_state(w["template"], w["names"])
    algo = w["cfg"].algorithm
    p, m = new_shard(
        w["strategy"].aggregator,
        slices,
        [x for _, _, x in w["inputs"]],
        norms,
        params[a:b],
        None,
        lr=algo.outer_lr,
        momentum_coef=algo.outer_momentum,
        nesterov=algo.nesterov,
    )
    return shard_hash(round, shard, a, p, m), reads, board


def _signed(
    w: dict[str, Any], round: int, shard: int, hash: str, reads: str, board: dict[str, Any]
) -> dict[str, Any]:
    body = {
        "run_id": RUN_ID,
        "peer_id": w["agg"].peer_id,
        "index": shard,
        "hash": hash,
        "cid": "x",
        "url": "",
        "board": board_digest(**board),
        "reads": reads,
    }
    return w["agg"].sign_request(body, round, purpose=publish_purpose(round))


def _ledger(
    w: dict[str, Any], slash_round: int, ev: dict[str, Any], certify: list[int]
) -> list[Entry]:
    e: list[tuple[str, dict]] = [("run created", {"run_id": RUN_ID, "spec": w["spec"]})]
    for k in w["workers"]:
        e.append(("join", {"peer_id": k.peer_id, "public_key": k.public_key, "role": "worker"}))
    a = w["agg"]
    e.append(("join", {"peer_id": a.peer_id, "public_key": a.public_key, "role": "validator"}))
    for r in sorted({0, slash_round}):
        for peer, cid, tok in w["inputs"]:
            e.append(
                (
                    "contribution accepted",
                    {"round": r, "peer_id": peer, "cid": cid, "tokens": int(tok)},
                )
            )
    for r in certify:
        e.append(
            (
                "round certificate",
                {
                    "round": r,
                    "new_hash": w["template"].digest(),
                    "accepted": [p for p, _, _ in w["inputs"]],
                },
            )
        )
    e.append(("slash", {"round": slash_round, "peer_id": a.peer_id, "evidence": ev}))
    return [Entry(i, t, 0.0, p, "0" * 64, "0" * 64, "0" * 128) for i, (t, p) in enumerate(e)]


def _fetch(w: dict[str, Any]) -> Any:
    return lambda cid, cap: w["blobs"][cid]


def test_a_liars_slash_recomputes_and_stands() -> None:
    w = _world()
    truth, reads, board = _honest(w, 0, 1)
    pub = _signed(w, 0, 1, "ab" * 32, reads, board)  # a wrong hash, honest reads
    verdicts, pending = check_slashes(
        _ledger(w, 0, evidence(0, 1, pub, board, w["start_cid"], truth), [0])
    )
    assert len(verdicts) == 1 and not pending
    recompute(verdicts, w["spec"], _fetch(w))


def test_a_frame_in_a_round_not_certified_yet_is_still_recomputed() -> None:
    """The coordinator slashes an honest aggregator in the last round and never certifies
    it: the slash is pending (its inputs wait for the certificate), but recomputed."""
    w = _world()
    honest, reads, board = _honest(w, 1, 2)
    pub = _signed(w, 1, 2, honest, reads, board)
    ev = evidence(1, 2, pub, board, w["start_cid"], "0" * 64)
    verdicts, pending = check_slashes(_ledger(w, 1, ev, certify=[0]))
    assert len(verdicts) == 1 and pending == [verdicts[0].index]
    with pytest.raises(LedgerError, match="an honest aggregator was slashed"):
        recompute(verdicts, w["spec"], _fetch(w))


def test_malformed_evidence_is_a_ledger_error() -> None:
    w = _world()
    truth, reads, board = _honest(w, 0, 1)
    pub = _signed(w, 0, 1, "ab" * 32, reads, board)
    huge = {**board, "inputs": [[p, c, 10**400] for p, c, _ in board["inputs"]]}  # JSON allows it
    with pytest.raises(LedgerError, match="malformed evidence"):
        check_slashes(_ledger(w, 0, evidence(0, 1, pub, huge, w["start_cid"], truth), [0]))
    far = {**board, "span": [10**9, 10**9 + 1]}  # signed by a validator key it runs
    pub = _signed(w, 0, 99, "ab" * 32, reads, far)
    verdicts, _ = check_slashes(
        _ledger(w, 0, evidence(0, 99, pub, far, w["start_cid"], truth), [0])
    )
    with pytest.raises(LedgerError, match="shard 99"):
        recompute(verdicts, w["spec"], _fetch(w))
