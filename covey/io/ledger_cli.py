"""`covey ledger ...`: verify, show and export a run's ledger (covey.io.audit).

Exit codes: 0 when the ledger verifies, 1 when it does not (`ledger INVALID: entry N: ...`,
or `ledger FORKED: ...` when two validly signed heads disagree), 2 when the source cannot
be read or the arguments are wrong (`error: ...`). Only typer is
imported here; the audit code loads when a command runs.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from covey.io.audit import VerifyReport

SOURCE_HELP = "a coordinator's data directory, its coordinator.db, a .jsonl export, or its URL"
Source = Annotated[str, typer.Argument(help=SOURCE_HELP, show_default=False)]
HEADS_HELP = (
    "signed ledger heads to hold the ledger to (repeatable): a JSONL file of heads or "
    "receipts (a peer's ledger-heads.jsonl), a peer's store directory, or a coordinator's "
    "URL (its /v1/ledger/head). A ledger shorter than a head, or different at its length, "
    "is refused; two heads at one length that differ prove a forked ledger. A head of "
    "another run or with a bad signature is ignored, with a warning"
)


#: what `verify --recompute` also recomputes with: the modes' own (covey.io.audit.Recompute),
#: handed in by the command line that registers the group
_RECOMPUTERS: list[Any] = []
#: the modes' treasury terms (covey.io.audit.Terms), handed in the same way
_TERMS: list[Any] = []


def register(app: typer.Typer, recomputers: Sequence[Any] = (), terms: Sequence[Any] = ()) -> None:
    """Add the `ledger` command group to `app`; `recomputers`: what `verify --recompute`
    also recomputes with (covey.io.audit.Recompute), e.g. a SWARM run's convictions;
    `terms`: the modes' treasury terms `verify` holds their ledgers to."""
    _RECOMPUTERS[:] = list(recomputers)
    _TERMS[:] = list(terms)
    ledger_app = typer.Typer(
        help="Audit a run's ledger: chain, signatures, balances.",
        no_args_is_help=True,
        rich_markup_mode=None,
    )
    ledger_app.command("verify")(verify)
    ledger_app.command("show")(show)
    ledger_app.command("export")(export)
    ledger_app.command("deposit")(deposit)
    app.add_typer(ledger_app, name="ledger")


def verify(
    source: Source,
    recompute: Annotated[
        bool,
        typer.Option(
            "--recompute",
            help="also recompute the shard behind every slash of an aggregator, and the reply "
            "behind every conviction of a SWARM stage server, from the run's blobs (a data "
            "directory or URL): each stands only if what was published is wrong",
        ),
    ] = False,
    heads: Annotated[
        list[str] | None, typer.Option("--heads", help=HEADS_HELP, show_default=False)
    ] = None,
) -> None:
    """Check the chain and signatures, replay every balance, compare with the coordinator's.

    Exit 0 if the hash chain, every signature and every rule hold, the ledger is at least
    as long as every signed head given (--heads) and agrees with each at its length, every
    slash of an aggregator carries evidence that holds (its own signed hash, the round's
    certified inputs; with --recompute, a recomputed shard that differs from it), and the
    balances the coordinator reports (if any) equal the replay; 1 naming the first failure
    (or two signed heads that disagree: a forked ledger); 2 if the source cannot be read.
    Without --heads, a copy of the ledger cut short at an entry boundary cannot be told
    from the whole: the output says so."""
    report = _verified(source, recompute, heads or None)
    for warning in report.head_warnings:
        typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
    key = report.coordinator_key
    compared = (
        "no balances reported to compare"
        if report.compared_at is None
        else "match the coordinator's"
        + (
            ""
            if report.compared_at == report.entries
            else f" (their report covers the first {report.compared_at} entries)"
        )
    )
    typer.echo(
        f"ledger OK: {report.entries} entries, chain and {report.entries} signatures valid, "
        f"coordinator key {key[:16]}...; balances recomputed for {report.accounts} accounts "
        f"{compared}"
    )
    if report.heads:
        typer.echo(
            f"held to {report.heads} signed head(s): the ledger reaches the longest (length "
            f"{report.head_length}) and agrees with each"
        )
    else:
        none = "no signed heads given" if report.heads is None else "no valid signed heads"
        typer.echo(f"{none}: a truncated copy cannot be detected (see --heads)")
    if report.balances_ahead is not None:
        typer.echo(
            f"the unsigned balances file claims {report.balances_ahead} entries, more than "
            "the ledger holds: not compared, and no evidence on its own (signed heads are)"
        )
    if report.shard_slashes:
        how = "recomputed: each shard" if report.recomputed else "on the ledger: each"
        typer.echo(
            f"{report.shard_slashes} slash(es) of aggregators checked {how} differs from the "
            "hash its aggregator signed"
        )
    if report.swarm_convictions:
        how = (
            f"{report.swarm_recomputed} recomputed: each reply is off"
            if report.recomputed
            else "on the ledger: each signed by its server"
        )
        typer.echo(f"{report.swarm_convictions} conviction(s) of stage servers checked {how}")
    if report.pending_slashes:
        typer.echo(
            f"{report.pending_slashes} of them in a round not certified yet: their inputs are "
            "checked against its certificate once it is"
        )
    if (halted := report.summary.get("halted")) is not None:  # the owner's signed HALT
        typer.echo(
            f"run HALTED by its owner at round {halted['round']} (entry {halted['index']}): "
            f"{halted['reason']}; no round after it"
        )


