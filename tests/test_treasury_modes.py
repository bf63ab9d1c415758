"""Stake is held, not declared, in the RL, SWARM and serving modes, each against a real
coordinator process on 127.0.0.1 (a `covey rl trainer`, `covey swarm coordinator`,
`covey serve server`); the test is a key signing its own join as any peer would. A key that
bonds more than it holds is refused with an error naming its balance, and nothing is
written; a key the spec's `[trust.funds]` grants credits bonds them; `covey ledger verify`
accepts the honest ledger, and refuses a copy re-signed by the coordinator with a bond above
the key's balance, with funds the spec did not grant, or with the mode's treasury terms
bent (stakes declared)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.io import audit
from covey.rl.ledger_terms import ledger_terms as rl_terms
from covey.serve.config import ServeConfig
from covey.serve.config import ledger_terms as serve_terms
from covey.swarm.config import SwarmConfig
from covey.swarm.launch import Swarm
from covey.swarm.ledger_evidence import ledger_terms as swarm_terms
from covey.trust.identity import Identity, request_purpose
from covey.trust.ledger import LedgerError
from covey.trust.policy import Policy
from tests.rl_helpers import ROOT, trainer_process
from tests.rl_helpers import SPEC as RL_SPEC
from tests.serve_helpers import server_process, tiny_served_model
from tests.test_checks import resigned

pytestmark = pytest.mark.network
TERMS = [rl_terms, swarm_terms, serve_terms]  # what `covey ledger verify` registers

Join = Callable[[Identity, float], httpx.Response]


def post(url: str, path: str, ident: Identity, body: dict[str, Any]) -> httpx.Response:
    signed = ident.sign_request(body, -1, purpose=request_purpose(path))
    return httpx.post(f"{url}{path}", json=signed, timeout=30)


def peer_join(base: str, path: str = "/v1/join", **extra: Any) -> Join:
    """A join of `path` (an RL or serving worker's, or a SWARM server's) by a key staking
    `stake` credits."""
    run_id = httpx.get(f"{base}/v1/run", timeout=30).json()["run_id"]

    def join(ident: Identity, stake: float) -> httpx.Response:
        body = {"run_id": run_id, "peer_id": ident.peer_id, "public_key": ident.public_key,
                "name": "k", "stake": stake, **extra}  # fmt: skip
        return post(base, path, ident, body)

    return join


def ledger_verify(source: str | Path) -> subprocess.CompletedProcess[str]:
    """`covey ledger verify SOURCE` as a user runs it (the command registers every mode's
    treasury terms)."""
    return subprocess.run(
        [sys.executable, "-m", "covey", "ledger", "verify", str(source)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def held_not_declared(
    url: str,
    join: Join,
    funded: Identity,
    stake: float,
    owner: Identity,
    tmp: Path,
    cli: bool = False,
) -> None:
    """The checks every mode passes; `funded` holds `stake` credits from the spec's funds,
    `owner` is the coordinator's key (the one that signs the ledger). `cli`: also run
    `covey ledger verify` on the honest ledger and the copy with stakes declared."""
    before = audit.load(url)[0]
    assert [e.payload["amount"] for e in before if e.type == "deposit"] == [stake]
    poor = Identity.generate()
    r = join(poor, stake)
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert f"stake {stake} is more than key {poor.peer_id[:12]} holds (0 credits" in error, error
    assert len(audit.load(url)[0]) == len(before)  # nothing written
    assert join(funded, stake).status_code == 200
    entries = audit.load(url)[0]
    [bond] = [e for e in entries if e.type == "stake"]
    assert bond.payload == {"peer_id": funded.peer_id, "amount": stake}
    honest = audit.verify(url, terms=TERMS)
    assert honest.summary["accounts"][funded.peer_id]["stake"] == stake
    if cli:
        done = ledger_verify(url)
        assert done.returncode == 0 and "ledger OK" in done.stdout, done.stdout + done.stderr

    def bonds_more(e: Any) -> tuple[str, dict[str, Any]]:
        return e.type, {**e.payload, "amount": 10 * stake} if e.type == "stake" else e.payload

    forged = resigned(entries, owner, tmp / "bond", bonds_more)
    with pytest.raises(LedgerError, match=r"stake: stake .* is more than key .* holds") as e:
        audit.verify(forged, terms=TERMS)
    assert e.value.index == bond.index

    def declared(e: Any) -> tuple[str, dict[str, Any]]:
        if e.type != "run created":
            return e.type, e.payload
        return e.type, {**e.payload, "policy": {**e.payload["policy"], "held_stake": 0}}

    def minted(e: Any) -> tuple[str, dict[str, Any]]:
        """The spec in "run created" granting the key 100 times what the run's spec did,
        and the deposit to match: a coordinator minting credits the spec never gave."""
        payload = copy.deepcopy(e.payload)
        if e.type == "run created":
            spec = payload["spec"]
            table = spec.get("rl") or spec.get("serve") or spec
            table["trust"]["funds"][funded.public_key] *= 100
        elif e.type == "deposit":
            payload["amount"] *= 100
        return e.type, payload

    with pytest.raises(LedgerError, match="spec hashes to"):
        audit.verify(resigned(entries, owner, tmp / "minted", minted), terms=TERMS)

    bent = resigned(entries, owner, tmp / "declared", declared)
    with pytest.raises(LedgerError, match=r"policy\.held_stake is 0, but the spec gives 1"):
        audit.verify(bent, terms=TERMS)
    if cli:
        done = ledger_verify(bent)
        assert done.returncode == 1 and "ledger INVALID" in done.stdout, done.stdout + done.stderr
        assert "policy.held_stake is 0, but the spec gives 1" in done.stdout


@pytest.mark.long  # the swarm and serving tests run the same rules by default
def test_rl_stake_is_held(tmp_path: Path) -> None:
    funded = Identity.generate()
    spec = RL_SPEC + f'[trust.funds]\n"{funded.public_key}" = 1.0\n'
    data = tmp_path / "trainer"
    with trainer_process(data, spec) as url:
        join = peer_join(url, step_time_s=1.0)
        owner = Identity.load_or_create(data / "trainer.key")
        held_not_declared(url, join, funded, 1.0, owner, tmp_path, cli=True)


def test_swarm_stake_is_held(tmp_path: Path) -> None:
    funded = Identity.generate()
    settings = {"n_layer": 2, "n_embd": 16, "n_head": 2, "seq_len": 8, "stages": 2,
                "trust": {"funds": {funded.public_key: 10.0}}}  # fmt: skip
    swarm = Swarm(tmp_path / "swarm", settings)
    try:
        swarm.start_coordinator()
        join = peer_join(
            swarm.url,
            "/v1/swarm/join",
            role="server",
            url="http://127.0.0.1:9",
            blob_url="http://127.0.0.1:9",
        )
        owner = Identity.load_or_create(tmp_path / "swarm" / "run" / "coordinator.key")
        held_not_declared(swarm.url, join, funded, 10.0, owner, tmp_path)
    finally:
        swarm.close()


def test_serve_stake_is_held(tmp_path: Path) -> None:
    funded = Identity.generate()
    model = tiny_served_model(tmp_path / "model")
    sets = (f"trust.funds={json.dumps({funded.public_key: 10.0})}",)
    with server_process(tmp_path, model, sets) as (url, _):
        join = peer_join(url, step_time_s=1.0)
        owner = Identity.load_or_create(tmp_path / "server" / "coordinator.key")
        held_not_declared(url, join, funded, 10.0, owner, tmp_path)


def test_each_modes_unbonding_period_is_its_longest_round() -> None:
    """The stated formulas (docs/trust.md, "Stake is held"): RL 5 x verify_timeout_s,
    SWARM 9 x request_timeout_s + 2 x round_timeout_s + payout_s, serving
    request_timeout_s + 5 x claim_timeout_s; each policy holds stakes."""
    from covey.rl.runspec import RLSpec, ledger_policy

    rl = RLSpec()
    assert ledger_policy(rl).unbonding_s == 5 * rl.verify_timeout_s == 300.0
    swarm = SwarmConfig()
    assert swarm.policy().unbonding_s == (
        9 * swarm.request_timeout_s + 2 * swarm.round_timeout_s + swarm.payout_s
    ) == 115.0  # fmt: skip
    serve = ServeConfig()
    assert serve.policy().unbonding_s == (
        serve.request_timeout_s + 5 * serve.claim_timeout_s
    ) == 210.0  # fmt: skip
    policies: list[Policy] = [ledger_policy(rl), swarm.policy(), serve.policy()]
    assert all(p.held_stake == 1 for p in policies)


def test_the_modes_accept_spec_funds_and_keep_run_ids_without_them() -> None:
    from covey.rl.runspec import RLSpec
    from covey.trust.treasury import spec_funds

    key = Identity.generate().public_key
    assert "trust" not in RLSpec().model_dump() and "trust" not in SwarmConfig().model_dump()
    rl = RLSpec.model_validate({"trust": {"funds": {key: 2}}})
    assert spec_funds({"rl": rl.model_dump(mode="json"), "model": {}}) == {key: 2.0}
    swarm = SwarmConfig.model_validate({"trust": {"funds": {key: 3}}})
    assert spec_funds(swarm.model_dump(mode="json")) == {key: 3.0}
    assert swarm.run_id != SwarmConfig().run_id  # the grant is part of the run
    serve = ServeConfig.model_validate({"trust": {"funds": {key: 4}}})
    assert spec_funds({"serve": serve.model_dump(mode="json"), "model": "m"}) == {key: 4.0}
    for bad in ({"alice": 1.0}, {key: 0.0}):
        for model in (RLSpec, SwarmConfig, ServeConfig):
            with pytest.raises(ValueError, match="funds"):
                model.model_validate({"trust": {"funds": bad}})
