"""What a slashed aggregator's verdict rests on, checked from outside the coordinator
(a wrong shard is a provable fraud; docs/sharded-aggregation.md).

An aggregator's signed publish of a shard's hash names, as `board`, the digest of what it
computed from (`board_digest`: the round, its start state's hash, the shard's span, the
inputs with their weights and norms). A "slash" ledger entry against an aggregator (a
validator drawn for sharded aggregation, covey.coordinator.sharding) carries `evidence`:

    {"kind": "shard", "round", "shard", "published": the aggregator's signed publish body,
     "board": the fields its digest covers, "start_cid", "truth": the referee's hash}

`check_slashes` (every `covey ledger verify`) needs only the ledger: the publish carries the
aggregator's own signature over its hash and the board's digest, so the coordinator can
put neither in its mouth; the board must be the round's certified inputs (each a
"contribution accepted" entry, by peer id, weighted by its tokens: the set the round
certificate names) from the state the previous certificate names, or the coordinator
misled the aggregator and the slash is void; and the published hash is not the referee's.
A "verification" of an aggregator (a late check's missed fraud, covey.coordinator.
shard_audit) must carry `shard_check`, the checker's own signed check of that round and
shard, agreeing with a hash that a slash of that aggregator in that round proves wrong.
`recompute` (`covey ledger verify --recompute`) then rebuilds the run's model from its
spec, checks the board's span, size and norms against it and the blobs, fetches the start
state (round 0's must be the spec's seeded weights, unless the spec warm-starts) and the
contributions, and recomputes the shard from exactly the signed board, as the referee did
(covey.algorithms.shards): the slash stands only if the aggregator's hash is not what its
board gives. Any failure is a LedgerError naming the slash entry.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from covey.trust.identity import canonical_json, request_message, request_purpose, verify
from covey.trust.ledger import Entry, LedgerError


def board_fields(
    round: int,
    start_hash: str,
    span: tuple[int, int],
    numel: int,
    inputs: Sequence[tuple[str, str, float]],
    norms: Sequence[float] | None,
) -> dict[str, Any]:
    """What an aggregator computes shard `span` of round `round` from, as evidence carries
    it: `inputs` (peer id, contribution cid, weight) in the board's order, their norms."""
    return {"round": round, "start_hash": start_hash, "span": [int(span[0]), int(span[1])],
            "numel": int(numel), "inputs": [[p, c, float(w)] for p, c, w in inputs],
            "norms": None if norms is None else [float(x) for x in norms]}  # fmt: skip


def board_digest(**fields: Any) -> str:
    """The digest an aggregator signs with its hash: of `board_fields(**fields)`."""
    return hashlib.sha256(canonical_json(board_fields(**fields)).encode()).hexdigest()


def recording(read: Callable[[int, int], bytes]) -> tuple[Callable[[int, int], bytes], list]:
    """`read` (bytes [a, b) of one contribution), and the log it fills: [a, b, sha256] of
    each range read, in order. An aggregator reads ranges it cannot check against the
    blob's content id; it signs their digest (`reads_digest`), so bytes a coordinator
    altered in transit void any slash over the shard instead of framing it."""
    log: list[list[Any]] = []

    def logged(a: int, b: int) -> bytes:
        data = read(a, b)
        log.append([int(a), int(b), hashlib.sha256(data).hexdigest()])
        return data

    return logged, log


def reads_digest(logs: Sequence[Sequence[Any]]) -> str:
    """The digest of every input's read log (`recording`), in the board's input order."""
    return hashlib.sha256(canonical_json([list(x) for x in logs]).encode()).hexdigest()


def read_inputs(
    codec: Any, numel: int, span: tuple[int, int], readers: Sequence[Callable[[int, int], bytes]]
) -> tuple[list[Any], str]:
    """Each input's slice of `span` (covey.algorithms.shards.read_slice), read with its
    reader, and the digest of the byte ranges read (`reads_digest`): what an aggregator
    signs it read, and what the coordinator and an auditor expect it to have read."""
    from covey.algorithms.shards import read_slice

    slices, logs = [], []
    for read in readers:
        logged, log = recording(read)
        slices.append(read_slice(codec, numel, span[0], span[1], logged))
        logs.append(log)
    return slices, reads_digest(logs)


def evidence(
    round: int,
    shard: int,
    published: dict[str, Any],
    board: dict[str, Any],
    start_cid: str,
    truth: str,
) -> dict[str, Any]:
    """A slash entry's `evidence` for shard `shard` of round `round` (see the module)."""
    return {"kind": "shard", "round": round, "shard": shard, "published": published,
            "board": board, "start_cid": start_cid, "truth": truth}  # fmt: skip


