"""`covey rl trainer | worker | validator | demo`: the RL roles from the command line.

Only typer is imported at module level: torch loads when a command runs, so `covey rl
--help` is instant. Bad input exits 2 with `error: ...`.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from covey.coordinator.storage import BLOBS_HELP, DB_HELP, KEY_HELP, REPLICA_HELP, Storage

rl_app = typer.Typer(
    help="Decentralized RL post-training: a trainer, untrusted rollout "
    "workers and staked validators.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


def _url(value: str) -> str:
    """--trainer must be an http(s) URL with a host: a typo fails now, not after lost_s."""
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _fail(f"--trainer {value!r} is not a URL like http://HOST:PORT")
    try:
        parts.port  # noqa: B018 -- raises on a port out of range or not a number
    except ValueError as e:
        raise _fail(f"--trainer {value!r}: {e}") from None
    return value.rstrip("/")


TrainerUrl = Annotated[
    str,
    typer.Option("--trainer", help="the trainer's URL, e.g. http://127.0.0.1:8700", callback=_url),
]
Device = Annotated[
    str,
    typer.Option(
        help="where the policy computes: auto (CUDA, then MPS, then CPU) | cpu | cuda | "
        "cuda:N | mps. Default cpu: the class RL's verification tolerances are calibrated on"
    ),
]
PeerDevice = Annotated[
    str,
    typer.Option(
        help="where the policy computes: auto (default: the device class the run verifies "
        "on, its spec's verify_device; cuda means cuda:0) | cpu | cuda | cuda:N | mps. A "
        "validator on another class refuses to check (exit 1); a worker on one is warned"
    ),
]
IdentityPath = Annotated[
    Path | None,
    typer.Option(
        help="Ed25519 key file (created mode 600 if missing); default: a fresh key per process"
    ),
]


def register(app: typer.Typer) -> None:
    """Add the `rl` command group to the main `covey` app."""
    from covey.rl.learn_cli import register_sft

    register_sft(rl_app)  # covey rl sft (covey/rl/learn_cli.py)
    app.add_typer(rl_app, name="rl")


def _halted_or_fail(name: str, e: Exception) -> typer.Exit:
    """Exit EXIT_HALTED (3) for a 410 (the run owner halted the run), else 2 naming `e`."""
    from covey.trust.halt import EXIT_HALTED

    if getattr(e, "status", None) == 410:
        typer.echo(f"{name}: the run was halted by its owner: {getattr(e, 'message', e)}")
        return typer.Exit(EXIT_HALTED)
    return _fail(str(e))


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


LOG_JSON = typer.Option("--log-json", help="log one JSON object a line (time, level, peer, ...)")


def _logging(verbose: bool = True, json_lines: bool = False, peer: str = "rl") -> None:
    """Text lines, or with --log-json (or COVEY_LOG_JSON, set by a demo for its children)
    covey.logs' JSON lines, the format every other covey process writes."""
    from covey.logs import JSON_ENV

    if json_lines or os.environ.get(JSON_ENV, "") not in ("", "0"):
        from covey.logs import setup_logging

        setup_logging(peer, json_lines=True)
        logging.getLogger().setLevel(logging.INFO if verbose else logging.WARNING)
        return
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise


def _identity(path: Path | None):
    from covey.trust.identity import Identity, IdentityError

    try:
        return Identity.generate() if path is None else Identity.load_or_create(path)
    except IdentityError as e:
        raise _fail(str(e)) from None


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _device(spec: str) -> str:
    """--device checked now (exit 2 naming the value: malformed, or absent here); the
    resolved name, e.g. "cuda:0", for the role to use."""
    from covey.devices import DeviceError, resolve_device

    try:
        return str(resolve_device(spec))
    except DeviceError as e:
        raise _fail(f"--device: {e}") from None


def _peer_device(spec: str) -> str:
    """A worker's or validator's --device: "auto" is left for the run's spec to decide
    (its verify class); anything else is checked now as `_device` does."""
    from covey.devices import DeviceError, check_device_spec

    try:
        norm = check_device_spec(spec)
    except DeviceError as e:
        raise _fail(f"--device: {e}") from None
    return norm if norm == "auto" else _device(norm)


