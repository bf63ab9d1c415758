"""`covey swarm ...`: coordinator, server, trainer and demo of SWARM pipeline training.

Arguments are parsed before torch is imported, so --help is instant.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from covey.coordinator.storage import BLOBS_HELP, DB_HELP, KEY_HELP, REPLICA_HELP, Storage

COORD = typer.Option(
    "--coordinator", help="the swarm coordinator's URL, e.g. http://127.0.0.1:8100"
)


def _check_name(name: str) -> None:
    """The join's name as covey.protocol.schemas.Name takes it (else the join is a 422)."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        _fail(f"--name may use letters, digits and _.- (1-64 of them), got {name!r}")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


DEVICE_HELP = (
    "where stage servers compute: auto (CUDA, then MPS, then CPU) | cpu | cuda | cuda:N | mps"
)


def _device(spec: str) -> str:
    """--device checked before anything starts: exit 2 naming the value when it is
    malformed or absent on this machine; the resolved name otherwise."""
    from covey.devices import DeviceError, resolve_device

    try:
        return str(resolve_device(spec))
    except DeviceError as e:
        _fail(f"--device: {e}")
        raise  # unreachable: _fail exits


LOG_JSON = typer.Option("--log-json", help="log one JSON object a line (time, level, peer, ...)")


def _logging(level: int, json_lines: bool) -> None:
    """Text lines, or with --log-json (or COVEY_LOG_JSON, set by a demo for its children)
    covey.logs' JSON lines, the format every other covey process writes."""
    import os

    from covey.logs import JSON_ENV

    if json_lines or os.environ.get(JSON_ENV, "") not in ("", "0"):
        from covey.logs import setup_logging

        setup_logging("swarm", json_lines=True)
        logging.getLogger().setLevel(level)
        return
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")


def _quiet_http() -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _stop_on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())


