"""`covey db migrate`: move a coordinator's run from its data dir's SQLite database to
PostgreSQL (and its blobs to an S3-compatible bucket): covey.coordinator.move."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from covey.cli.common import fail
from covey.cli.root import app

db_app = typer.Typer(
    help="A coordinator's database: move a run to PostgreSQL.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(db_app, name="db")


@db_app.command("migrate")
def migrate(
    data_dir: Annotated[
        Path, typer.Argument(help="the coordinator's data dir (stopped)", show_default=False)
    ],
    to: Annotated[str, typer.Option("--to", help="an empty PostgreSQL database: postgresql://...")],
    blobs: Annotated[
        str | None,
        typer.Option(help="also copy the data dir's blobs to s3://bucket/prefix"),
    ] = None,
    db_file: Annotated[
        str, typer.Option(help="the database file in DATA_DIR (swarm: swarm.db)")
    ] = "coordinator.db",
) -> None:
    """Copy a run's SQLite database into an empty PostgreSQL database, table by table in
    one transaction, and check every row count and the ledger; then start the coordinator
    with --db (and --blobs, and --key DATA_DIR/coordinator.key). Stop the coordinator
    first: writes made during the copy are not in it."""
    from covey.coordinator.move import migrate as move
    from covey.errors import UserError
    from covey.guards import lock_dir

    try:
        lock_dir(data_dir, "covey db migrate")  # no coordinator is writing it meanwhile
        moved = move(data_dir / db_file, to, blobs, progress=typer.echo)
    except (ValueError, RuntimeError, UserError) as e:
        raise fail(str(e)) from None
    typer.echo(
        f"moved {sum(moved.rows.values())} rows in {len(moved.rows)} tables, "
        f"{moved.entries} ledger entries, {moved.blobs} blobs"
    )