def _precision(setting: str, device: str) -> str:
    from covey.devices import DeviceError, resolve_precision

    try:
        return resolve_precision(setting, device)
    except DeviceError as e:
        raise _fail(f"--precision: {e}") from None


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _bindable(host: str, port: int) -> None:
    """Fail now (exit 2) on a port in use or an address not ours, before a run is created
    and uvicorn exits with its own message."""
    from covey.errors import UserError
    from covey.guards import check_port_free

    try:
        check_port_free(host, port)
    except UserError as e:
        raise _fail(str(e)) from None


@rl_app.command("trainer")
def trainer(
    data_dir: Annotated[Path, typer.Option(help="run directory: database, blobs, key")],
    policy: Annotated[
        str | None,
        typer.Option(
            help="starting policy: a policy directory (covey rl sft), covey:<preset>, or "
            "hf:DIR (a local Hugging Face causal LM); needed only when DATA_DIR holds no run yet"
        ),
    ] = None,
    spec: Annotated[Path | None, typer.Option(help="TOML of the run's RLSpec fields")] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on", min=1, max=65535)] = 8700,
    threads: Annotated[int, typer.Option(help="torch threads", min=1)] = 1,
    device: Device = "cpu",
    precision: Annotated[
        str,
        typer.Option(
            help="the learning step's forward: auto (bf16 on CUDA that has it, else fp32) | "
            "fp32 | bf16; weights and optimizer state stay fp32"
        ),
    ] = "auto",
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="an RLSpec field, KEY=VALUE; repeat", metavar="KEY=VALUE"),
    ] = None,
    log_json: Annotated[bool, LOG_JSON] = False,
    db: Annotated[str | None, typer.Option(help=DB_HELP)] = None,
    blobs: Annotated[str | None, typer.Option(help=BLOBS_HELP)] = None,
    key: Annotated[Path | None, typer.Option(help=KEY_HELP)] = None,
    replica: Annotated[bool, typer.Option("--replica", help=REPLICA_HELP)] = False,
) -> None:
    """Serve an RL run: publish policy versions, take verified batches, train, pay."""
    from covey.config import load_toml
    from covey.errors import UserError
    from covey.guards import lock_dir
    from covey.rl.runspec import RLSpec
    from covey.rl.service import serve
    from covey.rl.trainer import Trainer
    from covey.spec import load_spec

    where = _device(device)
    compute = _precision(precision, where)
    _logging(json_lines=log_json, peer="trainer")
    _threads(threads)
    _bindable(host, port)
    try:
        lock_dir(data_dir, "covey rl trainer")  # one trainer per data dir
        from covey.rl.policy import spec_defaults

        defaults = spec_defaults(policy)  # hf: eos_id = its newline token unless the TOML says
        rl_spec = None
        if spec is not None or policy is not None or set_:
            given = {**defaults, **(load_toml(spec) if spec else {})}
            rl_spec = load_spec(RLSpec, spec, given, set_ or ())
        storage = Storage(db=db, blobs=blobs, key=key)

        def build(fence: object = None) -> Trainer:
            return Trainer(
                data_dir,
                spec=rl_spec,
                policy_dir=policy,
                url=f"http://{host}:{port}",
                device=where,
                precision=compute,
                storage=replace(storage, fence=fence),  # type: ignore[arg-type]
            )

        if replica:  # every replica serves; the lease holder trains (covey.coordinator.replica)
            if db is None or key is None:
                raise _fail("--replica needs --db postgresql://... and --key: replicas share a run")
            _replica(build, db, host, port)
            return
        t = build()
    except (ValueError, FileNotFoundError, UserError) as e:
        raise _fail(str(e)) from None
    except sqlite3.DatabaseError as e:  # a damaged database in --data-dir
        raise _fail(f"{data_dir}: its database cannot be read ({e}); is it damaged?") from None
    typer.echo(
        f"trainer of run {t.run_id} at http://{host}:{port} (policy v{t.version}, "
        f"learning on {where} in {compute})"
    )
    serve(t, host, port)