def register(app: typer.Typer) -> None:
    """Add `covey swarm` to the main app."""
    swarm = typer.Typer(
        help="SWARM pipeline training: a model cut into stages, several servers per stage.",
        no_args_is_help=True,
        rich_markup_mode=None,
    )
    app.add_typer(swarm, name="swarm")

    @swarm.command("coordinator")
    def coordinator(
        data_dir: Annotated[Path, typer.Option(help="run directory (ledger, keys)")] = Path(
            "swarm-run"
        ),
        host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="port to listen on")] = 8100,
        set_: Annotated[
            list[str] | None,
            typer.Option(
                "--set",
                help="a SwarmConfig field, KEY=VALUE (JSON value); repeat",
                metavar="KEY=VALUE",
            ),
        ] = None,
        model: Annotated[
            str | None, typer.Option(help="hf:DIR: a local Hugging Face decoder (Llama, GPT-2)")
        ] = None,
        device: Annotated[
            str | None,
            typer.Option(
                help="where the referee recomputes disputed replies: auto|cpu|cuda|cuda:N|mps; "
                "default the run's verify_device. On another class it judges nothing (warned)"
            ),
        ] = None,
        log_json: Annotated[bool, LOG_JSON] = False,
        db: Annotated[str | None, typer.Option(help=DB_HELP)] = None,
        blobs: Annotated[str | None, typer.Option(help=BLOBS_HELP)] = None,
        key: Annotated[Path | None, typer.Option(help=KEY_HELP)] = None,
        replica: Annotated[bool, typer.Option("--replica", help=REPLICA_HELP)] = False,
    ) -> None:
        """Serve a SWARM run: stage assignment, averaging rounds, rebalancing, ledger."""
        if model is not None and not model.startswith("hf:"):
            _fail(f"--model {model!r}: expected hf:DIR")
        cfg = _config([*(set_ or []), *([f"model={model}"] if model else [])])
        if device is not None:
            _device(device)
        _logging(logging.INFO, log_json)
        _quiet_http()
        from covey.errors import UserError
        from covey.guards import check_port_free, lock_dir

        try:
            check_port_free(host, port)  # before the banner and before the run dir is made
            lock_dir(data_dir, "covey swarm coordinator")  # one coordinator per data dir
        except UserError as e:
            _fail(str(e))
        from covey.swarm.app import serve
        from covey.swarm.service import SwarmCoordinator

        storage = Storage(db=db, blobs=blobs, key=key)
        if replica:  # every replica serves; the lease holder drives (covey.coordinator.replica)
            if db is None or key is None:
                _fail("--replica needs --db postgresql://... and --key: replicas share a run")
            _replica(cfg, data_dir, device, storage, host, port)
            return
        try:
            coord = SwarmCoordinator(cfg, data_dir, device, storage)
        except ValueError as e:
            _fail(str(e))
        typer.echo(f"swarm run {coord.run_id} on http://{host}:{port} (status page: /)")
        serve(coord, host, port)

    @swarm.command("server")
    def server(
        coordinator: Annotated[str, COORD],
        name: Annotated[str, typer.Option(help="display name")] = "server",
        slowdown: Annotated[
            float, typer.Option(help="emulate a device this many times slower")
        ] = 1.0,
        emulate_s: Annotated[
            float, typer.Option(help="emulated compute seconds per request (x slowdown)")
        ] = 0.0,
        behavior: Annotated[
            str,
            typer.Option(help="honest, or an adversary: wrong, noise, zero, stale, subtle, shade"),
        ] = "honest",
        stake: Annotated[
            float,
            typer.Option(help="credits staked on joining: the key must hold them (--identity)"),
        ] = 0.0,
        identity: Annotated[
            Path | None,
            typer.Option(help="the server's key file, created if absent [default: a fresh key]"),
        ] = None,
        port: Annotated[int, typer.Option(help="port for forward/backward; 0 = any")] = 0,
        stage: Annotated[
            int | None, typer.Option(help="ask for this stage (default: the coordinator picks)")
        ] = None,
        model: Annotated[
            str | None, typer.Option(help="this machine's copy of the run's hf:DIR model")
        ] = None,
        device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """Serve one pipeline stage (assigned by the coordinator): forward and backward."""
        from covey.swarm.server import BEHAVIORS

        _check_name(name)
        if behavior not in BEHAVIORS:
            _fail(f"--behavior {behavior!r} must be one of {', '.join(BEHAVIORS)}")
        if slowdown < 1 or emulate_s < 0:
            _fail(f"--slowdown ({slowdown}) must be >= 1 and --emulate-s ({emulate_s}) >= 0")
        if model is not None and not model.startswith("hf:"):
            _fail(f"--model {model!r}: expected hf:DIR")
        where = _device(device)
        _logging(logging.INFO, log_json)
        _quiet_http()
        import torch

        from covey.swarm.server import StageServer, serve

        torch.set_num_threads(1)
        from covey.trust.identity import Identity, IdentityError

        try:
            key = None if identity is None else Identity.load_or_create(identity)
        except IdentityError as e:
            _fail(str(e))
        s = StageServer(
            coordinator, name=name, slowdown=slowdown, emulate_s=emulate_s, behavior=behavior,
            stake=stake, port=port, stage=stage, device=where, model=model, identity=key,
        )  # fmt: skip
        _stop_on_signals(s.stop)
        try:
            serve(s)
        except ValueError as e:  # the run's spec refused (covey.swarm.config.received)
            _fail(str(e))
        if s.halted is not None:  # the run owner halted the run
            raise typer.Exit(3)  # covey.trust.halt.EXIT_HALTED

    @swarm.command("trainer")
    def trainer(
        coordinator: Annotated[str, COORD],
        name: Annotated[str, typer.Option(help="display name (also seeds its data)")] = "trainer",
        samples: Annotated[int | None, typer.Option(help="stop after this many samples")] = None,
        seconds: Annotated[float | None, typer.Option(help="stop after this long")] = None,
        inflight: Annotated[
            int | None,
            typer.Option(help="microbatches in flight at once [default: 2 per live server]"),
        ] = None,
        fixed: Annotated[
            bool, typer.Option(help="GPipe-style baseline: one fixed server per stage")
        ] = False,
        json_out: Annotated[Path | None, typer.Option("--json", help="write a summary")] = None,
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """Train: route microbatches through one server per stage, forward then backward."""
        _check_name(name)
        if samples is None and seconds is None:
            _fail("give --samples or --seconds")
        if inflight is not None and inflight < 1:
            _fail(f"--inflight ({inflight}) must be at least 1")
        _logging(logging.WARNING, log_json)
        import torch

        from covey.swarm.reports import summary
        from covey.swarm.trainer import SwarmTrainer

        torch.set_num_threads(1)
        try:
            t = SwarmTrainer(coordinator, name=name, inflight=inflight, fixed=fixed, progress=print)
        except ValueError as e:  # the spec refused, or this machine's data is not the run's
            _fail(str(e))
        _stop_on_signals(t.stop)
        t.train(samples=samples, seconds=seconds)
        out = summary(t)
        typer.echo(json.dumps(out))
        if json_out is not None:
            json_out.write_text(json.dumps(out, indent=1))
        t.close()
        if t.halted is not None:  # the run owner halted the run
            raise typer.Exit(3)  # covey.trust.halt.EXIT_HALTED

    @swarm.command("demo")
    def demo(
        minutes: Annotated[float, typer.Option(help="how long to train")] = 2.0,
        kill_every: Annotated[
            float | None, typer.Option(help="SIGKILL a server every S seconds (it comes back)")
        ] = None,
        servers: Annotated[int, typer.Option(help="stage servers of mixed speeds")] = 5,
        port: Annotated[int, typer.Option(help="the coordinator's port")] = 8100,
        device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """Coordinator, stage servers of mixed speeds and a trainer on 127.0.0.1."""
        if log_json:  # this process, and the children through COVEY_LOG_JSON
            _logging(logging.INFO, True)
        if minutes <= 0 or servers < 2 or (kill_every is not None and kill_every <= 0):
            _fail(f"need --minutes > 0 ({minutes}), --servers >= 2 ({servers}), --kill-every > 0")
        where = _device(device)
        from covey.swarm.demo import run_demo

        sys.exit(
            run_demo(
                minutes=minutes, kill_every=kill_every, n_servers=servers, port=port, device=where
            )
        )


def _replica(cfg: Any, data_dir: Path, device: str | None, storage: Storage, host: str,
             port: int) -> None:  # fmt: skip
    """A replica of a SWARM run: a relaying follower at once, the coordinator once it holds
    the run's lease (built from the database as a restarted one is)."""
    from dataclasses import replace

    from covey.coordinator.replica import (
        RelayFollower,
        exit_on_lost,
        holder_of,
        serve_replica,
        url_of,
    )
    from covey.swarm.app import create_app
    from covey.swarm.service import SwarmCoordinator

    assert storage.db is not None  # checked by the caller
    holder, url = holder_of(port), url_of(host, port)

    def build_leader(fence: Any) -> Any:
        coord = SwarmCoordinator(cfg, data_dir, device, replace(storage, fence=fence))
        return create_app(coord), coord.start, coord.stop

    typer.echo(f"swarm coordinator replica {holder} serving at {url}")
    try:
        serve_replica(
            db_url=storage.db, holder=holder, own_url=url, host=host, port=port,
            limits=cfg.limits, build_follower=lambda: RelayFollower(storage.db, url, 60.0),
            build_leader=build_leader, on_lost=exit_on_lost(holder),
        )  # fmt: skip
    except ValueError as e:
        _fail(str(e))


def _config(pairs: list[str]) -> Any:
    """The SwarmConfig of --set pairs (covey.spec.load_spec: dotted keys, JSON values)."""
    from covey.errors import UserError
    from covey.spec import load_spec
    from covey.swarm.config import SwarmConfig

    try:
        return load_spec(SwarmConfig, sets=pairs)
    except UserError as e:
        _fail(str(e))