def show(
    source: Source,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Verify, then print every account's standing as recomputed from the ledger."""
    report = _verified(source)
    if as_json:
        typer.echo(json.dumps(report.summary, indent=2))
        return
    typer.echo(_table(report.summary))
    t = report.summary["totals"]
    typer.echo(
        f"{report.entries} entries, {report.summary['certificates']} rounds certified; "
        f"{t['tokens_paid']:,} tokens paid, {t['balance']:.6g} credits earned, "
        f"{t['slashed']:.6g} slashed, {t['banned']} banned"
    )


def export(
    source: Source,
    out: Annotated[Path, typer.Option("--out", help="the .jsonl file to write")],
) -> None:
    """Write the ledger as JSONL, one canonical entry per line.

    Exports what is there without verifying it first (check the file with
    `covey ledger verify FILE.jsonl`); exit 1 only if an entry cannot be read at all."""
    from covey.io.audit import SourceError, load, write_jsonl
    from covey.trust.ledger import LedgerError

    if out.suffix != ".jsonl":
        raise _fail(f"--out must name a .jsonl file, got {out}")
    try:
        entries, _, _ = load(source)
    except SourceError as e:
        raise _fail(str(e)) from None
    except sqlite3.DatabaseError as e:  # a damaged coordinator.db in a data directory
        raise _fail(f"{source}: its database cannot be read ({e}); is it damaged?") from None
    except LedgerError as e:
        typer.secho(f"ledger INVALID: {e}", fg=typer.colors.RED)
        raise typer.Exit(1) from None
    write_jsonl(entries, out)
    typer.echo(f"wrote {len(entries)} entries to {out}")


def _verified(source: str, recompute: bool = False, heads: list[str] | None = None) -> VerifyReport:
    """The verified report, or exit 1 (invalid ledger, forked heads) / 2 (unreadable source)."""
    from covey.io.audit import SourceError
    from covey.io.audit import verify as verify_source
    from covey.io.heads_source import load_heads
    from covey.trust.heads import ForkError
    from covey.trust.ledger import LedgerError

    try:
        given = None
        if heads is not None:
            given, unreadable = [], []
            for name in heads:
                found, warnings = load_heads(name)
                given += found
                unreadable += warnings
            for warning in unreadable:
                typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
        return verify_source(
            source,
            recompute,
            progress=typer.echo,
            heads=given,
            recomputers=_RECOMPUTERS,
            terms=_TERMS,
        )
    except SourceError as e:
        raise _fail(str(e)) from None
    except sqlite3.DatabaseError as e:  # a damaged coordinator.db in a data directory
        raise _fail(f"{source}: its database cannot be read ({e}); is it damaged?") from None
    except ForkError as e:
        typer.secho(f"ledger FORKED: {e}", fg=typer.colors.RED)
        for head, where in e.heads:
            typer.echo(f"  {where}: {json.dumps(head.to_dict(), sort_keys=True)}")
        raise typer.Exit(1) from None
    except LedgerError as e:
        typer.secho(f"ledger INVALID: {e}", fg=typer.colors.RED)
        raise typer.Exit(1) from None


def _table(summary: dict[str, Any]) -> str:
    header = (
        "name",
        "peer id",
        "role",
        "stake",
        "held",
        "balance",
        "tokens paid",
        "own %",
        "rep",
        "banned",
    )
    rows = [header]
    for peer_id, a in summary["accounts"].items():
        rows.append(
            (
                a["name"],
                peer_id[:12],
                a["role"],
                f"{a['stake']:.6g}" + (" (unbonding)" if a.get("release_at") else ""),
                f"{a.get('held', 0.0):.6g}",
                f"{a['balance']:.6g}",
                f"{a['tokens_paid']:,}",
                f"{100 * a['ownership']:.2f}",
                f"{a['reputation']:.3f}",
                "BANNED" if a["banned"] else "",
            )
        )
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(header))]
    numeric = {3, 4, 5, 6, 7, 8}
    lines = [
        "  ".join(
            str(cell).rjust(w) if c in numeric else str(cell).ljust(w)
            for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def deposit(
    coordinator: Annotated[str, typer.Option(help="the coordinator's URL")],
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help="the key credited: its public key (64 hex digits), or a peer's key file "
            "(made if missing, as `covey worker --identity FILE` makes it)",
        ),
    ],
    key: Annotated[
        Path,
        typer.Option(
            help="the run owner's key file: the spec's owner_key, or, when the spec names "
            "none, the coordinator's (DATA_DIR/coordinator.key; an RL trainer's "
            "DATA_DIR/trainer.key)"
        ),
    ],
    amount: Annotated[
        float | None,
        typer.Option(
            help="credits deposited (positive); default: the run's minimum stake of a worker",
            show_default=False,
        ),
    ] = None,
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id",
            help="the run id the owner handed out: refuse a coordinator serving another run",
        ),
    ] = None,
) -> None:
    """Deposit credits from the run's treasury to a key, as the run's owner.

    A key stakes only credits it holds: what the owner deposited to it (this command, or
    the spec's trust.funds at start) and pay it earned. The signed request goes into the
    ledger as a "deposit" entry, which `covey ledger verify` checks against the owner's
    key. Exit 0 with the key's held balance, 2 if the deposit was refused."""
    import re
    import time

    import httpx

    from covey.io.deposit import DepositRefused
    from covey.io.deposit import deposit as send
    from covey.trust.identity import Identity, IdentityError

    if not key.is_file():
        raise _fail(f"no key file at {key}")
    try:
        owner = Identity.load_or_create(key)
        if not re.fullmatch(r"[0-9a-f]{64}", to):
            to = Identity.load_or_create(Path(to)).public_key
        end = time.monotonic() + 30.0  # a coordinator started a moment ago may not answer yet
        while True:
            try:
                served = httpx.get(f"{coordinator.rstrip('/')}/v1/run", timeout=30.0)
                break
            except httpx.ConnectError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.5)
        served = served.json()["run_id"]
        if run_id is not None and served != run_id:
            raise _fail(f"the coordinator serves run {served}, not --run-id {run_id}")
        if amount is None:  # what a worker started without --stake bonds
            url = f"{coordinator.rstrip('/')}/v1/ledger/balances"
            amount = float(httpx.get(url, timeout=30.0).json()["min_stake"]["worker"])
            if amount <= 0:
                raise _fail("this run asks no stake of a worker: give --amount")
        reply = send(coordinator.rstrip("/"), owner, to, amount, served)
    except (IdentityError, DepositRefused, httpx.HTTPError, ValueError, KeyError) as e:
        raise _fail(f"the deposit was refused: {e}") from None
    typer.echo(
        f"deposited {amount:g} credits to key {to[:16]}... (peer {reply['peer_id']}): it holds "
        f"{reply['held']:g}; ledger head {reply['ledger_head'].get('length')}"
    )


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)
