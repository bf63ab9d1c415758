"""The stake that makes cheating unprofitable (covey.config.deterrent_stake), and the
run's minimum stake that follows its sampling rate when the spec leaves it unset
(covey.config.RunConfig.min_stake): a cheated round's expected value is negative at that
stake and positive below it, at every rate. The real coordinator's side is in
tests/test_treasury_network.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from covey.config import RunConfig, TrustConfig, deterrent_stake
from covey.trust.policy import Policy


def cheat_value(p: float, f: float, stake: float, pay: float) -> float:
    """A cheated round's expected value: undrawn, its pay and the compute it saved (worth
    at most the pay); drawn, the pay is lost and f x stake slashed."""
    return (1 - p) * 2 * pay - p * f * stake


@pytest.mark.parametrize("p", [0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("f", [0.1, 0.5, 1.0])
def test_cheating_does_not_pay_from_the_deterrent_stake_and_pays_below_it(
    p: float, f: float
) -> None:
    pay = 102.4
    stake = deterrent_stake(p, f, pay)
    assert cheat_value(p, f, stake, pay) <= 1e-9
    assert cheat_value(p, f, stake * 0.99, pay) > 0


def test_no_stake_deters_where_nothing_is_checked_or_slashed() -> None:
    assert deterrent_stake(0.0, 0.5, 100.0) == 0.0
    assert deterrent_stake(0.1, 0.0, 100.0) == 0.0
    assert deterrent_stake(1.0, 0.5, 100.0) == 0.0  # every round is checked


def test_the_default_run_asks_the_stake_its_default_rate_needs() -> None:
    spec = RunConfig()
    assert spec.trust.min_stake is None and spec.trust.sample_rate == 0.03
    pay = spec.round_pay(256)  # H x batch x context tokens at reward_per_token
    assert pay == pytest.approx(0.001 * 50 * 8 * 256)
    least = spec.min_stake(256)
    assert least == math.ceil(2 * pay * 0.97 / (0.03 * 0.5)) == 13244
    assert cheat_value(0.03, 0.5, least, pay) < 0
    # the policy the coordinator signs carries it
    policy = Policy.from_config(spec.trust, 60.0, held_stake=True, min_stake=least)
    assert policy.min_stake == least


def test_a_lower_rate_asks_more_and_a_stated_stake_is_kept() -> None:
    low = RunConfig.model_validate({"trust": {"sample_rate": 0.01}})
    assert low.min_stake(256) > RunConfig().min_stake(256)
    stated = RunConfig.model_validate({"trust": {"min_stake": 7.0}})
    assert stated.min_stake(256) == 7.0
    # 0: a run defended by detection alone, as stated
    assert RunConfig.model_validate({"trust": {"min_stake": 0}}).min_stake(256) == 0.0
    # a spec that states it is read back the same; an unset one is unset
    assert Policy.from_config(TrustConfig(min_stake=7.0), 60.0, min_stake=99.0).min_stake == 7.0
    assert Policy.from_config(TrustConfig(), 60.0).min_stake == 0.0


@pytest.mark.parametrize(
    "reply",
    [
        [],
        {},
        {"min_stake": "13244"},
        {"min_stake": {"worker": -1.0}},
        {"min_stake": {"worker": True}},
        {"min_stake": {"worker": float("nan")}},
    ],
)
def test_a_worker_without_stake_refuses_a_coordinator_that_names_no_minimum(reply: object) -> None:
    """A worker started without --stake bonds what GET /v1/ledger/balances names; a reply
    without a non-negative number there is a RuntimeError (what `Worker.run` turns into a
    logged error and exit status 1), not a traceback or a stake it made up."""
    from covey.peer.worker import Worker

    asks = SimpleNamespace(client=SimpleNamespace(get=lambda path: reply))
    with pytest.raises(RuntimeError, match="names no minimum stake"):
        Worker._run_min_stake(asks)  # type: ignore[arg-type]
    fine = SimpleNamespace(client=SimpleNamespace(get=lambda path: {"min_stake": {"worker": 39}}))
    assert Worker._run_min_stake(fine) == 39.0  # type: ignore[arg-type]
