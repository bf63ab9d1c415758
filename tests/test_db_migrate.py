"""`covey db migrate`: a rounds run made on SQLite moves to PostgreSQL and S3 (real
servers: tests/services.py) and a coordinator on an empty data dir resumes it there, with
the same run id, ledger and state."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from covey.cli import app
from covey.config import load_run_config
from covey.coordinator.storage import Storage
from tests.services import Postgres, S3Server
from tests.test_postgres import SPEC


def test_a_sqlite_run_moves_to_postgres_and_s3(
    postgres: Postgres, s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from covey.coordinator.service import Coordinator

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    old = tmp_path / "old"
    first = Coordinator(load_run_config(spec), old)  # the default: all in the data dir
    run_id, state = first.run_id, first.rounds.state_cid
    entries = first.accounts.entries(0, 1000)
    with first.db.transaction() as c:  # rows of a component's own table move too
        c.execute("INSERT INTO checks VALUES (7, 'v', 'assigned', 5.0)")
    first.stop()
    url, bucket = postgres.database(), f"s3://{s3.bucket()}/moved"
    runner = CliRunner()
    moved = runner.invoke(app, ["db", "migrate", str(old), "--to", url, "--blobs", bucket])
    assert moved.exit_code == 0, moved.output
    assert "ledger entries" in moved.output and "checks: 1 rows" in moved.output
    again = runner.invoke(app, ["db", "migrate", str(old), "--to", url])  # not twice
    assert again.exit_code == 2 and "holds a run already" in again.output
    bad = runner.invoke(app, ["db", "migrate", str(old), "--to", str(tmp_path / "x.db")])
    assert bad.exit_code == 2 and "postgresql://" in bad.output

    storage = Storage(db=url, blobs=bucket, key=old / "coordinator.key")
    resumed = Coordinator(load_run_config(spec), tmp_path / "new", storage=storage)
    try:
        assert resumed.run_id == run_id and resumed.rounds.state_cid == state
        assert resumed.accounts.entries(0, 1000) == entries
        row = resumed.db.one("SELECT status FROM checks WHERE vid = 7")
        assert row is not None and row["status"] == "assigned"
        with resumed.db.transaction() as c:  # identities continue after the copied ids
            c.execute("INSERT INTO events (at, kind, peer_id, detail) VALUES (1, 'x', '', '')")
    finally:
        resumed.stop()
