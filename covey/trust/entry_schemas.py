"""Ledger entry payloads: the fields each entry type must carry, checked before the book
applies an entry (covey.trust.incentives.Book).

The payload of each entry type is the contract between the coordinator and covey.trust.incentives:

- "run created": {run_id, name, spec: dict, coordinator_key, policy: Policy.to_dict()}
- "join": {peer_id, public_key, name, role: "worker"|"validator"}  (once per key)
- "stake": {peer_id, amount} (at least min_stake for a worker, min_validator_stake for a
  validator; a bond: at most what the key holds, covey.trust.treasury);  "leave": {peer_id,
  reason}
- "deposit": {peer_id, public_key, amount, source: "spec"|"owner", request (owner only)}:
  credits to a key from the run's treasury: the spec's `trust.funds` grant, or the
  owner's signed request to POST /v1/ledger/deposit (covey.trust.treasury)
- "unbond": {peer_id, amount (its whole stake), release_at (at least unbonding_s after the
  entry)}; "rebond": {peer_id} (it joined again before its release); "release": {peer_id,
  amount (what slashes left of the stake)}, not before release_at
- "contribution accepted": {round, peer_id, cid, tokens, inner_steps, sampled, rate, draw,
  request_id, nonce, signature};  "contribution rejected": {round, peer_id, reason,
  withheld: true (only when a contribution drawn for verification was refused because its
  peer did not deliver the local states its check needs: it costs reputation)}
- "verification": {round, peer_id, validator_id, outcome: "agree"|"disagree"|"expired",
  distance: float|null, exact: bool}; "expired" names the validator that held the check
  and did not report in time (a missed check: it counts against it), or "" (older runs);
  a "verification" of a shard aggregator's item carries `shard_check`, the checker's signed
  check that agreed with a shard a slash proves wrong (covey.trust.shard_evidence);
  "withheld" carries `attestation`, the validator's signed report that the worker's
  providers did not deliver the evidence its check needs (covey.trust.withholding): not a
  completed check, and another validator is drawn
- "assignment": {round, peer_id, beacon, validators: [ids], reason: "draw"|"reassign"|
  "audit", draw (audit only)}: which validators must check a sampled contribution, drawn
  from the public beacon (the hash of the last round certificate before the round was
  accepted) with the validator ids: each eligible validator (staked at least
  min_validator_stake, not banned, not the worker, not tried on this contribution, under
  validator_round_cap checks this round) ranks by sha256(beacon, round, peer, validator),
  weighted by its stake up to validator_stake_cap (`weighted_rank`), and the first n are
  assigned, n = the checks still needed; when none of them has an established record
  (established_checks) and an eligible one has, it takes the last place. The book
  recomputes every draw (`Book.draw`); a contribution sampled as new or low-reputation
  needs validators_per_check checks, others one (fewer if fewer validators are eligible).
  An "audit" adds one check to a contribution whose checks were complete and all agreed;
  its `draw` is the coordinator's signature (covey.trust.certify.audit_message), below
  audit_rate. A "verification" must come from an assigned validator; a work reward of a
  sampled contribution needs its checks completed (else the round's checks were skipped)
- "canary": {round, peer_id (the validator), worker_id, cid, draw, outcome: "caught"|
  "passed"|"missed"}: a known-bad item planted among the validator's checks (older runs
  only: RL's and serving's copies of a real item with its proof scrambled, rounds'
  sign-flipped payloads; canaries are now house workers', "house canary" below),
  revealed once resolved; `draw` is the
  coordinator's signature (covey.trust.certify.canary_message), below canary_rate. Caught:
  a completed check (paid check_reward); passed: a "penalty" (kind canary) follows, no pay;
  missed: a missed check
- "house canary": {round, peer_id (a house worker: the run owner's own key), draw, proof,
  outcome: "caught"|"convicted"|"unchecked", detail; a served answer's also `request`: the
  house request's id, which its draw is over instead of the round}: the reveal of a canary
  (covey.trust.house): the house worker's accepted contribution of that round was made bad
  on purpose. `draw` is the coordinator's signature (covey.trust.certify.canary_message)
  over (run, round, house key), below canary_rate; `proof` its signature that the key is
  its own. Caught: a validator's dispute convicted it already; convicted: no validator did,
  and the coordinator's referee recomputed it now (`detail` says how far it was), which
  convicts it (every validator that agreed on it missed a fraud); unchecked: nobody
  checked it, or the referee found no divergence. Either way the key is burned (banned:
  the reveal makes it public) and every validator that agreed on it passed a canary
- "report refused": {round, peer_id (the validator), worker_id, task_id, field, reason}: a
  validator's report that was malformed or unprovable (segment out of range, a blob missing
  or of the wrong size); it counts against the validator's reputation and ends its
  assignment (another validator is drawn)
- "penalty": {round, peer_id, amount, kind: "false accusation"|"canary"|"missed fraud",
  reason}: a validator loses validator_slash_fraction of its stake (not banned) for a
  dispute the referee found it wrong in, for passing a canary, or for agreeing on an item
  (a contribution, an RL batch) convicted since: "missed fraud", once per such item
- "clawback": {round, peer_id (who pays back), worker_id (whose item was convicted),
  amount, kind: "work"|"check", reason}: after a conviction (a "dispute" with outcome
  "fraud", or a "contribution rejected" of an item a validator agreed on) the worker's work
  reward for it, or the check reward of a validator that agreed on it (a "check" reward
  names the item's worker in `worker_id`), taken from the payee's stake: the pay, at most
  the stake left (covey.trust.convictions)
- "dispute": {round, peer_id, validator_id, segment, outcome: "fraud"|"validator wrong"|
  "honest drift"|"inconclusive", detail}: "honest drift" (the worker right, the validator
  within covey.trust.referee.DRIFT_FACTOR of it) and "inconclusive" cost nobody anything
- "slash": {round, peer_id, amount, reason}; `withheld: true` marks a drawn worker whose
  evidence its validators attested withheld (allowed only once proven:
  covey.trust.withholding; it convicts the contribution as fraud does); a slash of a
  validator (an aggregator of a sharded round) also carries `evidence`
  (covey.trust.shard_evidence: its signed publish, the round's inputs, the referee's
  hash), checked by `covey ledger verify`
- "reward": {round, peer_id, amount, kind: "work"|"catch"|"check", tokens (0 unless work)};
  a "check" pays check_reward to a validator for a completed assigned check, once per
  reported verification, and names the checked item's worker in `worker_id` (so a
  conviction can claw it back; older entries lack it)
- "round certificate": {round, new_hash, certificate_hash, accepted: [ids], rejected: [ids]}
- "checkpoint": {round, cid, weights_hash}
- "no show": {round, peer_id, consecutive, sits_out_s}: a live member of a round that
  neither submitted nor left (consecutive: its no-shows in a row, this one included);
  from the second in a row it sits out rounds for sits_out_s (covey.protocol.rounds.
  no_show_backoff) and each such repeated no-show lowers its reputation
- "halt": {round, owner_key, reason, request}: the owner's signed HALT (covey.trust.halt)

Fields beyond these are ignored. Amounts are compared exactly: the coordinator computes
them with the same expressions (`Book.work_reward`, `Book.slash_amount`).
"""

