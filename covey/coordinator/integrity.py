"""What `covey coordinator` checks in a --data-dir before it opens the run in it.

A coordinator restarted on its data dir resumes from the last committed round's state,
which it reads from the blob store. Two kinds of damage are refused there, in one line
(`UserError`), before anything is written: a coordinator.db that SQLite cannot read, and a
state blob whose bytes no longer hash to the content id the database recorded for it (a
flipped byte in a tensor would otherwise load and train on without complaint). The
database is opened read-only; nothing is created.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from covey.errors import UserError
from covey.protocol.content import file_content_id, is_content_id


def _current_cid(db_path: Path) -> str | None:
    """The current state's content id as coordinator.db records it (None: a new run)."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        conn.execute("PRAGMA schema_version").fetchone()  # reads the header: damage shows here
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        current = None
        if "rounds" in tables:
            row = conn.execute(
                "SELECT new_cid FROM rounds WHERE status = 'committed' ORDER BY round DESC LIMIT 1"
            ).fetchone()
            current = row[0] if row else None
        if current is None and "meta" in tables:
            row = conn.execute("SELECT value FROM meta WHERE key = 'initial_cid'").fetchone()
            current = row[0] if row else None
        return current
    finally:
        conn.close()


def check_data_dir(data_dir: Path) -> None:
    """`UserError` when `data_dir` holds a damaged coordinator.db or a current state blob
    that does not hash to its content id. A new (absent or empty) data dir passes."""
    db_path = data_dir / "coordinator.db"
    if not db_path.is_file():
        return
    try:
        current = _current_cid(db_path)
    except sqlite3.DatabaseError as e:
        raise UserError(
            f"{db_path} is not a readable SQLite database ({e}); restore it from a backup "
            "or start the run in another --data-dir"
        ) from None
    if current is None or not is_content_id(current):
        return
    blob = data_dir / "blobs" / current[:2] / current
    if not blob.is_file():
        raise UserError(
            f"{blob} is missing: the run's current state (recorded in {db_path}); restore "
            "the data dir or start the run in another --data-dir"
        )
    actual = file_content_id(blob)
    if actual != current:
        raise UserError(
            f"{blob} is damaged: the run's current state hashes to {actual[:16]}..., not "
            f"its content id {current[:16]}...; restore the data dir or start the run in "
            "another --data-dir"
        )
