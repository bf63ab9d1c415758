"""The coordinator's host (covey.coordinator.host) and its peers table
(covey.coordinator.peers): one module of covey reads and writes the table; the repository
does what it says on a real database; the host builds its parts once, refuses a data dir
holding another run (naming both ids) and closes its database again when it does; each
mode's membership config is derived from its spec without changing its run id."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

import covey
from covey.config import MembershipConfig, RunConfig
from covey.coordinator.db import Database
from covey.coordinator.host import Host, RunTerms
from covey.coordinator.peers import Peers
from covey.trust.identity import Identity

# SQL naming the peers table; prose ("from peers") is lower case and not matched
PEERS_SQL = re.compile(r"\b(FROM|UPDATE|INTO|JOIN)\s+peers\b")
ALLOWED = {"covey/coordinator/peers.py", "covey/coordinator/db.py"}


def test_only_the_peers_repository_names_the_peers_table_in_sql() -> None:
    root = Path(covey.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        if PEERS_SQL.search(path.read_text(encoding="utf-8")):
            found.add(path.relative_to(root.parent).as_posix())
    assert "covey/coordinator/peers.py" in found  # the pattern still finds the table's SQL
    assert found <= ALLOWED, f"raw SQL on the peers table outside peers.py: {found - ALLOWED}"


def test_the_pattern_finds_what_it_should() -> None:
    assert PEERS_SQL.search('db.one("SELECT name FROM peers WHERE peer_id = ?")')
    assert PEERS_SQL.search("UPDATE peers SET state = 'dead'")
    assert PEERS_SQL.search("INSERT INTO peers (peer_id) VALUES (?)")
    assert not PEERS_SQL.search("blobs fetched from peers' own servers")


def test_the_peers_repository(tmp_path: Path) -> None:
    db = Database(tmp_path / "coordinator.db")
    try:
        check_peers_repository(db)
    finally:
        db.close()


def check_peers_repository(db: Database) -> None:
    """The peers repository on `db` (also run on PostgreSQL: tests/test_postgres.py)."""
    peers = Peers(db)
    assert peers.row("a") is None and peers.public_key("a") is None
    with db.transaction() as c:
        peers.register(c, "a", "aa" * 32, "alice", "worker", 10.0)
        peers.register(c, "v", "bb" * 32, "val", "validator", 11.0)
        peers.announce(
            c, "a", device="cpu", step_time_s=0.5, bandwidth_mbps=None,
            accepts_connections=True, blob_url="http://127.0.0.1:9/", now=12.0,
        )  # fmt: skip
        peers.register(c, "a", "aa" * 32, "alice2", "worker", 13.0)  # a rejoin: new name
    assert peers.name("a") == "alice2" and peers.role("v") == "validator"
    assert peers.public_key("a") == "aa" * 32
    assert peers.blob_url("a") == "http://127.0.0.1:9/" and peers.blob_url("v") is None
    assert peers.blob_urls(live_role="worker") == {"a": "http://127.0.0.1:9/"}
    assert [r["peer_id"] for r in peers.by_role("worker")] == ["a"]
    assert peers.live_by_role(0.0) == {"worker": 1, "validator": 1}
    with db.transaction() as c:
        assert not peers.set_left(c, "nobody", 14.0)  # no row: nothing changes
        assert peers.set_left(c, "v", 14.0)
        peers.set_step_time(c, "a", 0.25)
        peers.count_contributions(c, ["a", "a"])
    row = peers.row("a", committed=True)
    assert row is not None and row["step_time_s"] == 0.25 and row["contributions"] == 2
    assert peers.counts() == [("validator", "left", 1), ("worker", "live", 1)]
    with db.transaction() as c:  # a heartbeat batch never revives a peer that left
        peers.write_heartbeats(c, [("v", 20.0, None), ("a", 20.0, 0.3), ("a", 5.0, None)])
    assert peers.row("v")["state"] == "left"  # type: ignore[index]
    assert peers.row("a")["last_seen"] == 20.0  # type: ignore[index]
    with db.transaction() as c:
        peers.set_dead(c, "a")
    assert peers.live() == []
    with db.transaction() as c:
        peers.set_live(c, "a", 30.0)  # revived, its speed kept
        peers.ban(c, "v")
    assert peers.row("a")["step_time_s"] == 0.3  # type: ignore[index]
    assert [r["peer_id"] for r in peers.live(committed=True)] == ["a"]
    assert peers.row("v")["state"] == "banned"  # type: ignore[index]


def _terms(run_id: str) -> RunTerms:
    return RunTerms(run_id=run_id, owner_key="00" * 32, membership=MembershipConfig())


def test_the_host_builds_its_parts_once_and_refuses_another_run(tmp_path: Path) -> None:
    seen: list[str] = []

    def terms(identity: Identity, db: Database) -> RunTerms:
        seen.append(identity.public_key)
        return _terms("run-one")

    host = Host(tmp_path, terms, position=lambda: 0, db_file="x.db", key_file="x.key")
    assert seen == [host.identity.public_key] and host.run_id == "run-one"
    assert (tmp_path / "x.key").exists() and (tmp_path / "x.db").exists()
    assert host.membership.accounts is host.accounts and host.halt.accounts is host.accounts
    assert host.membership.peers.db is host.db and host.halt.run_id == "run-one"
    with host.db.transaction() as c:
        c.execute("INSERT INTO meta VALUES ('run_id', 'run-one')")
    host.close()
    assert host.stop.is_set()

    again = Host(tmp_path, lambda i, d: _terms("run-one"), position=lambda: 0, db_file="x.db",
                 key_file="x.key")  # fmt: skip
    assert again.identity.public_key == host.identity.public_key  # the same key file
    again.close()
    with pytest.raises(ValueError) as e:
        Host(tmp_path, lambda i, d: _terms("run-two"), position=lambda: 0, db_file="x.db",
             key_file="x.key")  # fmt: skip
    assert str(tmp_path) in str(e.value) and "run-one" in str(e.value)
    assert "run-two" in str(e.value)
    # the refused host closed its database: the file is not held open (a writer gets in)
    conn = sqlite3.connect(tmp_path / "x.db", timeout=0.1)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("ROLLBACK")
    conn.close()


def test_every_modes_membership_config_keeps_its_run_id() -> None:
    from covey.rl.runspec import RLSpec, ledger_policy, membership_config
    from covey.swarm.config import SwarmConfig

    run = RunConfig()
    before = run.run_id
    m = run.membership()
    assert (m.heartbeat_s, m.dead_after_s, m.lease_s) == (2.0, 6.0, 20.0)
    assert m.nonce_window_s == run.trust.nonce_window_s
    assert m.no_show_backoff_s == run.limits.no_show_backoff_s
    assert run.run_id == before  # derived, not a table of the spec: the id is the same
    spec = RLSpec(heartbeat_s=1.0, dead_after_s=4.0, min_stake=2.0)
    assert membership_config(spec).lease_s == 5.0
    # the stakes to join are each mode's signed policy, which membership reads
    policy = ledger_policy(spec)
    assert (policy.min_stake, policy.min_validator_stake) == (2.0, 10.0)
    swarm = SwarmConfig(min_stake=3.0)
    assert swarm.policy().min_stake == 3.0
    assert swarm.membership_config().dead_after_s == swarm.dead_after_s
    with pytest.raises(ValueError, match="must exceed heartbeat_s"):
        MembershipConfig(heartbeat_s=5.0, dead_after_s=4.0)
