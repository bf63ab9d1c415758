"""The coordinator's host parts in the RL and SWARM modes, over real processes on 127.0.0.1:
`covey halt` (the real CLI) stops an RL trainer with a worker and a validator, and a SWARM
coordinator with its stage servers and a trainer; each process exits on its own with the
halted status (covey.trust.halt.EXIT_HALTED) and `covey ledger verify` (the real CLI)
accepts the ledger with its signed HALT. Forged and replayed HALTs are refused and change
nothing; /healthz and /metrics answer in both modes; a flood of unsigned joins gets 429.
(The rounds mode's are tests/test_halt.py, tests/test_metrics.py and tests/test_dos.py.)

Each mode's run is a module fixture: the tests that halt it come last in the file."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from covey.swarm.launch import Swarm
from covey.trust.halt import EXIT_HALTED, HALT_PATH
from covey.trust.identity import NO_ROUND, Identity, request_purpose
from tests.rl_helpers import ROOT, fund, trainer_process, wait_for
from tests.swarm_helpers import SETTINGS

pytestmark = pytest.mark.network
REASON = "the owner stops it here"


def covey(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "covey", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def spawn(log: Path, *args: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "covey", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )


def exit_code(proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"still running {timeout_s} s after the HALT:\n{tail(log)}") from None


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30, trust_env=False)


def halts(url: str) -> list[dict[str, Any]]:
    entries = httpx.get(f"{url}/v1/ledger", params={"limit": 5000}, timeout=30).json()
    return [e for e in entries if e["type"] == "halt"]


def metrics(url: str) -> dict[str, Any]:
    """GET /metrics parsed: family name -> family."""
    resp = httpx.get(f"{url}/metrics", timeout=30, trust_env=False)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def value(family: Any, **labels: str) -> float:
    return sum(
        s.value
        for s in family.samples
        if all(s.labels.get(k) == v for k, v in labels.items()) and not s.name.endswith("_created")
    )


def forgeries_are_refused(url: str, run_id: str, owner: Identity) -> None:
    """A stranger's key (403), the owner's key without its signature (401), the owner's
    HALT of another run (409) and the owner's signature for another endpoint (401) are
    refused, and the ledger holds no HALT after them."""
    before = len(httpx.get(f"{url}/v1/ledger", params={"limit": 5000}, timeout=30).json())
    purpose = request_purpose(HALT_PATH)
    stranger = Identity.generate()
    body = {"run_id": run_id, "owner_key": stranger.public_key, "reason": "mine now"}
    refused = post(url, HALT_PATH, stranger.sign_request(body, NO_ROUND, purpose=purpose))
    assert refused.status_code == 403 and "not the owner key" in refused.text, refused.text

    forged = stranger.sign_request({**body, "owner_key": owner.public_key}, purpose=purpose)
    refused = post(url, HALT_PATH, forged)
    assert refused.status_code == 401, refused.text

    other_run = {"run_id": "0123456789abcdef", "owner_key": owner.public_key, "reason": "x"}
    refused = post(url, HALT_PATH, owner.sign_request(other_run, purpose=purpose))
    assert refused.status_code == 409, refused.text

    elsewhere = request_purpose("/v1/leave")  # the owner's signature, for another endpoint
    own = {"run_id": run_id, "owner_key": owner.public_key, "reason": "x"}
    refused = post(url, HALT_PATH, owner.sign_request(own, purpose=elsewhere))
    assert refused.status_code == 401, refused.text

    assert halts(url) == []
    after = httpx.get(f"{url}/v1/ledger", params={"limit": 5000}, timeout=30).json()
    assert len(after) == before  # nothing was written


def halt_and_verify(url: str, key: Path, run_id: str, source: str) -> dict[str, Any]:
    """`covey halt` as the owner, then `covey ledger verify SOURCE`: the HALT entry."""
    done = covey("halt", "--coordinator", url, "--key", str(key), "--reason", REASON,
                 "--run-id", run_id)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "HALTED" in done.stdout and REASON in done.stdout
    (entry,) = halts(url)
    assert entry["payload"]["reason"] == REASON and entry["payload"]["request"]["signature"]
    return entry


def verify_ledger(source: str) -> None:
    verified = covey("ledger", "verify", source)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "ledger OK" in verified.stdout and "HALTED by its owner" in verified.stdout


def replay_is_refused(url: str, entry: dict[str, Any]) -> None:
    """The signed HALT, taken from the ledger and sent again, is refused (its nonce is
    used) and changes nothing."""
    again = post(url, HALT_PATH, entry["payload"]["request"])
    assert again.status_code == 401, again.text
    assert len(halts(url)) == 1


def flood_gets_429(url: str, join_path: str) -> None:
    """Unsigned joins from one address: the first few reach the handler (and are
    refused), then the rate limiter answers 429 without running it; GETs still work."""
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        codes = [http.post(join_path, json={"run_id": "x"}).status_code for _ in range(40)]
        limited = [c for c in codes if c == 429]
        assert len(limited) >= 10 and 429 not in codes[:5], codes
        assert http.get("/healthz").json() == {"ok": True}


# -- RL ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    data = tmp_path_factory.mktemp("rl-halt") / "trainer"
    with trainer_process(data) as url:
        run_id = httpx.get(f"{url}/v1/run", timeout=30).json()["run_id"]
        yield url, data, run_id


def test_rl_healthz_and_metrics(rl_run: tuple[str, Path, str]) -> None:
    url = rl_run[0]
    assert httpx.get(f"{url}/healthz", timeout=30).json() == {"ok": True}
    run = httpx.get(f"{url}/v1/run", timeout=30).json()
    assert run["mode"] == "rl" and run["coordinator_key"] and run["spec"]["rl"]
    families = metrics(url)
    assert value(families["covey_rl_policy_version"]) == 0
    assert value(families["covey_ledger_height"]) >= 2  # run created, checkpoint 0
    assert "covey_live_peers" in families and "covey_rl_batches" in families
    again = metrics(url)  # the first scrape is counted by route template
    assert value(again["covey_http_requests"], route="/metrics", status="200") >= 1
    shows_the_shared_frame(url, run["run_id"])
    serves_blobs_by_the_shared_route(url, run["policy0"])


def test_a_rounds_worker_is_told_it_found_an_rl_trainer(rl_run: tuple[str, Path, str]) -> None:
    """GET /v1/run names the mode: `covey worker` refuses an RL trainer at once, naming
    the command that fits it."""
    done = covey("worker", "--coordinator", rl_run[0], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "in rl mode" in done.stderr and "covey rl worker" in done.stderr, done.stderr


def test_rl_forged_halts_are_refused(rl_run: tuple[str, Path, str]) -> None:
    url, data, run_id = rl_run
    forgeries_are_refused(url, run_id, Identity.load_or_create(data / "trainer.key"))


@pytest.mark.long  # the SWARM and rounds halts run by default through the same host
def test_covey_halt_stops_an_rl_run(rl_run: tuple[str, Path, str], tmp_path: Path) -> None:
    url, data, run_id = rl_run
    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "validator")}
    keys = {name: tmp_path / f"{name}.key" for name in logs}
    for name, stake in (("worker", 1.0), ("validator", 10.0)):  # what each stakes: funded
        fund(url, Identity.load_or_create(keys[name]).public_key, stake)
    procs = {
        "worker": spawn(logs["worker"], "rl", "worker", "--trainer", url, "--name", "w1",
                        "--identity", str(keys["worker"])),
        "validator": spawn(logs["validator"], "rl", "validator", "--trainer", url,
                           "--identity", str(keys["validator"])),
    }  # fmt: skip
    try:
        wait_for(lambda: value(metrics(url)["covey_live_peers"]) >= 2, 120, "worker and validator")
        entry = halt_and_verify(url, data / "trainer.key", run_id, str(data))
        for name, proc in procs.items():  # each learns it from a heartbeat or a request
            assert exit_code(proc, 30, logs[name]) == EXIT_HALTED, tail(logs[name])
            assert REASON in logs[name].read_text()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    version = httpx.get(f"{url}/v1/rl/policy", timeout=30).json()["version"]
    assert entry["payload"]["round"] <= version
    late = Identity.generate()
    join = {"run_id": run_id, "peer_id": late.peer_id, "public_key": late.public_key,
            "name": "late", "stake": 1.0, "step_time_s": 1.0}  # fmt: skip
    refused = post(url, "/v1/join", late.sign_request(join, purpose=request_purpose("/v1/join")))
    assert refused.status_code == 410 and REASON in refused.text, refused.text
    status = httpx.get(f"{url}/v1/rl/status", timeout=30).json()
    assert status["halted"]["reason"] == REASON
    replay_is_refused(url, entry)
    verify_ledger(str(data))  # the data directory's coordinator.db
    verify_ledger(url)  # and over HTTP, with the trainer's reported balances
    time.sleep(0.5)  # the learning loop took no step after the HALT
    assert httpx.get(f"{url}/v1/rl/policy", timeout=30).json()["version"] == version


def test_rl_join_flood_gets_429(rl_run: tuple[str, Path, str]) -> None:
    flood_gets_429(rl_run[0], "/v1/join")


# -- SWARM -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    work = tmp_path_factory.mktemp("swarm-halt")
    data = work / "data.txt"
    data.write_text((ROOT / "README.md").read_text() * 2)
    s = Swarm(work, {**SETTINGS, "data_paths": [str(data)]})
    try:
        s.start_coordinator()
        s.start_server("a0", "--emulate-s", "0.01", "--stage", "0")
        s.start_server("b0", "--emulate-s", "0.01", "--stage", "1")
        s.ready(["a0", "b0"])
        yield s
    finally:
        s.close()


def test_swarm_healthz_and_metrics(swarm: Swarm) -> None:
    url = swarm.url
    assert httpx.get(f"{url}/healthz", timeout=30).json() == {"ok": True}
    run = httpx.get(f"{url}/v1/run", timeout=30).json()
    assert run["mode"] == "swarm" and run["coordinator_key"] and run["spec"]["stages"] == 2
    families = metrics(url)
    assert value(families["covey_swarm_servers"], stage="0") == 1
    assert value(families["covey_swarm_servers"], stage="1") == 1
    assert value(families["covey_swarm_stages"]) == 2
    assert value(families["covey_ledger_height"]) >= 3  # run created, two joins
    assert value(families["covey_peers"]) >= 2
    assert value(families["covey_live_peers"], role="server") == 2
    again = metrics(url)
    assert value(again["covey_http_requests"], route="/metrics", status="200") >= 1
    host = shows_the_shared_frame(url, run["run_id"])
    assert host["live"]["server"] == 2


def serves_blobs_by_the_shared_route(url: str, cid: str) -> None:
    """The host's blob route (covey.coordinator.peer_routes): whole, one range, HEAD; a
    path that is not a content id, an unknown id and a range past the end are refused."""
    whole = httpx.get(f"{url}/v1/blobs/{cid}", timeout=30)
    assert whole.status_code == 200 and len(whole.content) > 10
    part = httpx.get(f"{url}/v1/blobs/{cid}", headers={"Range": "bytes=2-9"}, timeout=30)
    assert part.status_code == 206 and part.content == whole.content[2:10]
    head = httpx.head(f"{url}/v1/blobs/{cid}", timeout=30)
    assert int(head.headers["content-length"]) == len(whole.content)
    past = f"bytes={len(whole.content) + 5}-{len(whole.content) + 9}"
    assert (
        httpx.get(f"{url}/v1/blobs/{cid}", headers={"Range": past}, timeout=30).status_code == 416
    )
    for bad in ("..%2f..%2fetc%2fpasswd", "ab" * 31 + "zz", "0" * 64):
        assert httpx.get(f"{url}/v1/blobs/{bad}", timeout=30).status_code == 404


def shows_the_shared_frame(url: str, run_id: str) -> dict:
    """Every mode's status page loads the host's frame, and the host answers what it shows."""
    page = httpx.get(f"{url}/", timeout=30).text
    assert '<header id="covey-frame">' in page and '<script src="/frame.js">' in page
    script = httpx.get(f"{url}/frame.js", timeout=30)
    assert script.headers["content-type"].startswith("text/javascript")
    assert "covey-frame" in script.text and "innerHTML" not in script.text
    host = httpx.get(f"{url}/v1/host", timeout=30).json()
    assert host["run_id"] == run_id and host["halted"] is None
    assert host["ledger"]["length"] >= 2 and len(host["ledger"]["hash"]) == 64
    return host


def test_swarm_forged_halts_are_refused(swarm: Swarm) -> None:
    run_id = httpx.get(f"{swarm.url}/v1/run", timeout=30).json()["run_id"]
    owner = Identity.load_or_create(swarm.workdir / "run" / "coordinator.key")
    forgeries_are_refused(swarm.url, run_id, owner)


def test_covey_halt_stops_a_swarm_run(swarm: Swarm) -> None:
    url, run_dir = swarm.url, swarm.workdir / "run"
    run_id = httpx.get(f"{url}/v1/run", timeout=30).json()["run_id"]
    trainer_log = swarm.workdir / "t1.log"
    trainer = swarm.start_trainer("t1", "--seconds", "300")
    try:
        wait_for(
            lambda: any(t.get("samples", 0) > 0 for t in swarm_status(url)["trainers"].values()),
            120,
            "the trainer's first report",
        )
        entry = halt_and_verify(url, run_dir / "coordinator.key", run_id, url)
        assert exit_code(trainer, 30, trainer_log) == EXIT_HALTED, tail(trainer_log)
        for name in ("a0", "b0"):
            log = swarm.workdir / f"{name}.log"
            assert exit_code(swarm.servers[name], 30, log) == EXIT_HALTED, tail(log)
            assert "halted by its owner" in log.read_text()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
    late = Identity.generate()
    join = {"run_id": run_id, "peer_id": late.peer_id, "public_key": late.public_key,
            "role": "server", "name": "late", "stake": 0.0}  # fmt: skip
    purpose = request_purpose("/v1/swarm/join")
    refused = post(url, "/v1/swarm/join", late.sign_request(join, purpose=purpose))
    assert refused.status_code == 410 and REASON in refused.text, refused.text
    assert swarm_status(url)["halted"]["index"] == entry["index"]
    replay_is_refused(url, entry)
    verify_ledger(url)  # over HTTP, with the coordinator's reported balances
    verify_ledger(str(run_dir / "swarm.db"))  # and the database file itself


def test_swarm_join_flood_gets_429(swarm: Swarm) -> None:
    flood_gets_429(swarm.url, "/v1/swarm/join")


def swarm_status(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/swarm/status", timeout=30).json()
