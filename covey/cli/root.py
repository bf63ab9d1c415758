"""The `covey` app object and its top-level options (--version, --debug, -h)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from covey import __version__
from covey.cli import common

# -h is --help everywhere (subcommands inherit it); help text prints as written, brackets too
CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    help="covey: train PyTorch models on decentralized compute with little communication.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=CONTEXT,
    rich_markup_mode=None,
)
bench_app = typer.Typer(
    help="Benchmarks (results go in BENCHMARKS.md).", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(bench_app, name="bench")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"covey {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="show the traceback behind an error message")
    ] = False,
) -> None:
    common.DEBUG = debug
