"""HALT: the run owner stops a run. Unit tests of the participation lease and of the ledger's
rules for a HALT; then a real coordinator and workers as processes: a worker whose
heartbeats are not answered (the coordinator SIGSTOPped) stops training when its lease
lapses and trains again once one is accepted; `covey halt` by a stranger is refused, by
the owner it is written to the ledger, every worker exits on its own with status 3 and
says why, and so does the validator, nobody joins again, no round opens, the ledger
verifies and the last certified checkpoint is still served."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.config import TrustConfig
from covey.io import audit
from covey.local.cluster import LocalCluster
from covey.peer.client import CoordinatorClient
from covey.peer.lease import Lease, LeaseLapsed
from covey.trust import ledger
from covey.trust.halt import EXIT_HALTED, HALT_PATH, halt_problem
from covey.trust.identity import NO_ROUND, Identity, request_purpose
from covey.trust.incentives import Book, Policy
from covey.trust.ledger import LedgerError

# -- the lease ------------------------------------------------------------------------------


def test_a_lease_lapses_unless_renewed() -> None:
    lease = Lease()
    lease.check()  # nothing granted yet: nothing to lapse
    lease.renew(time.monotonic(), 30.0)
    lease.check()
    lease.renew(time.monotonic() - 10.0, 5.0)  # an older, shorter grant never shortens it
    lease.check()
    stale = Lease()
    stale.renew(time.monotonic() - 10.0, 5.0)  # granted for a request sent 10 s ago
    with pytest.raises(LeaseLapsed, match="lapsed 5"):
        stale.check()


def test_waiting_for_a_lease_ends_when_renewed_or_at_the_deadline() -> None:
    lease, stop = Lease(), threading.Event()
    lease.renew(time.monotonic() - 10.0, 5.0)
    t0 = time.monotonic()
    assert not lease.wait_renewed(0.2, stop)
    assert 0.15 < time.monotonic() - t0 < 2.0
    renewer = threading.Timer(0.1, lambda: lease.renew(time.monotonic(), 30.0))
    renewer.start()
    assert lease.wait_renewed(10.0, stop)
    stop.set()
    assert not Lease().wait_renewed(10.0, stop)  # a stop ends the wait at once


# -- the HALT in the ledger ---------------------------------------------------------------


class Ledger:
    """A ledger written the coordinator's way (append, then the book applies it)."""

    def __init__(self, owner_key: str | None = None) -> None:
        self.coord = Identity.generate()
        self.conn = sqlite3.connect(":memory:", isolation_level=None)
        self.conn.executescript(ledger.LEDGER_SCHEMA)
        self.book = Book()
        self.run_id = "ab" * 8
        spec = {"name": "halt", "owner_key": owner_key}
        self.add(
            "run created",
            run_id=self.run_id,
            name="halt",
            spec=spec,
            coordinator_key=self.coord.public_key,
            policy=Policy.from_config(TrustConfig()).to_dict(),
        )

    def add(self, type: str, **payload: Any) -> None:
        """Append, or roll back when the book refuses the entry."""
        self.conn.execute("BEGIN")
        try:
            self.book.apply(ledger.append(self.conn, self.coord, type, payload, 1.0))
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def halt_payload(self, signer: Identity, reason: str = "done") -> dict[str, Any]:
        body = {"run_id": self.run_id, "owner_key": signer.public_key, "reason": reason}
        request = signer.sign_request(body, NO_ROUND, purpose=request_purpose(HALT_PATH))
        return {"round": 3, "owner_key": signer.public_key, "reason": reason, "request": request}

    def certificate(self) -> dict[str, Any]:
        h = "0" * 64
        return {"round": 3, "new_hash": h, "certificate_hash": h, "accepted": [], "rejected": []}


