"""What a slashed aggregator's verdict rests on, checked from outside the coordinator
(issue 13 §1: a wrong shard is a provable fraud).

A "slash" ledger entry against an aggregator (a validator drawn for sharded aggregation,
covey.coordinator.sharding) carries `evidence`:

    {"kind": "shard", "round", "shard", "published": the aggregator's signed publish body,
     "start_hash", "start_cid", "inputs": [[peer_id, cid, tokens], ...] by peer id,
     "truth": the hash the referee recomputed}

`check_slashes` (every `covey ledger verify`) needs only the ledger: the publish carries the
aggregator's own signature over its hash, so the coordinator cannot put a hash in its mouth;
the inputs are the round's certified contributions (each a "contribution accepted" entry,
the set the round certificate names) and the start state is the previous certificate's; the
published hash is not the referee's. `recompute` (`covey ledger verify --recompute`) then
rebuilds the run's model from its spec, fetches the start state (round 0's must be the
spec's seeded weights, unless the spec warm-starts) and the contributions, and recomputes
the shard as the referee did (covey.algorithms.shards): the slash stands only if the
aggregator's hash is not what the inputs give. Any failure is a LedgerError naming the
slash entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from covey.trust.identity import request_message, request_purpose, verify
from covey.trust.ledger import Entry, LedgerError


def evidence(
    round: int,
    shard: int,
    published: dict[str, Any],
    start_hash: str,
    start_cid: str,
    inputs: Sequence[tuple[str, str, int]],
    truth: str,
) -> dict[str, Any]:
    """A slash entry's `evidence` for shard `shard` of round `round` (see the module)."""
    return {
        "kind": "shard",
        "round": round,
        "shard": shard,
        "published": published,
        "start_hash": start_hash,
        "start_cid": start_cid,
        "inputs": [[p, c, int(t)] for p, c, t in sorted(inputs)],
        "truth": truth,
    }


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
    start_hash: str
    start_cid: str
    inputs: tuple[tuple[str, str, int], ...]


def check_slashes(entries: Sequence[Entry]) -> list[ShardVerdict]:
    """Every slash of a validator, checked against the ledger (see the module): its
    verdicts, or LedgerError naming the first slash whose evidence does not hold."""
    run_id, keys, roles = "", {}, {}
    accepted: dict[tuple[int, str], set[tuple[str, int]]] = {}
    certified: dict[int, tuple[str, set[str]]] = {}
    for e in entries:
        p = e.payload
        if e.type == "run created":
            run_id = str(p.get("run_id", ""))
        elif e.type == "join":
            keys[p["peer_id"]], roles[p["peer_id"]] = p["public_key"], p["role"]
        elif e.type == "contribution accepted":
            accepted.setdefault((p["round"], p["peer_id"]), set()).add((p["cid"], p["tokens"]))
        elif e.type == "round certificate":
            certified[p["round"]] = (p["new_hash"], set(p["accepted"]))
    verdicts = []
    for e in entries:
        if e.type == "slash" and roles.get(e.payload["peer_id"]) == "validator":
            verdicts.append(_check(e, run_id, keys, accepted, certified))
    return verdicts


