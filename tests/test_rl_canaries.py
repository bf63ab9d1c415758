"""The pure parts of RL canaries (covey.rl.canaries), in process: a house key's canary steps
are the trainer's signed draw below the rate, which the house worker (holding the trainer's
key) and the trainer compute alike and nobody else can; a canary batch has the shape and
size of the honest batch it is made from (same samples, tokens, proof lengths), and the
check of any single prefilled sample rejects it while the honest batch passes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from covey.rl.batch import check_batch, rollout
from covey.rl.canaries import canary_batch
from covey.rl.runspec import RLSpec
from covey.rl.trainer import Trainer
from covey.trust.certify import canary_message, check_canary_draw, draw_value
from covey.trust.house import house_canary_draw, house_identity, house_proof
from covey.trust.identity import Identity
from covey.trust.ledger import LedgerError
from tests.test_ledger import Run

SPEC = RLSpec(group_size=4, samples_per_step=8, eval_prompts=2, eval_every=1000, max_new_tokens=6)


def test_a_house_keys_canary_steps_are_the_trainers_signed_draw() -> None:
    trainer, other = Identity.generate(), Identity.generate()
    house = house_identity(trainer, "run", 0).peer_id
    steps = [s for s in range(400) if house_canary_draw(trainer, "run", s, house, 0.25)]
    assert 60 < len(steps) < 140  # a quarter of 400 steps, give or take
    for s in steps[:5]:
        draw = house_canary_draw(trainer, "run", s, house, 0.25)
        assert draw is not None and check_canary_draw(trainer.public_key, "run", s, house, draw)
        assert not check_canary_draw(other.public_key, "run", s, house, draw)
    assert house_canary_draw(trainer, "run", steps[0], house, 0.0) is None
    assert all(house_canary_draw(trainer, "run", s, house, 1.0) for s in range(20))


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    t = Trainer(tmp_path_factory.mktemp("canary") / "run", spec=SPEC, policy_dir="covey:nano")
    yield t
    t.stop()


def test_a_canary_batch_looks_like_its_honest_batch_and_every_sample_fails(
    trainer: Trainer,
) -> None:
    t = trainer
    honest = rollout(
        t.policy_at(0), t.task, t.rollout, step=0, worker_id="w", policy_version=0,
        policy_cid=t.cids[0],
    )  # fmt: skip
    bad = canary_batch(honest, b"\x07" * 32)
    assert len(bad.samples) == len(honest.samples)
    for h, b in zip(honest.samples, bad.samples, strict=True):
        assert b.tokens == h.tokens and b.reward == h.reward
        assert len(b.proof_bytes()) == len(h.proof_bytes()) and b.proof != h.proof
        assert len(b.logprobs) == len(h.logprobs) and all(x <= 0 for x in b.logprobs)
    size, bad_size = len(honest.model_dump_json()), len(bad.model_dump_json())
    assert abs(bad_size - size) < 0.05 * size  # no size a validator could sort on

    def verdict(batch: object, sample: int) -> bool:
        return check_batch(
            batch, spec=t.rollout, submitter="w", step=0, policy_cid=t.cids[0],
            policy_version=0, model=t.policy_at(0), task=t.task, verify_samples=[sample],
        ).ok  # fmt: skip

    assert verdict(honest, 0)
    assert not any(verdict(bad, i) for i in range(len(bad.samples)))


def test_the_ledger_takes_no_reveal_of_a_batch_nobody_checked(tmp_path: Path) -> None:
    """A reveal's grounds are in the ledger (covey.trust.convictions): it names a
    contribution accepted, agreed on by a validator or convicted, never an unknown one."""
    run = Run(tmp_path)
    house = house_identity(run.coord, "r" * 16, 0)
    run.add("join", peer_id=house.peer_id, public_key=house.public_key, name="h", role="worker")
    rnd = next(
        r
        for r in range(100)
        if draw_value(run.coord.sign(canary_message("r" * 16, r, house.peer_id))) < 0.5
    )
    with pytest.raises(LedgerError, match="no checked contribution of it in that round"):
        run.add(
            "house canary",
            round=rnd,
            peer_id=house.peer_id,
            draw=run.coord.sign(canary_message("r" * 16, rnd, house.peer_id)),
            proof=house_proof(run.coord, "r" * 16, house.peer_id),
            outcome="convicted",
            detail="made up",
        )
