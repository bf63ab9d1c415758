"""Verification evidence in `covey bench comms`' rows: the bytes a worker sends to the
validators of its drawn contributions, at the run's default sampling rate, counted with
the payload so that a reduction against DDP is quoted with them first.

A drawn contribution's validators fetch what it published of the end state of its previous
round (covey.trust.evidence.evidence_of: the private state alone, none for a method that
carries none), where this round started; none in a worker's first round. The end state of
the checked round is recomputed by the re-execution and tied to the content id the worker
named, so it does not travel (counted here for a re-execution that is bit-identical, as on
the run's fixed device class, precision and thread count; one that differs in the last
bits fetches it as well). A worker's first `trust.new_peer_contributions` are always drawn
and checked by `trust.validators_per_check` validators each, the rest at `trust.sample_rate`
by one; a cleared check is audited by one more at `trust.audit_rate`. DDP and every method
that keeps no private state send no evidence.
"""

from __future__ import annotations

from typing import Any

from covey.config import SimConfig
from covey.protocol.multiplier import Costs


def evidence_state_bytes(cfg: SimConfig, vocab_size: int) -> int:
    """The bytes of one published end state of `cfg`'s method on its model (0 for a
    method that carries no local state)."""
    from covey.algorithms import build_strategy
    from covey.models.source import build_run_model
    from covey.trust.verify import published_state_nbytes

    model, loss_fn, _, _ = build_run_model(
        cfg.model, cfg.seed, tokenizer_vocab=vocab_size, seq_len=cfg.data.seq_len
    )
    return published_state_nbytes(build_strategy(cfg.algorithm, model, loss_fn))


def evidence_per_worker(cfg: SimConfig, rounds: int, state_bytes: int) -> float:
    """The evidence bytes one worker sends over `rounds` rounds at the config's sampling
    rate: one start state per validator of a drawn contribution (the first has none)."""
    if rounds <= 0 or state_bytes == 0:
        return 0.0
    trust = cfg.trust
    always = min(trust.new_peer_contributions, rounds)
    sampled = max(rounds - trust.new_peer_contributions, 0) * trust.sample_rate
    chained_new = max(always - 1, 0)  # a worker's first contribution starts fresh
    states = chained_new * (trust.validators_per_check + trust.audit_rate)
    states += sampled * (1 + trust.audit_rate)
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


def checked_share(cfg: SimConfig, rounds: int) -> float:
    """The share of a worker's contributions its validators re-execute over `rounds`
    rounds: its first new_peer_contributions always, the rest at the sampling rate."""
    if rounds <= 0:
        return 0.0
    always = min(cfg.trust.new_peer_contributions, rounds)
    return (always + max(rounds - always, 0) * cfg.trust.sample_rate) / rounds


def add_multiplier(
    rows: list[dict[str, Any]], checked: dict[str, float], uplink_mbps: float
) -> None:
    """Add to each row (in place) the decentralization multiplier the simulator's model
    gives it (covey.protocol.multiplier), per worker: useful = its compute (utilization x
    simulated time), network = the rest of the simulated time, verification = the share of
    its work validators re-execute (`checked`, counted at 1x the work: re-execution
    measured 0.86x, docs/trust.md), evidence = its evidence bytes over its uplink. Churn
    and rejected work are not modeled here (the rounds coordinator measures them)."""
    for r in rows:
        if r.get("utilization") is None or not r.get("sim_time_s"):
            continue  # a row without the simulator's timing has no multiplier
        c = Costs()
        useful = r["utilization"] * r["sim_time_s"]
        c.add_member(r["sim_time_s"], useful, "accepted")
        c.verification_s = checked.get(r["method"], 0.0) * useful
        c.evidence_s = (r.get("evidence_bytes_per_worker") or 0.0) * 8 / (uplink_mbps * 1e6)
        c.unmeasured = ["churn", "rejected"]
        d = c.as_dict()
        r["multiplier"] = d["multiplier"]
        r["multiplier_adds"] = {k: v for k, v in d["adds"].items() if k not in c.unmeasured}
