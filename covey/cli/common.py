"""What every `covey` command shares: the one-line error (`fail`), the spec loader, the
option definitions and the checks run before any work. Imports no torch."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from covey.config import load_sim_config
from covey.coordinator.storage import BLOBS_HELP, DB_HELP, KEY_HELP, REPLICA_HELP
from covey.errors import UserError, check_coordinator, check_data_paths
from covey.spec import SET_HELP

METHODS = "ddp, diloco, streaming, demo"
DEVICE_HELP = "where to train: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N, mps"
LOG_TO = typer.Option(
    "--log", help="also send metrics to tensorboard or wandb (needs covey[tensorboard|wandb])"
)
LOG_JSON = typer.Option("--log-json", help="log one JSON object a line (time, level, peer, ...)")
SET = typer.Option("--set", help=SET_HELP, metavar="KEY=VALUE")
WANDB_PROJECT = typer.Option(
    "--wandb-project", help="with --log wandb: the W&B project (default: $WANDB_PROJECT, or covey)"
)

RUN_ID_OPTION = typer.Option(
    "--run-id",
    help="the run id the coordinator printed: refuse a coordinator serving any other run "
    "(its key is part of the id); without it, the coordinator's word is taken",
)
# where a coordinator keeps its run beside --data-dir (covey.coordinator.host.Storage)
DB_OPTION = typer.Option("--db", help=DB_HELP)
BLOBS_OPTION = typer.Option("--blobs", help=BLOBS_HELP)
KEY_OPTION = typer.Option("--key", help=KEY_HELP)
REPLICA_OPTION = typer.Option("--replica", help=REPLICA_HELP)
DEBUG = False  # set by `covey --debug`: errors a person can act on also show their traceback


def fail(message: str) -> typer.Exit:
    """Print one actionable line (and, with --debug, the exception being handled); exit 2."""
    if DEBUG and sys.exc_info()[0] is not None:
        import traceback

        traceback.print_exc()
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def overrides_of(**flags: Any) -> dict[str, Any]:
    """Dotted flag names -> nested dict, skipping flags left unset."""
    out: dict[str, Any] = {}
    for dotted, value in flags.items():
        if value is None:
            continue
        node = out
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def load_config(
    config: Path | None,
    overrides: dict[str, Any],
    loader: Callable[..., Any] = load_sim_config,
    sets: list[str] | None = None,
) -> Any:
    """The validated config (covey.spec.load_spec: TOML, flags, then --set pairs), or exit 2
    with one line naming every problem by its key."""
    from covey.spec import load_spec

    try:
        cfg = load_spec(loader, config, overrides, sets or ())
        check_data_paths(getattr(getattr(cfg, "data", None), "paths", ()))
    except UserError as e:
        raise fail(str(e)) from None
    return cfg


def guard(check: Callable[[], None]) -> None:
    """Run a covey.guards check; its UserError becomes one line and exit 2."""
    try:
        check()
    except UserError as e:
        raise fail(str(e)) from None


def say_to(json_lines: bool) -> Callable[[str], None]:
    """Where a command's progress lines go: stdout, or with --log-json the JSON log."""
    if not json_lines:
        return typer.echo
    import logging

    return logging.getLogger("covey.cli").info


def setup_logs(verbose: bool, peer: str = "-", json_lines: bool = False) -> None:
    """Every entrypoint's logging: dated lines naming the peer (covey.logs)."""
    from covey.logs import setup_logging

    setup_logging(peer, verbose=verbose, json_lines=json_lines or None)


def check_tracker(kind: str | None) -> None:
    """A --log kind that is known and whose extra is installed, or exit 2 before any work."""
    from covey.tracking import check_kind

    try:
        check_kind(kind)
    except UserError as e:
        raise fail(str(e)) from None


def track(
    kind: str | None,
    out: Path,
    name: str,
    config: dict[str, Any],
    records: Any,
    project: str | None = None,
) -> None:
    """Send a finished run's per-round records to the --log tracker (if any)."""
    if kind is None:
        return
    from covey.tracking import log_records, open_tracker

    tracker = open_tracker(kind, out, name, config, project)
    if tracker is not None:
        n = log_records(tracker, records)
        tracker.close()
        typer.echo(f"logged {n} rounds to {kind} ({out})")


def check_coordinator_url(url: str, wait_s: float, json_lines: bool = False) -> None:
    """Refuse a URL without a scheme, or a server that is not a covey coordinator, at once
    (waiting up to `wait_s` only for one that is not reachable yet, saying so on stderr:
    as log records with --log-json)."""
    if json_lines:
        import logging

        say = logging.getLogger("covey.cli").warning
    else:
        say = lambda line: typer.echo(line, err=True)  # noqa: E731
    try:
        check_coordinator(url, wait_s, say=say)
    except UserError as e:
        raise fail(str(e)) from None


def check_device(device: str | None) -> None:
    """Exit 2 naming the value when --device is malformed or absent on this machine."""
    if device is None:
        return
    from covey.devices import DeviceError, resolve_device

    try:
        resolve_device(device)
    except DeviceError as e:
        raise fail(f"--device: {e}") from None


def check_name(name: str | None) -> None:
    import re

    if name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise fail(f"--name may use letters, digits and _.- (1-64 of them), got {name!r}")
