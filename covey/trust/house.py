"""House keys: the run owner's own workers, whose contributions are the rounds mode's canaries
(docs/trust.md, "Canaries").

A canary a validator can tell from a real check tests nothing: it agrees on the real ones
and disputes the canaries. Every part of a check a validator can read is public or signed
by its worker (the accepted content id in the ledger, the assignment entry, the worker's
signature over its commitments), so a planted payload that differs from the accepted one
is found by comparing; the only canary that cannot be told apart is a real, accepted,
signed contribution that is bad. So the run owner runs workers of its own: the same
`covey worker` code, under keys derived from the coordinator's key, which train honestly
except in the rounds the coordinator's secret draw picks, where they train on other data
(a contribution the referee convicts, harmless to the model: honest training on other
text).

- House key i of a run is the Ed25519 key whose seed is sha256 of the coordinator's
  signature over ("covey-house-key/v1", run id, i): only the coordinator's key holder can
  derive it, and nobody else can tell it from any other key.
- Its canary rounds: round r is one when the coordinator's signature over
  (run id, r, house key) (covey.trust.certify.canary_draw) is below `canary_rate`: fixed
  before the round (Ed25519 is deterministic), secret until revealed.
- The same rule serves the RL mode (a house worker's batch of step r) and the serving mode
  (its answer to a house request, drawn over the request id): `house_canary_draw`.
- The reveal (a "house canary" ledger entry) carries the draw and the coordinator's
  signature over ("covey-house/v1", run id, house key), which `covey ledger verify` checks.
"""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from covey.trust.certify import canary_draw
from covey.trust.identity import Identity, verify

HOUSE_KEYS = 64  # the house keys a coordinator recognises: index 0..HOUSE_KEYS-1


def house_identity(coordinator: Identity, run_id: str, index: int) -> Identity:
    """House key `index` of this run. ValueError for an index out of 0..HOUSE_KEYS-1."""
    if not 0 <= index < HOUSE_KEYS:
        raise ValueError(f"house key index {index} is not one of 0..{HOUSE_KEYS - 1}")
    signature = coordinator.sign(f"covey-house-key/v1\n{run_id}\n{index}".encode())
    seed = hashlib.sha256(bytes.fromhex(signature)).digest()
    return Identity(Ed25519PrivateKey.from_private_bytes(seed))


def house_peer_ids(coordinator: Identity, run_id: str) -> frozenset[str]:
    """The peer ids of every house key of this run (secret: only the coordinator knows)."""
    return frozenset(house_identity(coordinator, run_id, i).peer_id for i in range(HOUSE_KEYS))


def house_canary_draw(
    owner: Identity, run_id: str, at: int | str, worker_id: str, rate: float
) -> str | None:
    """The draw that makes house key `worker_id`'s work at `at` a canary, or None when it is
    not one: the owner's signature over (run, at, worker) (covey.trust.certify.canary_draw)
    below `rate`. `at` is a round or an RL step (int), or in the serving mode a request id
    (str): only a house request (`is_house_request`) can be a canary, drawn over its 32 hex
    digits as a number. The owner (coordinator or trainer) and a house worker, which holds
    the owner's key, both compute it."""
    if rate <= 0:
        return None
    if isinstance(at, str):
        if not is_house_request(owner, run_id, at):
            return None
        at = int(at, 16)
    planted, draw = canary_draw(owner, run_id, at, worker_id, rate)
    return draw if planted else None


def house_message(run_id: str, peer_id: str) -> bytes:
    return f"covey-house/v1\n{run_id}\n{peer_id}".encode()


def house_proof(coordinator: Identity, run_id: str, peer_id: str) -> str:
    """The coordinator's statement, published at a reveal, that `peer_id` is its own key."""
    return coordinator.sign(house_message(run_id, peer_id))


def check_house_proof(coordinator_key: str, run_id: str, peer_id: str, proof: str) -> bool:
    return verify(coordinator_key, house_message(run_id, peer_id), proof)


def house_request_id(coordinator: Identity, run_id: str, nonce: str) -> str:
    """The id of a house request (the run owner's own request to its served model,
    covey.serve.canaries): `nonce` (16 hex digits) followed by 16 hex digits of sha256 of
    the coordinator's signature over ("covey-house-request/v1", run id, nonce). To anyone
    without the coordinator's key it is 32 random hex digits, like any request's id."""
    signature = coordinator.sign(f"covey-house-request/v1\n{run_id}\n{nonce}".encode())
    return nonce + hashlib.sha256(bytes.fromhex(signature)).hexdigest()[:16]


def is_house_request(coordinator: Identity, run_id: str, request_id: str) -> bool:
    """Whether `request_id` is a house request's id (only the coordinator's key holder can
    tell)."""
    if len(request_id) != 32:
        return False
    return house_request_id(coordinator, run_id, request_id[:16]) == request_id
