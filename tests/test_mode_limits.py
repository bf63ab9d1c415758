"""The [limits] table of the RL and SWARM specs: the host's LimitsConfig, read through the one
spec loader (covey.spec, `--set limits.KEY=VALUE`), served by each mode's app. A table at
its defaults is what the apps used before the specs had one, and leaves the run id as it
was; a tiny join rate makes a flood of joins meet 429 sooner, and a body over the spec's
size meets 413 before any handler reads it. In-process apps (FastAPI TestClient) first,
then a real `covey rl trainer` and `covey swarm coordinator` given `--set`."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.config import LimitsConfig
from covey.errors import UserError
from covey.rl.runspec import RLSpec, run_id_of
from covey.spec import load_spec
from covey.swarm.config import SwarmConfig
from tests.rl_helpers import ROOT, SPEC, free_port, wait_for

TINY = {"n_layer": 2, "n_embd": 16, "n_head": 2, "seq_len": 8}
# two joins per address, then (almost) none: the count is exact however slow the machine
TIGHT = {"join_burst": 2, "join_rate": 0.001}


def first_429(post: Any, path: str, tries: int = 30) -> int:
    """How many unsigned joins from one address reach the handler before the first 429
    (each is refused there: it is not signed); `tries` when none is limited."""
    for i in range(tries):
        code = post(path, json={"run_id": "x"}).status_code
        assert code != 413, code
        if code == 429:
            return i
    return tries


def too_big(size: int) -> bytes:
    """A JSON body of `size` + 1 bytes."""
    pad = size + 1 - len(b'{"pad":""}')
    return b'{"pad":"' + b"a" * pad + b'"}'


# -- the specs -------------------------------------------------------------------------------


def test_a_default_limits_table_is_what_the_apps_used_and_changes_no_run_id() -> None:
    rl = RLSpec(max_batch_bytes=200_000)
    assert rl.limits == LimitsConfig(max_json_bytes=200_000)  # as covey.rl.service built it
    assert "limits" not in rl.model_dump() and "limits" not in RLSpec().model_dump()
    given = RLSpec.model_validate({"max_batch_bytes": 200_000, "limits": {"join_burst": 20}})
    assert given == rl and run_id_of(given, {}, "c" * 64, "k") == run_id_of(rl, {}, "c" * 64, "k")
    swarm = SwarmConfig(max_body_bytes=1 << 20)
    assert swarm.limits == LimitsConfig(
        max_json_bytes=1 << 20, max_blob_bytes=1 << 20, body_timeout_s=30.0
    )  # as covey.swarm.app built it
    assert "limits" not in swarm.model_dump()
    explicit = SwarmConfig.model_validate({"max_body_bytes": 1 << 20, "limits": swarm.limits})
    assert explicit.run_id == swarm.run_id


def test_set_reaches_the_limits_table_and_a_changed_table_is_a_new_run() -> None:
    rl = load_spec(RLSpec, None, {"max_batch_bytes": 4096}, ["limits.join_burst=2"])
    assert (rl.limits.join_burst, rl.limits.max_json_bytes) == (2, 4096)
    assert rl.model_dump()["limits"]["join_burst"] == 2  # in the dump, so in the run id
    assert run_id_of(rl, {}, "c" * 64, "k") != run_id_of(
        RLSpec(max_batch_bytes=4096), {}, "c" * 64, "k"
    )
    assert RLSpec.model_validate(rl.model_dump(mode="json")) == rl  # a peer reads it back
    swarm = load_spec(SwarmConfig, sets=["limits.peer_rate=0.5", "limits.body_timeout_s=5"])
    assert (swarm.limits.peer_rate, swarm.limits.body_timeout_s) == (0.5, 5.0)
    assert SwarmConfig.received(swarm.model_dump(mode="json")) == swarm
    assert swarm.run_id != SwarmConfig().run_id


def test_the_body_size_is_named_once() -> None:
    """limits.max_json_bytes is the mode's own body size: set apart from it, the loader
    names the field to set instead."""
    with pytest.raises(UserError, match="max_batch_bytes"):
        load_spec(RLSpec, sets=["limits.max_json_bytes=5000"])
    with pytest.raises(UserError, match="max_body_bytes"):
        load_spec(SwarmConfig, sets=["limits.max_json_bytes=70000"])
    with pytest.raises(UserError, match=r"limits\.join_burst"):
        load_spec(RLSpec, sets=["limits.join_burst=0"])
    with pytest.raises(UserError, match=r"unknown key 'no_such' in \[limits\]"):
        load_spec(SwarmConfig, sets=["limits.no_such=1"])


# -- the apps, in process --------------------------------------------------------------------


@contextlib.contextmanager
def rl_client(tmp: Path, spec: RLSpec) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from covey.rl.service import create_app
    from covey.rl.trainer import Trainer

    t = Trainer(tmp, spec=spec, policy_dir="covey:nano")
    try:
        yield TestClient(create_app(t))
    finally:
        t.stop()


@contextlib.contextmanager
def swarm_client(tmp: Path, cfg: SwarmConfig) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from covey.swarm.app import create_app
    from covey.swarm.service import SwarmCoordinator

    yield TestClient(create_app(SwarmCoordinator(cfg, tmp)))


def test_the_rl_app_serves_its_specs_limits(tmp_path: Path) -> None:
    spec = {"max_batch_bytes": 4096}
    with rl_client(tmp_path / "default", RLSpec(**spec)) as client:
        assert first_429(client.post, "/v1/join") >= 20  # LimitsConfig's join_burst
    tight = RLSpec.model_validate({**spec, "limits": TIGHT})
    with rl_client(tmp_path / "tight", tight) as client:
        assert first_429(client.post, "/v1/join") == 2
        headers = {"content-type": "application/json"}
        refused = client.post("/v1/rl/batch", content=too_big(4096), headers=headers)
        assert refused.status_code == 413, refused.text
        fits = client.post("/v1/rl/batch", content=too_big(4000), headers=headers)
        assert fits.status_code == 422, fits.text  # read, and refused by the handler


def test_the_swarm_app_serves_its_specs_limits(tmp_path: Path) -> None:
    body = {**TINY, "max_body_bytes": 1 << 16}
    with swarm_client(tmp_path / "default", SwarmConfig(**body)) as client:
        assert first_429(client.post, "/v1/swarm/join") >= 20
    tight = SwarmConfig.model_validate({**body, "limits": TIGHT})
    with swarm_client(tmp_path / "tight", tight) as client:
        assert first_429(client.post, "/v1/swarm/join") == 2
        headers = {"content-type": "application/json"}
        refused = client.post("/v1/swarm/report", content=too_big(1 << 16), headers=headers)
        assert refused.status_code == 413, refused.text


# -- real processes: the commands' --set -----------------------------------------------------


def spawn(log: Path, *args: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "covey", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )


def serving(proc: subprocess.Popen[bytes], url: str, log: Path) -> bool:
    assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-2000:]}"
    try:
        return httpx.get(f"{url}/v1/run", timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.mark.network
@pytest.mark.long  # the in-process tests above cover the limits; this one the real commands
@pytest.mark.parametrize("mode", ["rl", "swarm"])
def test_set_limits_on_the_real_commands(mode: str, tmp_path: Path) -> None:
    """`covey rl trainer` and `covey swarm coordinator` with `--set limits.join_burst=2`
    (and a tiny join_rate): the third join from an address is a 429, and GET /v1/run shows
    the table."""
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / f"{mode}.log"
    sets = [f"--set=limits.{k}={v}" for k, v in TIGHT.items()]
    if mode == "rl":
        (tmp_path / "rl.toml").write_text(SPEC)
        args = ["rl", "trainer", "--data-dir", str(tmp_path / "run"), "--policy", "covey:nano",
                "--spec", str(tmp_path / "rl.toml"), "--port", str(port), *sets]  # fmt: skip
    else:
        tiny = [f"--set={k}={json.dumps(v)}" for k, v in TINY.items()]
        args = ["swarm", "coordinator", "--data-dir", str(tmp_path / "run"),
                "--port", str(port), *tiny, *sets]  # fmt: skip
    proc = spawn(log, *args)
    try:
        wait_for(lambda: serving(proc, url, log), 120, f"the {mode} coordinator to serve")
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
            spec = http.get("/v1/run").json()["spec"]
            assert (spec["rl"] if mode == "rl" else spec)["limits"]["join_burst"] == 2
            join = "/v1/join" if mode == "rl" else "/v1/swarm/join"
            assert first_429(http.post, join) == 2
            assert http.get("/healthz").json() == {"ok": True}
    finally:
        stop(proc)