def publish_purpose(round: int) -> str:
    """The purpose an aggregator signs its publish of a round's shard with."""
    return request_purpose(f"/v1/shards/{round}/publish")


@dataclass(frozen=True)
class ShardVerdict:
    """A slash of an aggregator whose evidence holds up on the ledger alone."""

    index: int  # of the slash entry
    round: int
    shard: int
    aggregator: str
    published: str  # the hash it signed
    truth: str  # the referee's
    board: dict[str, Any]  # what it signed it computed from (board_fields)
    start_cid: str
    reads: str  # the digest of the byte ranges it signed it read (reads_digest)


def check_slashes(entries: Sequence[Entry]) -> tuple[list[ShardVerdict], list[int]]:
    """Every slash of a validator, checked against the ledger (see the module): (its
    verdicts, the indexes of those pending: their round is not certified yet and the
    ledger certifies no later round, so their inputs are not yet checked against its
    certificate; `recompute` still recomputes them), or LedgerError naming the first slash
    whose evidence does not hold."""
    run_id, keys, roles = "", {}, {}
    accepted: dict[tuple[int, str], set[tuple[str, int]]] = {}
    certified: dict[int, list[tuple[str, set[str]]]] = {}
    for e in entries:
        p = e.payload
        if e.type == "run created":
            run_id = str(p.get("run_id", ""))
        elif e.type == "join":
            keys[p["peer_id"]], roles[p["peer_id"]] = p["public_key"], p["role"]
        elif e.type == "contribution accepted":
            accepted.setdefault((p["round"], p["peer_id"]), set()).add((p["cid"], p["tokens"]))
        elif e.type == "round certificate":
            certified.setdefault(p["round"], []).append((p["new_hash"], set(p["accepted"])))
    verdicts, pending = [], []
    for e in entries:
        if e.type == "slash" and roles.get(e.payload["peer_id"]) == "validator":
            v, later = _check(e, run_id, keys, accepted, certified)
            verdicts.append(v)
            if later:
                pending.append(e.index)
    wrong = {(v.round, v.aggregator, v.shard, v.published) for v in verdicts}
    for e in entries:
        if e.type == "verification" and roles.get(e.payload["peer_id"]) == "validator":
            _check_agreement(e, run_id, keys, wrong)
    return verdicts, pending


def check_purpose(round: int) -> str:
    """The purpose a drawn checker signs its check of a round's shard with."""
    return request_purpose(f"/v1/shards/{round}/check")


def _check_agreement(
    e: Entry, run_id: str, keys: dict[str, str], wrong: set[tuple[int, str, int, str]]
) -> None:
    """A "verification" of an aggregator's item (a late check's missed fraud,
    covey.coordinator.shard_audit) stands only on the checker's own signed check agreeing
    with a hash that a slash of that aggregator in that round proves wrong; LedgerError
    naming it otherwise (nobody is written as having agreed with a lie it did not sign)."""
    p, i = e.payload, e.index
    who, checker, round_ = p["peer_id"], p["validator_id"], p["round"]

    def fail(why: str) -> LedgerError:
        return LedgerError(
            i, f"verification of aggregator {who} by {checker} (round {round_}): {why}"
        )

    body = p.get("shard_check")
    if p.get("outcome") != "agree" or not isinstance(body, dict):
        raise fail("an aggregator's item is checked only by a signed shard check that agreed")
    if body.get("peer_id") != checker or body.get("run_id") != run_id:
        raise fail("the shard check it cites is not the checker's own in this run")
    signature = body.get("signature")
    message = request_message(body, round_, check_purpose(round_))
    if not isinstance(signature, str) or not verify(keys.get(checker, ""), message, signature):
        raise fail(f"the shard check it cites is not signed by {checker}")
    shard, value = body.get("index"), body.get("hash")
    if not isinstance(shard, int) or not isinstance(value, str):
        raise fail("the shard check it cites names no shard index and hash")
    if (round_, who, shard, value) not in wrong:
        raise fail(f"no slash of {who} proves the hash {value[:16]} it agreed with for "
                   f"shard {shard} wrong")  # fmt: skip


