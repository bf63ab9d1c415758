"""Verification evidence in `covey bench comms`' rows: the bytes a worker sends to the
validators of its drawn contributions, at the run's default sampling rate, counted with
the payload so that a reduction against DDP is quoted with them first.

A drawn contribution's validators fetch what it published of its local states
(covey.trust.evidence.evidence_of: the private state alone, none for a method that carries
none): the end state of its previous round (where this one started; none in a worker's
first round) and of this round. A worker's first `trust.new_peer_contributions` are always
drawn, the rest at `trust.sample_rate`; one validator fetches each (established peers need
one check). DDP and every method that keeps no private state send no evidence.
"""

from __future__ import annotations

from typing import Any

from covey.config import SimConfig


def evidence_state_bytes(cfg: SimConfig, vocab_size: int) -> int:
    """The bytes of one published end state of `cfg`'s method on its model (0 for a
    method that carries no local state)."""
    from covey.algorithms import build_strategy
    from covey.models.source import build_run_model
    from covey.trust.verify import local_state_nbytes

    model, loss_fn, _, _ = build_run_model(
        cfg.model, cfg.seed, tokenizer_vocab=vocab_size, seq_len=cfg.data.seq_len
    )
    strategy = build_strategy(cfg.algorithm, model, loss_fn)
    if not strategy.carries_local_state:
        return 0
    return local_state_nbytes(strategy.evidence_layout())


def evidence_per_worker(cfg: SimConfig, rounds: int, state_bytes: int) -> float:
    """The evidence bytes one worker sends over `rounds` rounds at the config's sampling
    rate (its first new_peer_contributions always drawn; the first has no start state)."""
    if rounds <= 0 or state_bytes == 0:
        return 0.0
    trust = cfg.trust
    always = min(trust.new_peer_contributions, rounds)
    sampled = max(rounds - trust.new_peer_contributions, 0) * trust.sample_rate
    states = (2 * always - 1 if always else 0) + 2 * sampled
    return states * state_bytes


def add_evidence(rows: list[dict[str, Any]], evidence: dict[str, float], rate: float) -> None:
    """Add to each row (in place) its evidence bytes per worker, the sampling rate they are
    counted at, and the reduction against its baseline with the evidence counted."""
    by_name = {r["method"]: r for r in rows}
    for r in rows:
        r["evidence_bytes_per_worker"] = evidence.get(r["method"], 0.0)
        r["sample_rate"] = rate
        r["comm_reduction_vs_ddp_with_evidence"] = None
        base = by_name.get(r["baseline"])
        if base is not None:
            base_bytes = base["bytes_sent_per_worker"] + evidence.get(base["method"], 0.0)
            mine = r["bytes_sent_per_worker"] + r["evidence_bytes_per_worker"]
            r["comm_reduction_vs_ddp_with_evidence"] = base_bytes / mine
