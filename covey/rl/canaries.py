"""Canaries in the RL mode: batches of the run owner's own house workers, bad on purpose at
the steps the trainer's secret draw picks (covey.trust.house; docs/trust.md, "Canaries").

A canary here is not a task of its own: it is a batch like any other, submitted and signed
by its worker (covey.rl.house.HouseRolloutWorker) through POST /v1/rl/batch, assigned by the
same public ranking (covey.rl.intake.assign_rank), its prefill draw the trainer's signature
as for any batch, served from the same blob store. What makes it a canary is only that its
worker is a house key (derived from the trainer's key: nobody else can tell) and that the
trainer's signature over (run, step, house key) (covey.trust.house.house_canary_draw) fell below
`canary_rate`, which the house worker computes too and then submits its honest batch with
every sample made bad in a way only a prefill tells (`canary_batch`: each proof's
coefficients replaced by a pseudo-random polynomial, its layout and moduli kept so it parses
like any proof, and each logprob lowered by 0.02, 200x the fp32 tolerance). Same worker,
same step, same sizes, same timing as its honest batch: nothing a validator reads before it
reports tells it from a real check.

The reveal comes with the batch's verdict, after its validator reported (covey.rl.verdicts):
a "house canary" ledger entry with the draw and the trainer's proof that the key is its own
(`covey ledger verify` checks both and the rate), which burns the key (banned; the house
worker moves to its next key). A validator that rejected it, confirmed by the trainer's
recomputation (a "dispute" of outcome "fraud"), "caught" it (a catch, paid). One that agreed
on it is overruled by the trainer's full recomputation, which always follows an agreement
on a canary: "convicted", and the validator pays a "missed fraud" penalty
(validator_slash_fraction of its stake) and loses that check's pay
(covey.coordinator.checks.Checks.convict). A canary no validator took is checked by the
trainer like any such batch and not revealed (a rejected batch is all anyone sees).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import sqlite3
from typing import TYPE_CHECKING

from covey.rl import proofs
from covey.rl.batch import RolloutBatch
from covey.trust.house import house_canary_draw, house_peer_ids, house_proof

if TYPE_CHECKING:
    from covey.rl.trainer_parts import TrainerParts

log = logging.getLogger("covey.rl.intake")
CANARY_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS rl_house_canaries (step INTEGER NOT NULL, "
    "worker_id TEXT NOT NULL, validator_id TEXT, outcome TEXT NOT NULL, "
    "PRIMARY KEY (step, worker_id))",
)
LOGPROB_SHIFT = 0.02  # what a canary takes off every logprob: 200x the fp32 tolerance


def scramble_proof(proof: bytes, n_tokens: int, seed: bytes) -> bytes:
    """`proof` of `n_tokens` tokens with each chunk's coefficients replaced by pseudo-random
    ones from `seed` (moduli kept): a proof that parses but commits to nothing. The layout
    (258 B per full chunk, `proofs.chunk_k` values for a partial one) holds for hidden
    sizes >= 4; a proof of another length is scrambled byte by byte instead."""
    sizes = [proofs.chunk_proof_bytes(proofs.TOPK)] * (n_tokens // proofs.CHUNK)
    if n_tokens % proofs.CHUNK:
        sizes.append(proofs.chunk_proof_bytes(proofs.chunk_k(n_tokens % proofs.CHUNK, 4096)))
    stream = bytearray()
    counter = 0
    while len(stream) < len(proof):
        stream += hashlib.sha256(seed + counter.to_bytes(8, "little")).digest()
        counter += 1
    if sum(sizes) != len(proof):
        return bytes(a ^ b | 1 for a, b in zip(proof, stream, strict=False))
    out, pos = bytearray(), 0
    for size in sizes:
        out += proof[pos : pos + 2]  # the modulus
        for i in range(pos + 2, pos + size, 2):
            value = int.from_bytes(stream[i : i + 2], "little") % proofs.PRIME
            original = int.from_bytes(proof[i : i + 2], "little")
            out += (value if value != original else (value + 1) % proofs.PRIME).to_bytes(
                2, "little"
            )
        pos += size
    return bytes(out)


def canary_batch(real: RolloutBatch, seed: bytes) -> RolloutBatch:
    """`real` with every sample's proof scrambled and logprobs lowered (see module doc)."""
    samples = []
    for i, s in enumerate(real.samples):
        proof = scramble_proof(s.proof_bytes(), len(s.tokens), seed + i.to_bytes(4, "little"))
        samples.append(
            s.model_copy(
                update={
                    "proof": base64.b64encode(proof).decode(),
                    "logprobs": [x - LOGPROB_SHIFT for x in s.logprobs],
                }
            )
        )
    return real.model_copy(update={"samples": samples})


class HouseCanaries:
    """The trainer's side: which batches are canaries, and their reveal on the ledger."""

    def __init__(self, trainer: TrainerParts) -> None:
        self.t = trainer
        self.house = house_peer_ids(trainer.identity, trainer.run_id)  # secret

    def draw(self, worker_id: str, step: int) -> str | None:
        """The canary draw of this batch, None when it is a real one."""
        if worker_id not in self.house:
            return None
        t = self.t
        return house_canary_draw(t.identity, t.run_id, step, worker_id, t.spec.canary_rate)

    def reveal(
        self,
        c: sqlite3.Connection,
        step: int,
        worker_id: str,
        validator_id: str,
        draw: str,
        outcome: str,
        detail: str,
        now: float,
    ) -> None:
        """Inside the verdict's transaction: the "house canary" entry ("caught" after the
        dispute that convicted it; "convicted" before the rejection of a batch its validator
        agreed on), which burns the key."""
        t = self.t
        c.execute(
            "INSERT OR REPLACE INTO rl_house_canaries VALUES (?, ?, ?, ?)",
            (step, worker_id, validator_id, outcome),
        )
        t.accounts.append(
            c,
            "house canary",
            {
                "round": step,
                "peer_id": worker_id,
                "draw": draw,
                "proof": house_proof(t.identity, t.run_id, worker_id),
                "outcome": outcome,
                "detail": detail[:500],
            },
            now,
        )
        level = logging.INFO if outcome == "caught" else logging.WARNING
        log.log(
            level,
            "[%s - step %d] house canary of %s revealed: %s",
            validator_id[:8],
            step,
            worker_id[:8],
            outcome,
        )

    def counts(self) -> dict[str, int]:
        """Revealed canaries by outcome: caught, convicted (a validator passed it)."""
        rows = self.t.db.query(
            "SELECT outcome, COUNT(*) AS n FROM rl_house_canaries GROUP BY outcome"
        )
        return {r["outcome"]: r["n"] for r in rows}
