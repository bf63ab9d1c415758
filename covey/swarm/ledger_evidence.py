"""`covey ledger verify --recompute` for SWARM runs: each stage server's conviction
recomputed from its evidence (covey.trust.swarm_evidence) with the code the servers run.

The run's spec is the "run created" entry's, and must hash to the ledger's run id (a
coordinator cannot judge under another model than the one it served). For each verdict the
stage state, the request and both replies are fetched by content id from the run's blob
plane; the stage is built from the spec, loaded with the state and the request recomputed
(covey.swarm.compute, on the CPU in fp32: the referee's own class is the run's
`verify_device`). The conviction stands only if the convicted reply is farther than the
tolerance from the recomputation; a server written as agreeing with it (a missed fraud)
must have signed a reply within the tolerance of the convicted one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from covey.trust.ledger import LedgerError
from covey.trust.policy import Policy
from covey.trust.swarm_evidence import SwarmVerdict, check_disputes


def ledger_terms(entries: Sequence[Any]) -> Policy | None:
    """`covey ledger verify`: the policy a SWARM run's spec gives (`SwarmConfig.policy`,
    held stake and its unbonding period), None for a ledger of another mode. LedgerError
    when the spec does not parse as received or does not hash to the run id (a
    coordinator cannot write other terms or other funds than it served)."""
    created = entries[0].payload
    spec = created.get("spec")
    if not isinstance(spec, dict) or "stages" not in spec or "rounds" in spec:
        return None
    from pydantic import ValidationError

    from covey.swarm.config import SwarmConfig

    try:
        cfg = SwarmConfig.received(spec)
    except (ValidationError, ValueError) as e:
        raise LedgerError(0, f"run created: not a SWARM spec ({str(e)[:200]})") from None
    if cfg.run_id != created.get("run_id"):
        raise LedgerError(0, f"run created: its spec hashes to {cfg.run_id}, not its run id")
    return cfg.policy()


def recompute_disputes(
    entries: Sequence[Any],
    fetch: Callable[[str, int], bytes],
    progress: Callable[[str], None] | None = None,
) -> int:
    """Recompute every SWARM conviction on the ledger `entries` (`fetch(cid, max_bytes)`:
    a blob's bytes, checked against its id by the caller). The number recomputed; 0 for a
    ledger of another mode. LedgerError naming the first conviction that does not stand."""
    verdicts = check_disputes(entries)
    if not verdicts:
        return 0
    from pydantic import ValidationError

    from covey.swarm import compute
    from covey.swarm.config import SwarmConfig
    from covey.swarm.wire import WireError, build_stage, load_state

    created = entries[0].payload
    try:
        cfg = SwarmConfig.model_validate(created["spec"])
    except (ValidationError, KeyError, TypeError) as e:
        raise LedgerError(0, f"run created: not a SWARM spec ({str(e)[:200]})") from None
    if cfg.run_id != created.get("run_id"):
        raise LedgerError(0, f"run created: its spec hashes to {cfg.run_id}, not its run id")
    cap = cfg.max_body_bytes
    agreed = _agreements(entries)
    for v in verdicts:
        if progress is not None:
            progress(f"recomputing stage {v.stage}'s {v.hop} reply (conviction #{v.index})")

        def void(why: str, v: SwarmVerdict = v) -> LedgerError:
            return LedgerError(v.index, f"conviction of stage server {v.liar}: {why}")

        if not 0 <= v.stage < cfg.stages:
            raise void(f"stage {v.stage}: the run has stages 0..{cfg.stages - 1}")
        request, state = fetch(v.request, cap), fetch(v.state, 4 * cap)
        replies = {s: fetch(r, cap) for s, r in v.replies}
        stage = build_stage(cfg, v.stage, "cpu")
        try:
            load_state(stage, state)
            run = compute.forward if v.hop == "forward" else compute.backward
            truth = run(cfg, v.stage, stage, request)
        except WireError as e:
            raise void(f"its request or state does not compute: {e}") from None
        d = compute.reply_distance(replies[v.liar], truth)
        if not d > v.tolerance:
            raise void(f"an honest server was convicted: its reply is {d:.3g} from the truth")
        for partner in agreed.get(v.index, ()):
            apart = compute.reply_distance(replies[partner], replies[v.liar])
            if not apart <= v.tolerance:
                raise void(f"{partner} is penalised for agreeing, but its reply is {apart:.3g} "
                           "from the convicted one")  # fmt: skip
    return len(verdicts)


def _agreements(entries: Sequence[Any]) -> dict[int, set[str]]:
    """For each SWARM dispute entry, the servers written as agreeing with its liar."""
    agreed: dict[tuple[int, str], set[str]] = {}
    out: dict[int, set[str]] = {}
    for e in entries:
        p = e.payload
        if e.type == "verification" and p.get("outcome") == "agree":
            agreed.setdefault((p["round"], p["peer_id"]), set()).add(p["validator_id"])
        elif e.type == "dispute":
            out[e.index] = agreed.get((p["round"], p["peer_id"]), set())
    return out