def _check(
    e: Entry,
    run_id: str,
    keys: dict[str, str],
    accepted: dict[tuple[int, str], set[tuple[str, int]]],
    certified: dict[int, tuple[str, set[str]]],
) -> ShardVerdict:
    p, i = e.payload, e.index
    who, round_ = p["peer_id"], p["round"]
    ev = p.get("evidence")

    def fail(why: str) -> LedgerError:
        return LedgerError(i, f"slash of aggregator {who} (round {round_}): {why}")

    if not isinstance(ev, dict) or ev.get("kind") != "shard":
        raise fail("carries no shard evidence: nothing shows what it published wrong")
    try:
        shard, pub, truth = int(ev["shard"]), dict(ev["published"]), str(ev["truth"])
        start_hash, start_cid = str(ev["start_hash"]), str(ev["start_cid"])
        inputs = tuple((str(a), str(b), int(c)) for a, b, c in ev["inputs"])
    except (KeyError, TypeError, ValueError) as err:
        raise fail(f"malformed evidence ({err!r})") from None
    if ev.get("round") != round_:
        raise fail(f"its evidence is for round {ev.get('round')!r}")
    if pub.get("peer_id") != who or pub.get("index") != shard or pub.get("run_id") != run_id:
        raise fail(f"the publish it cites is not its own of shard {shard} in this run")
    signature = pub.get("signature")
    message = request_message(pub, round_, publish_purpose(round_))
    if not isinstance(signature, str) or not verify(keys.get(who, ""), message, signature):
        raise fail(f"the publish of shard {shard} it cites is not signed by {who}")
    published = pub.get("hash")
    if not isinstance(published, str) or published == truth:
        raise fail(f"its own evidence gives shard {shard} the hash it published")
    peers = [x[0] for x in inputs]
    if peers != sorted(set(peers)):
        raise fail("its inputs are not one contribution per peer, by peer id")
    for peer, cid, tokens in inputs:
        if (cid, tokens) not in accepted.get((round_, peer), set()):
            raise fail(f"input {cid[:16]} of {peer} is no accepted contribution of the round")
    if round_ in certified and certified[round_][1] != set(peers):
        raise fail("its inputs are not the contributions the round certificate names")
    if round_ - 1 in certified and certified[round_ - 1][0] != start_hash:
        raise fail(f"its start state {start_hash[:16]} is not round {round_ - 1}'s")
    return ShardVerdict(i, round_, shard, who, published, truth, start_hash, start_cid, inputs)


def recompute(
    verdicts: Sequence[ShardVerdict],
    spec: dict[str, Any],
    fetch: Callable[[str], bytes],
    progress: Callable[[str], None] | None = None,
) -> None:
    """Recompute each verdict's shard from its inputs (`fetch(cid)`: a blob's bytes,
    checked against its content id by the caller) with the run's model, codec, robust
    aggregation and outer step, as the referee does. LedgerError naming the slash whose
    shard is not what the referee said, or whose aggregator published the truth."""
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
        read_slice,
        shard_hash,
    )
    from covey.config import DiLoCoConfig, RunConfig
    from covey.data.tokenizer import load_tokenizer
    from covey.models.source import build_run_model
    from covey.protocol.checkpoint import state_from_bytes

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
    for v in verdicts:
        if progress is not None:
            progress(f"recomputing shard {v.shard} of round {v.round} (slash #{v.index})")
        start = state_from_bytes(fetch(v.start_cid), template)
        if start.digest() != v.start_hash:
            raise LedgerError(v.index, f"start state {v.start_cid[:16]} is not {v.start_hash[:16]}")
        if v.round == 0 and not cfg.model.init and start.digest() != template.digest():
            raise LedgerError(  # no certificate before it: the spec's seeded weights are
                v.index, f"round 0's start state {v.start_hash[:16]} is not the run's seeded one"
            )
        params, momentum = flat_state(start, names)
        a, b = plan.span(v.shard)
        blobs = [fetch(cid) for _, cid, _ in v.inputs]
        slices = [read_slice(codec, numel, a, b, lambda x, y, d=d: d[x:y]) for d in blobs]
        norms = None
        if isinstance(rule, NormClip) and rule.factor > 0:
            norms = [l2_norm(codec.decode(d, numel)) for d in blobs]
        with torch.no_grad():
            new_p, new_m = new_shard(
                rule,
                slices,
                [float(t) for _, _, t in v.inputs],
                norms,
                params[a:b],
                None if momentum is None else momentum[a:b],
                lr=algo.outer_lr,
                momentum_coef=algo.outer_momentum,
                nesterov=algo.nesterov,
            )
        got = shard_hash(v.round, v.shard, a, new_p, new_m)
        if got == v.published:
            raise LedgerError(
                v.index,
                f"slash of aggregator {v.aggregator}: shard {v.shard} of round {v.round} "
                f"recomputes to {got[:16]}, the hash it published: an honest aggregator "
                "was slashed",
            )
        if got != v.truth:
            raise LedgerError(
                v.index,
                f"slash of aggregator {v.aggregator}: shard {v.shard} of round {v.round} "
                f"recomputes to {got[:16]}, not the referee's {v.truth[:16]}",
            )
