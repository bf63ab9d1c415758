"""RL validators get what rounds-mode validators have: canaries the trainer plants
(a known-bad copy of a real batch that a validator must reject), a cap on the batches one
validator checks per policy version, and the audit's "missed fraud" penalty; `covey ledger
verify` replays all of it. One trainer process for the module, canary_rate 1 (every
validator gets a canary at every step), validator_round_cap 1."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from covey.io.audit import verify as verify_ledger
from tests.rl_helpers import (
    batch_status,
    joined_worker,
    ledger,
    policy,
    trainer_process,
    validator,
    wait_for,
)

pytestmark = pytest.mark.network
SPEC = """
group_size = 4
samples_per_step = 1000
audit_rate = 0.0
verify_timeout_s = 4
eval_prompts = 4
eval_every = 1000
heartbeat_s = 1
dead_after_s = 3
max_batch_bytes = 200000
canary_rate = 1.0
validator_round_cap = 1
"""


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with trainer_process(tmp_path_factory.mktemp("rlv") / "run", SPEC) as url:
        yield url


def _canaries(url: str, validator_id: str) -> list[dict[str, Any]]:
    return [e["payload"] for e in ledger(url, "canary", validator_id)]


def _submit(url: str, n: int) -> tuple[list[Any], int]:
    workers = [joined_worker(url) for _ in range(n)]
    info = policy(url)
    for w in workers:
        assert w.step(info) is not None
    return workers, info["version"]


def _all_decided(url: str, workers: list[Any]) -> bool:
    rows = [r for w in workers for r in batch_status(url, w.identity.peer_id)]
    return len(rows) == len(workers) and all(
        r["status"] not in ("pending", "claimed") for r in rows
    )


def test_honest_validator_catches_its_canary_and_a_lazy_one_is_penalized(trainer: str) -> None:
    workers, step = _submit(trainer, 3)
    with validator(trainer) as honest:
        wait_for(lambda: _canaries(trainer, honest.identity.peer_id), 60, "the canary's verdict")
        [canary] = _canaries(trainer, honest.identity.peer_id)
        assert canary["outcome"] == "caught" and canary["round"] == step
        assert canary["worker_id"] in {w.identity.peer_id for w in workers}
        first = honest.reports[0]  # its first claim at this step was the canary
        assert first["outcome"] == "canary caught" and first["problem"] in ("proof", "logprobs")
        checks = [
            e
            for e in ledger(trainer, "reward", honest.identity.peer_id)
            if e["payload"]["kind"] == "check"
        ]
        assert checks  # a caught canary is a completed, paid check
        assert not ledger(trainer, "penalty", honest.identity.peer_id)
        # every real batch is decided: by it (one per step at most) or by the trainer
        wait_for(lambda: _all_decided(trainer, workers), 60, "every batch decided")
        rows = [r for w in workers for r in batch_status(trainer, w.identity.peer_id)]
        assert all(r["status"] == "accepted" for r in rows), rows
        mine = [r for r in rows if r["validator_id"] == honest.identity.peer_id]
        assert len(mine) <= 1, f"validator_round_cap 1, it checked {len(mine)} at step {step}"
        assert len(honest.reports) <= 2
    with validator(trainer, "lazy") as lazy:
        more, _ = _submit(trainer, 1)
        wait_for(lambda: _canaries(trainer, lazy.identity.peer_id), 60, "the lazy canary")
        [canary] = _canaries(trainer, lazy.identity.peer_id)
        assert canary["outcome"] == "passed"
        [penalty] = ledger(trainer, "penalty", lazy.identity.peer_id)
        assert penalty["payload"]["kind"] == "canary" and "canary" in penalty["payload"]["reason"]
        status = httpx.get(f"{trainer}/v1/rl/status").json()
        assert status["canaries"].get("caught", 0) >= 1 and status["canaries"]["passed"] == 1
        assert 'id="canaries"' in httpx.get(f"{trainer}/").text  # the status page shows them
        assert status["accounts"][lazy.identity.peer_id]["counts"]["canaries_passed"] == 1
        wait_for(lambda: _all_decided(trainer, more), 60, "the lazy step's batch decided")
    for w in workers + more:
        w.membership.leave()


def test_an_unreported_canary_is_missed_and_the_ledger_replays(trainer: str) -> None:
    from covey.rl.validator import RolloutValidator
    from covey.trust.identity import Identity

    silent = RolloutValidator(trainer, Identity.generate(), name="silent")
    silent.membership.join("validator", silent.name, silent.stake)
    workers, _ = _submit(trainer, 1)
    body = {"run_id": silent.run.run_id, "peer_id": silent.identity.peer_id}
    task = wait_for(lambda: silent.client.post("/v1/rl/claim", body)["task"], 30, "a claim")
    again = silent.client.post("/v1/rl/claim", body)["task"]
    assert again == task  # the same canary until it is reported or missed
    started = time.monotonic()
    wait_for(lambda: _canaries(trainer, silent.identity.peer_id), 60, "the missed canary")
    [canary] = _canaries(trainer, silent.identity.peer_id)
    assert canary["outcome"] == "missed" and canary["cid"] == task["batch_cid"]
    assert time.monotonic() - started < 60
    assert not ledger(trainer, "penalty", silent.identity.peer_id)  # missed, not passed
    status = httpx.get(f"{trainer}/v1/rl/status").json()
    assert status["accounts"][silent.identity.peer_id]["counts"]["missed_checks"] == 1
    wait_for(lambda: _all_decided(trainer, workers), 60, "the batch decided")
    silent.membership.leave("done")
    for w in workers:
        w.membership.leave()
    report = verify_ledger(trainer)  # what `covey ledger verify URL` runs: raises if bad
    accounts = report.summary["accounts"]
    assert accounts[silent.identity.peer_id]["counts"]["missed_checks"] == 1
    assert sum(a["counts"]["canaries_passed"] for a in accounts.values()) == 1  # the lazy one
