"""Canaries in the RL mode: known-bad batches the trainer plants among a validator's checks,
so that a validator cannot be paid for checks it did not do (docs/trust.md;
the rounds mode's covey.coordinator.canary does the same for contributions).

For each policy version (step) s and validator V, the trainer signs (run, s, V)
(covey.trust.certify.canary_draw): V gets a canary at s when the draw is below
`canary_rate`, secret until revealed on the ledger, verifiable afterwards by anyone (the
book's "canary" handler checks the signature and the rate). The canary is a real batch of
step s that V was not assigned and that is still undecided (a decided one's content id is
public: the copy would be told apart at once), with every sample made bad in a way only a
prefill tells: each proof's coefficients replaced by a pseudo-random polynomial (its chunk
layout and moduli kept, so it parses like any proof) and each logprob lowered by 0.02
(still <= 0, 200x the fp32 tolerance). Its task looks like any other (content id, step,
worker, the trainer's draw of the samples to prefill). Reporting it bad is a caught canary
(a completed check, paid check_reward); reporting it good is "passed" (a "penalty" of kind
canary: validator_slash_fraction of its stake); not reporting within verify_timeout_s is
"missed" (a missed check). The "canary" ledger entry is written only then.

Known leak, shared with the rounds mode: the real batch's content id is public once it is
decided ("contribution accepted"), so a validator that waits for the real batch's verdict
before reporting can tell its canary from a real check; the deadline bounds that wait.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from covey.rl import proofs
from covey.rl.batch import RolloutBatch, draw_samples
from covey.trust.certify import canary_draw

if TYPE_CHECKING:
    from covey.rl.trainer_parts import TrainerParts

log = logging.getLogger("covey.rl.intake")
CANARY_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS rl_canaries (id INTEGER PRIMARY KEY AUTOINCREMENT, "
    "step INTEGER NOT NULL, validator_id TEXT NOT NULL, worker_id TEXT NOT NULL, "
    "real_cid TEXT NOT NULL, cid TEXT NOT NULL, samples INTEGER NOT NULL, draw TEXT NOT NULL, "
    "task_draw TEXT NOT NULL, status TEXT NOT NULL, placed_at REAL NOT NULL, "
    "UNIQUE (step, validator_id))",
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


class Canaries:
    """The RL trainer's canaries: planted at a validator's claim, resolved by its report or
    the deadline. Every method that takes `c` runs inside the caller's transaction."""

    def __init__(self, trainer: TrainerParts, assign_draw: Callable[[str], str]) -> None:
        """`assign_draw`: the trainer's assignment draw of a batch by its content id
        (covey.rl.intake.Intake.assign_draw)."""
        self.t, self.assign_draw = trainer, assign_draw

    def assigned(self, c: sqlite3.Connection, validator: str) -> sqlite3.Row | None:
        return c.execute(
            "SELECT * FROM rl_canaries WHERE validator_id = ? AND status = 'assigned' "
            "ORDER BY id LIMIT 1",
            (validator,),
        ).fetchone()

    def plant(self, c: sqlite3.Connection, validator: str, step: int) -> sqlite3.Row | None:
        """The canary `validator` gets at `step`, planted now if its draw says so and a
        batch of that step it was not assigned exists; None otherwise (or already drawn)."""
        t = self.t
        if t.spec.canary_rate <= 0:
            return None
        if c.execute(
            "SELECT 1 FROM rl_canaries WHERE step = ? AND validator_id = ?", (step, validator)
        ).fetchone():
            return None
        planted, draw = canary_draw(t.identity, t.run_id, step, validator, t.spec.canary_rate)
        if not planted:
            return None
        candidates = [
            r
            for r in c.execute(
                "SELECT * FROM rl_batches WHERE step = ? AND cid != '' AND samples > 0 AND "
                "status IN ('pending', 'claimed') ORDER BY id",
                (step,),
            ).fetchall()
            if validator not in json.loads(r["tried"]) and r["worker_id"] != validator
        ]
        if not candidates:
            return None
        real = candidates[int(hashlib.sha256(draw.encode()).hexdigest(), 16) % len(candidates)]
        bad = canary_batch(
            RolloutBatch.model_validate_json(t.blobs.get(real["cid"])), bytes.fromhex(draw)[:32]
        )
        cid = t.blobs.put(bad.model_dump_json().encode())
        tried = json.loads(real["tried"])  # never assigned the real batch too: no twin tasks
        c.execute(
            "UPDATE rl_batches SET tried = ? WHERE id = ?",
            (json.dumps(sorted({*tried, validator})), real["id"]),
        )
        task_draw = t.identity.sign(f"covey-rl-draw/v1\n{t.run_id}\n{cid}\n{validator}".encode())
        c.execute(
            "INSERT INTO rl_canaries (step, validator_id, worker_id, real_cid, cid, samples, "
            "draw, task_draw, status, placed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'assigned', ?)",
            (
                step,
                validator,
                real["worker_id"],
                real["cid"],
                cid,
                real["samples"],
                draw,
                task_draw,
                time.time(),
            ),
        )
        log.info("[trainer - step %d] canary %s for %s", step, cid[:12], validator[:8])
        return self.assigned(c, validator)

    def of_report(self, c: sqlite3.Connection, validator: str, cid: str) -> sqlite3.Row | None:
        return c.execute(
            "SELECT * FROM rl_canaries WHERE validator_id = ? AND cid = ? AND status = 'assigned'",
            (validator, cid),
        ).fetchone()

    def resolve(self, c: sqlite3.Connection, row: sqlite3.Row, outcome: str, now: float) -> None:
        """Reveal the canary on the ledger: caught (a paid check), passed (a penalty),
        missed (a missed check)."""
        t, validator = self.t, row["validator_id"]
        c.execute("UPDATE rl_canaries SET status = ? WHERE id = ?", (outcome, row["id"]))
        base = {"round": row["step"], "peer_id": validator}
        t.accounts.append(
            c,
            "canary",
            {**base, "worker_id": row["worker_id"], "cid": row["cid"], "draw": row["draw"]}
            | {"outcome": outcome},
            now,
        )
        if outcome == "caught" and t.spec.check_reward > 0:
            t.accounts.append(
                c,
                "reward",
                {**base, "amount": t.spec.check_reward, "kind": "check", "tokens": 0},
                now,
            )
        elif outcome == "passed":
            t.accounts.append(
                c,
                "penalty",
                {
                    **base,
                    "amount": t.accounts.book.penalty_amount(validator),
                    "kind": "canary",
                    "reason": f"accepted canary {row['cid'][:12]} (batch {row['real_cid'][:12]} "
                    f"with its proofs and logprobs made bad)",
                },
                now,
            )
        level = logging.INFO if outcome == "caught" else logging.WARNING
        log.log(level, "[%s - step %d] canary %s", validator[:8], row["step"], outcome)

    def sweep(self, now: float) -> None:
        """Canaries not reported within verify_timeout_s are missed."""
        t = self.t
        late = t.db.query(
            "SELECT * FROM rl_canaries WHERE status = 'assigned' AND placed_at < ?",
            (now - t.spec.verify_timeout_s,),
        )
        for row in late:
            with t.accounts.transaction() as c:
                fresh = c.execute("SELECT status FROM rl_canaries WHERE id = ?", (row["id"],))
                if fresh.fetchone()[0] == "assigned":
                    self.resolve(c, row, "missed", now)

    def counts(self) -> dict[str, int]:
        rows = self.t.db.query("SELECT status, COUNT(*) AS n FROM rl_canaries GROUP BY status")
        return {r["status"]: r["n"] for r in rows}

    def task(self, row: sqlite3.Row) -> dict[str, Any]:
        """What the validator is handed: the same fields as a real check's task."""
        return {
            "batch_cid": row["cid"],
            "step": row["step"],
            "worker_id": row["worker_id"],
            "policy_version": row["step"],
            "policy_cid": self.t.cids[row["step"]],
            "draw": row["task_draw"],
            "assign_draw": self.assign_draw(row["cid"]),
            "verify_samples": draw_samples(
                row["cid"], row["task_draw"], row["samples"], self.t.spec.verify_samples
            ),
        }
