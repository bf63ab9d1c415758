"""Where a `covey bench` command's lines go: its `--log-json` option and `bench_say`. Only
typer is imported here, so `--help` stays instant."""

from __future__ import annotations

import logging
from collections.abc import Callable

import typer

LOG_JSON = typer.Option("--log-json", help="log one JSON object a line (time, level, peer, ...)")


def bench_say(json_lines: bool, name: str) -> Callable[[str], None]:
    """The function a bench command prints its lines with: `typer.echo` (stdout, as
    before), or with --log-json the JSON log on stderr (covey.logs, peer `bench-NAME`),
    which the processes the bench starts write too (covey.logs sets COVEY_LOG_JSON)."""
    if not json_lines:
        return typer.echo
    from covey.logs import setup_logging

    setup_logging(f"bench-{name}", json_lines=True)
    return logging.getLogger(f"covey.bench.{name}").info