def test_a_halt_is_the_owners_and_ends_the_rounds() -> None:
    run = Ledger()  # no owner_key: the coordinator's key is the owner's
    run.add("round certificate", **run.certificate())
    run.add("halt", **run.halt_payload(run.coord))
    assert run.book.halted == {"index": 2, "round": 3, "reason": "done"}
    assert run.book.summary()["halted"] == run.book.halted
    with pytest.raises(LedgerError, match="'round certificate' after the HALT"):
        run.add("round certificate", **run.certificate())
    with pytest.raises(LedgerError, match="halted already"):
        run.add("halt", **run.halt_payload(run.coord))
    peer = Identity.generate()
    run.add("join", peer_id=peer.peer_id, public_key=peer.public_key, name="w", role="worker")
    run.add("leave", peer_id=peer.peer_id, reason="shutdown")  # still recorded after it
    entries = ledger.read_entries(run.conn)
    ledger.verify_chain(entries, run.coord.public_key)
    assert Book.replay(entries).halted == run.book.halted


def test_a_halt_not_signed_by_the_owner_breaks_the_ledger() -> None:
    owner, stranger = Identity.generate(), Identity.generate()
    run = Ledger(owner_key=owner.public_key)
    with pytest.raises(LedgerError, match="not the owner"):
        run.add("halt", **run.halt_payload(run.coord))  # the coordinator is not the owner
    good = run.halt_payload(owner)
    forged = {**good, "request": {**good["request"], "reason": "changed"}, "reason": "changed"}
    assert halt_problem(forged, run.run_id, owner.public_key) == (
        "the owner's signature does not verify"
    )
    # a request signed for another endpoint (the same body, as a leave) is not a HALT
    body = {k: v for k, v in good["request"].items() if k not in ("nonce", "signature")}
    elsewhere = owner.sign_request(body, NO_ROUND, purpose=request_purpose("/v1/leave"))
    assert "does not verify" in str(
        halt_problem({**good, "request": elsewhere}, run.run_id, owner.public_key)
    )
    assert "not the owner" in str(
        halt_problem(run.halt_payload(stranger), run.run_id, owner.public_key)
    )
    run.add("halt", **good)
    assert run.book.halted is not None


# -- real processes -----------------------------------------------------------------------

SPEC = """
name = "halt"
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 12
[rounds]
target_compute_s = 30
heartbeat_s = 1.0
dead_after_s = 4.0
lease_s = 4.0
min_peers = 2
deadline_min_s = 20
deadline_max_s = 60
checkpoint_every = 1
eval_batches = 1
"""
WORKERS = ("w1", "w2")
VALIDATOR = "v1"
REASON = "enough for today"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp: Path = tmp_path_factory.mktemp("halt")
    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    with LocalCluster(spec, tmp) as c:
        c.start_coordinator()
        for name in WORKERS:
            c.start_worker(name)
        # the lease test's slow worker is started by that test (long): a member that takes
        # ~20-40 s a round holds every round to its deadline, which the HALT test need not wait
        c.start_validator(VALIDATOR)  # it checks rounds, and must stop at the HALT too
        yield c


def covey(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "covey", *args], capture_output=True, text=True, timeout=120
    )