def _check(
    e: Entry,
    run_id: str,
    keys: dict[str, str],
    accepted: dict[tuple[int, str], set[tuple[str, int]]],
    certified: dict[int, list[tuple[str, set[str]]]],
) -> tuple[ShardVerdict, bool]:
    """The slash's verdict, and whether its round's certificate is still to come."""
    p, i = e.payload, e.index
    who, round_ = p["peer_id"], p["round"]
    ev = p.get("evidence")

    def fail(why: str) -> LedgerError:
        return LedgerError(i, f"slash of aggregator {who} (round {round_}): {why}")

    if not isinstance(ev, dict) or ev.get("kind") != "shard":
        raise fail("carries no shard evidence: nothing shows what it published wrong")
    try:
        shard, pub, truth = int(ev["shard"]), dict(ev["published"]), str(ev["truth"])
        b, start_cid = dict(ev["board"]), str(ev["start_cid"])
        board = board_fields(
            int(b["round"]), str(b["start_hash"]), (int(b["span"][0]), int(b["span"][1])),
            int(b["numel"]), [(str(x), str(y), float(w)) for x, y, w in b["inputs"]],
            None if b["norms"] is None else [float(x) for x in b["norms"]],
        )  # fmt: skip
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as err:
        raise fail(f"malformed evidence ({str(err)[:200]})") from None
    numbers = [w for _, _, w in board["inputs"]] + list(board["norms"] or [])
    if not all(math.isfinite(x) for x in numbers):
        raise fail("its board holds a weight or norm that is not a finite number")
    if ev.get("round") != round_ or board["round"] != round_:
        raise fail(f"its evidence is for round {ev.get('round')!r} / {board['round']!r}")
    if pub.get("peer_id") != who or pub.get("index") != shard or pub.get("run_id") != run_id:
        raise fail(f"the publish it cites is not its own of shard {shard} in this run")
    signature = pub.get("signature")
    message = request_message(pub, round_, publish_purpose(round_))
    if not isinstance(signature, str) or not verify(keys.get(who, ""), message, signature):
        raise fail(f"the publish of shard {shard} it cites is not signed by {who}")
    if pub.get("board") != board_digest(**board):
        raise fail("the publish it cites does not name the board its evidence gives")
    if not isinstance(pub.get("reads"), str):
        raise fail("the publish it cites names no digest of the bytes it read")
    published = pub.get("hash")
    if not isinstance(published, str) or published == truth:
        raise fail(f"its own evidence gives shard {shard} the hash it published")
    # the board must be the round's: else the coordinator misled the aggregator
    if len(certified.get(round_, [])) > 1 or len(certified.get(round_ - 1, [])) > 1:
        raise fail(f"the ledger certifies round {round_} or {round_ - 1} more than once")
    peers = [x[0] for x in board["inputs"]]
    if peers != sorted(set(peers)):
        raise fail("its board's inputs are not one contribution per peer, by peer id")
    for peer, cid, weight in board["inputs"]:
        if not any(c == cid and float(t) == weight for c, t in accepted.get((round_, peer), ())):
            raise fail(f"board input {cid[:16]} of {peer} is no accepted contribution")
    verdict = ShardVerdict(i, round_, shard, who, published, truth, board, start_cid, pub["reads"])
    if round_ not in certified:
        if any(r > round_ for r in certified):
            raise fail(f"round {round_} was never certified, though later rounds were")
        return verdict, True  # pending: the round's certificate is still to come
    if certified[round_][0][1] != set(peers):
        raise fail("its board's inputs are not the contributions the round certificate names")
    if round_ > 0 and certified.get(round_ - 1, [("", set())])[0][0] != board["start_hash"]:
        raise fail(f"its board starts from {board['start_hash'][:16]}, not round {round_ - 1}'s")
    return verdict, False