from __future__ import annotations

import math
from typing import Any

from covey.trust.ledger import Entry, LedgerError

# Each entry type's payload: "field:kind" where kind is id (non-empty text), text, count
# (int >= 0), amount (finite number >= 0), amount? (or null), bool, object, ids (a list of
# ids), or a|b|c (one of these strings). Fields beyond these are ignored.
_SCHEMA_TEXT = {
    "run created": "run_id:text, name:text, spec:object, coordinator_key:text, policy:object",
    "join": "peer_id:id, public_key:text, name:text, role:worker|validator",
    "stake": "peer_id:id, amount:amount",
    "leave": "peer_id:id, reason:text",
    "deposit": "peer_id:id, public_key:text, amount:amount, source:spec|owner",
    "unbond": "peer_id:id, amount:amount, release_at:amount",
    "rebond": "peer_id:id",
    "release": "peer_id:id, amount:amount",
    "contribution accepted": "round:count, peer_id:id, cid:text, tokens:count, "
    "inner_steps:count, sampled:bool, rate:amount, draw:text, request_id:text, nonce:text, "
    "signature:text",
    "contribution rejected": "round:count, peer_id:id, reason:text",
    "verification": "round:count, peer_id:id, validator_id:text, "
    "outcome:agree|disagree|expired|withheld, "
    "distance:amount?, exact:bool",
    "dispute": "round:count, peer_id:id, validator_id:id, segment:count, "
    "outcome:fraud|validator wrong|honest drift|inconclusive, detail:text",
    "slash": "round:count, peer_id:id, amount:amount, reason:text",
    "reward": "round:count, peer_id:id, amount:amount, kind:work|catch|check, tokens:count",
    "report refused": "round:count, peer_id:id, worker_id:id, task_id:count, field:text, "
    "reason:text",
    "assignment": "round:count, peer_id:id, beacon:text, validators:ids, "
    "reason:draw|reassign|audit",
    "canary": "round:count, peer_id:id, worker_id:id, cid:text, draw:text, "
    "outcome:caught|passed|missed",
    "house canary": "round:count, peer_id:id, draw:text, proof:text, "
    "outcome:caught|convicted|unchecked, detail:text",
    "penalty": "round:count, peer_id:id, amount:amount, kind:false accusation|canary|missed "
    "fraud, reason:text",
    "clawback": "round:count, peer_id:id, worker_id:id, amount:amount, kind:work|check, "
    "reason:text",
    "round certificate": "round:count, new_hash:text, certificate_hash:text, accepted:ids, "
    "rejected:ids",
    "checkpoint": "round:count, cid:text, weights_hash:text",
    "halt": "round:count, owner_key:text, reason:text, request:object",
    "no show": "round:count, peer_id:id, consecutive:count, sits_out_s:amount",
}
SCHEMAS: dict[str, dict[str, str]] = {
    t: dict(field.split(":", 1) for field in text.split(", ")) for t, text in _SCHEMA_TEXT.items()
}


def check_payload(entry: Entry) -> None:
    """LedgerError naming the entry if a payload field is missing or holds the wrong kind."""
    for name, kind in SCHEMAS[entry.type].items():
        if name not in entry.payload:
            raise LedgerError(entry.index, f"{entry.type}: payload lacks field {name!r}")
        if not _holds(entry.payload[name], kind):
            want = f"one of {kind.split('|')}" if "|" in kind else f"{kind}"
            got = repr(entry.payload[name])[:80]
            raise LedgerError(
                entry.index, f"{entry.type}: field {name!r} must be {want}, got {got}"
            )


def _holds(v: Any, kind: str) -> bool:
    if "|" in kind:
        return isinstance(v, str) and v in kind.split("|")
    if kind == "amount?":
        return v is None or _holds(v, "amount")
    if kind in ("amount", "count"):
        number = isinstance(v, int if kind == "count" else (int, float))
        return number and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    if kind == "ids":
        return isinstance(v, list) and all(_holds(x, "id") for x in v)
    if kind == "id":
        return isinstance(v, str) and v != ""
    return isinstance(v, {"text": str, "bool": bool, "object": dict}[kind])