def _replica(build: Any, db: str, host: str, port: int) -> None:
    """A replica of an RL run: a relaying follower at once, the trainer once it holds the
    run's lease (its moments: covey.rl.moments, in its own data dir)."""
    from covey.config import LimitsConfig
    from covey.coordinator.replica import (
        RelayFollower,
        exit_on_lost,
        holder_of,
        serve_replica,
        url_of,
    )
    from covey.rl.service import create_app

    holder, url = holder_of(port), url_of(host, port)

    def build_leader(fence: Any) -> Any:
        t = build(fence)
        logging.getLogger("covey.rl").info(
            "[trainer] replica %s leads run %s at policy v%d", holder, t.run_id, t.version
        )
        return create_app(t), t.start, t.stop

    typer.echo(f"RL trainer replica {holder} serving at {url}")
    serve_replica(
        db_url=db, holder=holder, own_url=url, host=host, port=port,
        limits=LimitsConfig(), build_follower=lambda: RelayFollower(db, url, 60.0),
        build_leader=build_leader, on_lost=exit_on_lost(holder),
    )  # fmt: skip


@rl_app.command("worker")
def worker(
    trainer_url: TrainerUrl,
    behavior: Annotated[
        str,
        typer.Option(help="honest, or a cheat (tests/demo): covey.rl.cheater.worker_behaviors()"),
    ] = "honest",
    identity: IdentityPath = None,
    name: Annotated[str, typer.Option(help="name shown on the status page")] = "worker",
    stake: Annotated[float, typer.Option(help="credits staked on joining", min=0)] = 1.0,
    max_steps: Annotated[
        int | None, typer.Option(help="stop after this many batches", min=1)
    ] = None,
    serve_blobs: Annotated[bool, typer.Option(help="serve fetched policies to others")] = False,
    run_id: Annotated[str | None, typer.Option(help="refuse a trainer of another run")] = None,
    threads: Annotated[int, typer.Option(help="torch threads", min=1)] = 1,
    device: PeerDevice = "auto",
    house_of: Annotated[
        Path | None,
        typer.Option(
            help="run owners: the trainer's key file; this worker is then house worker "
            "--house-index of the run, whose batches are its canaries (docs/rl.md)"
        ),
    ] = None,
    house_index: Annotated[
        int, typer.Option(min=0, max=63, help="with --house-of: its first house key (0-63)")
    ] = 0,
    log_json: Annotated[bool, LOG_JSON] = False,
) -> None:
    """Generate rollout batches for a trainer and get paid per verified token."""
    from covey.peer.client import CoordinatorLost, PeerRejected
    from covey.rl.cheater import rollout_worker
    from covey.trust.halt import EXIT_HALTED

    where = _peer_device(device)
    _logging(json_lines=log_json, peer=name)
    _threads(threads)
    stop = _stop_on_signals()
    try:
        common: dict[str, Any] = {"name": name, "stake": stake, "serve_blobs": serve_blobs}
        common |= {"run_id": run_id, "stop": stop, "device": where}
        if house_of is not None:
            if behavior != "honest" or identity is not None:
                raise _fail("--house-of plays its own canaries under its own keys: leave "
                            "--behavior and --identity out")  # fmt: skip
            from covey.rl.house import HouseRolloutWorker

            w = HouseRolloutWorker(trainer_url, house_of, house_index, **common)
        else:
            w = rollout_worker(trainer_url, _identity(identity), behavior=behavior, **common)
        n = w.run_loop(max_steps)
    except PeerRejected as e:
        raise _halted_or_fail(name, e) from None
    except CoordinatorLost as e:
        raise _fail(str(e)) from None
    except ValueError as e:
        raise _fail(str(e)) from None
    typer.echo(f"worker {name}: {n} batches submitted")
    if w.halted is not None:
        raise typer.Exit(EXIT_HALTED)