def recompute(
    verdicts: Sequence[ShardVerdict],
    spec: dict[str, Any],
    fetch: Callable[[str, int], bytes],
    progress: Callable[[str], None] | None = None,
) -> None:
    """Recompute each verdict's shard from exactly the board its aggregator signed
    (`fetch(cid, max_bytes)`: a blob's bytes, at most max_bytes, checked against its
    content id by the caller) with the
    run's model, codec, robust aggregation and outer step, as the referee does, after
    checking the board against the spec (span, size) and the blobs (norms, start state).
    LedgerError naming the slash whose board is not the round's, whose shard is not what
    the referee said, or whose aggregator published the truth."""
    if not verdicts:
        return
    import torch

    from covey.algorithms import TrainState, build_strategy
    from covey.algorithms.aggregation import NormClip, build_aggregator, l2_norm
    from covey.algorithms.shards import (
        codec_align,
        flat_state,
        new_shard,
        plan_shards,
        shard_hash,
    )
    from covey.config import DiLoCoConfig, RunConfig
    from covey.data.tokenizer import load_tokenizer
    from covey.models.source import build_run_model
    from covey.protocol.checkpoint import CheckpointError, state_from_bytes

    cfg = RunConfig.model_validate(spec)
    algo, trust = cfg.algorithm, cfg.trust
    if not isinstance(algo, DiLoCoConfig):
        raise LedgerError(verdicts[0].index, f"a sharded round in a {algo.method} run")
    try:
        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
        model, loss_fn, _, _ = build_run_model(
            cfg.model, cfg.seed, tokenizer_vocab=vocab, seq_len=cfg.data.seq_len
        )
    except (OSError, ValueError) as err:
        raise LedgerError(
            verdicts[0].index, f"cannot rebuild the run's model here to recompute: {err}"
        ) from None
    rule = build_aggregator(trust.aggregation, trust.trim_fraction, trust.clip_factor)
    strategy = build_strategy(algo, model, loss_fn, rule)
    names, codec = list(strategy.names), strategy.codec
    template = TrainState({n: p.detach().clone() for n, p in model.named_parameters()})
    numel = sum(template.params[n].numel() for n in names)
    plan = plan_shards(numel, trust.shards, codec_align(codec) or 1)
    clipped = isinstance(rule, NormClip) and rule.factor > 0
    # the largest a contribution and a state (params + outer momentum, a header) can be
    payload_cap = codec.nbytes(numel)
    state_cap = 2 * sum(t.numel() * t.element_size() for t in template.params.values()) + (1 << 20)
    for v in verdicts:
        if progress is not None:
            progress(f"recomputing shard {v.shard} of round {v.round} (slash #{v.index})")

        def void(why: str, v: ShardVerdict = v) -> LedgerError:
            return LedgerError(
                v.index, f"slash of aggregator {v.aggregator} (round {v.round}): {why}"
            )

        board = v.board
        try:
            a, b = plan.span(v.shard)
        except ValueError as err:
            raise void(f"shard {v.shard}: {err}") from None
        if board["numel"] != numel or tuple(board["span"]) != (a, b):
            raise void(f"its board's span {board['span']} of {board['numel']} is not the "
                       f"run's shard {v.shard}, [{a}, {b}) of {numel}")  # fmt: skip
        try:
            start = state_from_bytes(fetch(v.start_cid, state_cap), template)
        except CheckpointError as err:
            raise void(f"start state {v.start_cid[:16]}: {err}") from None
        if start.digest() != board["start_hash"]:
            raise void(f"start state {v.start_cid[:16]} is not {board['start_hash'][:16]}")
        if v.round == 0 and not cfg.model.init and start.digest() != template.digest():
            raise void(f"round 0's start state {board['start_hash'][:16]} is not the seeded one")
        params, momentum = flat_state(start, names)
        blobs = [fetch(cid, payload_cap) for _, cid, _ in board["inputs"]]
        try:
            norms = [l2_norm(codec.decode(d, numel)) for d in blobs] if clipped else None
            readers = [lambda x, y, d=d: d[x:y] for d in blobs]
            slices, reads = read_inputs(codec, numel, (a, b), readers)
        except ValueError as err:  # CodecError is one: a contribution the codec refuses
            raise void(f"a contribution does not decode: {err}") from None
        if reads != v.reads:
            raise void("the bytes it signed it read are not the contributions' (the "
                       "coordinator served it other bytes)")  # fmt: skip
        if norms != board["norms"]:
            raise void("its board's norms are not the contributions' (the aggregator was misled)")
        with torch.no_grad():
            new_p, new_m = new_shard(
                rule,
                slices,
                [w for _, _, w in board["inputs"]],
                norms,
                params[a:b],
                None if momentum is None else momentum[a:b],
                lr=algo.outer_lr,
                momentum_coef=algo.outer_momentum,
                nesterov=algo.nesterov,
            )
        got = shard_hash(v.round, v.shard, a, new_p, new_m)
        if got == v.published:
            raise void(f"shard {v.shard} recomputes to {got[:16]}, the hash it published: an "
                       "honest aggregator was slashed")  # fmt: skip
        if got != v.truth:
            raise void(f"shard {v.shard} recomputes to {got[:16]}, not the referee's "
                       f"{v.truth[:16]}")  # fmt: skip