def log_has(cluster: LocalCluster, name: str, text: str, timeout_s: float) -> str:
    """Wait until `name`'s log contains `text`; its tail, or AssertionError at the deadline."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if text in (tail := cluster.tail(name, lines=200)):
            return tail
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {name}'s log after {timeout_s} s\n{tail}")


@pytest.mark.network
@pytest.mark.long  # waits out a lease; the HALT network test below runs by default
def test_a_worker_stops_training_when_its_lease_lapses(cluster: LocalCluster) -> None:
    """A slow worker (a round's training takes it ~20-40 s; the lease is checked before
    every step and twice a second while it waits out its emulated slowness) loses its
    coordinator mid-training: once the lease (4 s) has lapsed it stops training, and once
    the coordinator answers again it trains on."""
    # a nano step here takes ~5-10 ms, so x300 makes a 12-step round take ~20-40 s whatever
    # the machine's load (x20 finished before the lease lapsed)
    cluster.start_worker("slow", "--slowdown", "300", "--verbose")
    log_has(cluster, "slow", "inner steps", 120)  # its first round's training began
    cluster.signal("coordinator", signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        log_has(cluster, "slow", "participation lease lapsed", 30)
        assert time.monotonic() - stopped < 20
    finally:
        cluster.signal("coordinator", signal.SIGCONT)
    log = log_has(cluster, "slow", "participation lease renewed: training again", 60)
    assert "training stopped until a heartbeat is accepted" in log
    cluster.signal("slow", signal.SIGTERM)  # the HALT test below runs with w1 and w2
    assert cluster.wait_exit("slow", 30) == 0


@pytest.mark.network
def test_covey_halt_stops_every_worker_and_the_run_stays_auditable(
    cluster: LocalCluster,
) -> None:
    cluster.wait_for(lambda s: s["committed_rounds"] >= 1, 180, "a first committed round")
    url, coordinator_key = cluster.url, cluster.data_dir / "coordinator.key"

    # a key that is not the owner's is refused (403), and nothing is written
    stranger = Identity.generate()
    body = {"run_id": cluster.run_id, "owner_key": stranger.public_key, "reason": "mine now"}
    signed = stranger.sign_request(body, NO_ROUND, purpose=request_purpose(HALT_PATH))
    refused = httpx.post(f"{url}{HALT_PATH}", json=signed, timeout=30, trust_env=False)
    assert refused.status_code == 403 and "not the owner key" in refused.json()["error"]
    assert cluster.status()["halted"] is None
    peer_view = CoordinatorClient(url)  # what a validator waiting on evidence asks
    assert peer_view.halted(timeout_s=5) is None

    owner = covey(
        "halt", "--coordinator", url, "--key", str(coordinator_key), "--reason", REASON,
        "--run-id", cluster.run_id,
    )  # fmt: skip
    assert owner.returncode == 0, owner.stderr
    assert "HALTED" in owner.stdout and REASON in owner.stdout
    halted_at = time.monotonic()
    assert REASON in (peer_view.halted(timeout_s=5) or ""), "a peer reads the HALT in one GET"
    assert CoordinatorClient("http://127.0.0.1:9").halted(timeout_s=1) is None  # no answer

    # every worker learns it from its heartbeat or /v1/round, and exits on its own
    for name in WORKERS:
        assert cluster.wait_exit(name, 30) == EXIT_HALTED, cluster.tail(name)
        log = cluster.tail(name, lines=40)
        assert "halted by its owner" in log and REASON in log, log
        assert f"exiting with status {EXIT_HALTED}" in log, log
    # the validator learns it from its next claim (410) and exits with the workers' status
    assert cluster.wait_exit(VALIDATOR, 30) == EXIT_HALTED, cluster.tail(VALIDATOR)
    log = cluster.tail(VALIDATOR, lines=40)
    assert "halted by its owner" in log and REASON in log, log
    assert time.monotonic() - halted_at < 60

    status = cluster.status()
    assert status["phase"] == "halted" and status["halted"]["reason"] == REASON
    assert status["committed_rounds"] == status["halted"]["round"]  # no round after it
    round_info = cluster.get("/v1/round")
    assert round_info["phase"] == "halted" and round_info["halted"] == REASON

    # nobody joins a halted run (a worker refused so exits with EXIT_HALTED too)
    late = Identity.generate()
    join = {"run_id": cluster.run_id, "peer_id": late.peer_id, "public_key": late.public_key}
    join = late.sign_request({**join, "step_time_s": 0.1}, purpose=request_purpose("/v1/join"))
    refused = httpx.post(f"{url}/v1/join", json=join, timeout=30, trust_env=False)
    assert refused.status_code == 410 and REASON in refused.json()["error"]

    # the owner's HALT is in the ledger, and the whole ledger verifies
    entries = cluster.get("/v1/ledger")
    halts = [e for e in entries if e["type"] == "halt"]
    assert len(halts) == 1 and halts[0]["payload"]["reason"] == REASON
    verified = covey("ledger", "verify", url)  # chain, signatures, rules, balances
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "ledger OK" in verified.stdout and "HALTED by its owner at round" in verified.stdout
    assert audit.verify(url).summary["halted"]["index"] == halts[0]["index"]

    # the last certified model is still served
    checkpoints = cluster.get("/v1/checkpoints")
    assert checkpoints, "no checkpoint served after the HALT"
    last = checkpoints[-1]
    blob = httpx.get(f"{url}/v1/blobs/{last['cid']}", timeout=30, trust_env=False)
    assert blob.status_code == 200 and len(blob.content) == last["size"]