@rl_app.command("validator")
def validator(
    trainer_url: TrainerUrl,
    behavior: Annotated[str, typer.Option(help="honest; lazy or accuse (tests/demo)")] = "honest",
    identity: IdentityPath = None,
    name: Annotated[str, typer.Option(help="name shown on the status page")] = "validator",
    stake: Annotated[float, typer.Option(help="credits staked on joining", min=0)] = 10.0,
    max_checks: Annotated[
        int | None, typer.Option(help="stop after this many checks", min=1)
    ] = None,
    run_id: Annotated[str | None, typer.Option(help="refuse a trainer of another run")] = None,
    threads: Annotated[int, typer.Option(help="torch threads", min=1)] = 1,
    device: PeerDevice = "auto",
    log_json: Annotated[bool, LOG_JSON] = False,
) -> None:
    """Check rollout batches the trainer assigns; earn per check and per proven catch.
    Exit 1, before claiming anything, when this validator's device is of another class
    than the run's verify_device (re-checking there could convict honest work)."""
    from covey.peer.client import CoordinatorLost, PeerRejected
    from covey.rl.cheater import rollout_validator
    from covey.rl.runspec import VerifyRefused
    from covey.trust.halt import EXIT_HALTED

    where = _peer_device(device)
    _logging(json_lines=log_json, peer=name)
    _threads(threads)
    stop = _stop_on_signals()
    try:
        v = rollout_validator(
            trainer_url,
            _identity(identity),
            name=name,
            stake=stake,
            behavior=behavior,
            run_id=run_id,
            stop=stop,
            device=where,
        )
        n = v.run_loop(max_checks)
    except VerifyRefused as e:
        logging.getLogger("covey.rl.validator").error("[%s] %s", name, e)
        raise typer.Exit(1) from None
    except PeerRejected as e:
        raise _halted_or_fail(name, e) from None
    except (CoordinatorLost, ValueError) as e:
        raise _fail(str(e)) from None
    typer.echo(f"validator {name}: {n} checks reported")
    if v.halted is not None:
        raise typer.Exit(EXIT_HALTED)


@rl_app.command("demo")
def demo(
    adversaries: Annotated[
        int,
        typer.Option(help="cheating workers to add, one cheat kind each (covey.rl.cheats)", min=0),
    ] = 0,
    out: Annotated[
        Path | None,
        typer.Option(
            help="run directory: summary.json, the ledger, logs (default runs/rl-demo-TIME)"
        ),
    ] = None,
    minutes: Annotated[float, typer.Option(help="how long the RL phase runs", min=0.1)] = 5.0,
    policy: Annotated[
        str | None,
        typer.Option(help="starting policy directory (covey rl sft); default: run SFT first"),
    ] = None,
    sft_steps: Annotated[int, typer.Option(help="SFT steps when no --policy", min=1)] = 450,
    seed: Annotated[int, typer.Option(help="seeds SFT")] = 0,
    device: Device = "cpu",
    log_json: Annotated[bool, LOG_JSON] = False,
    house_workers: Annotated[
        int,
        typer.Option(
            min=0,
            max=2,
            help="of the 3 honest rollout workers, how many are the run owner's house "
            "workers, whose canary batches test the validator (docs/rl.md); 0: none",
        ),
    ] = 1,
) -> None:
    """Run a trainer, 3 rollout workers (one a house worker, whose canaries test the
    validator), a validator and --adversaries cheaters on 127.0.0.1; write OUT/summary.json
    (pass@1 start/end, batches accepted/rejected, cheats caught, canaries caught)."""
    import time

    if log_json:  # this process, and the children through COVEY_LOG_JSON
        _logging(json_lines=True, peer="demo")
    from covey.rl.demo import run_demo

    where = _device(device)
    out = out or Path("runs") / time.strftime("rl-demo-%Y%m%d-%H%M%S")
    if (out / "coordinator.db").exists():
        raise _fail(f"{out} holds a run already; give another --out")
    is_dir = policy is None or policy.startswith(("covey:", "hf:"))
    if not is_dir and not (Path(str(policy)) / "config.json").is_file():
        raise _fail(f"--policy {policy}: not a policy directory (no config.json; covey rl sft)")
    _threads(1)
    try:
        run_demo(
            out,
            adversaries=adversaries,
            minutes=minutes,
            policy=policy,
            sft_steps=sft_steps,
            seed=seed,
            echo=typer.echo,
            device=where,
            house_workers=house_workers,
        )
    except (ValueError, RuntimeError) as e:
        raise _fail(str(e)) from None
