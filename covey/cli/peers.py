"""`covey coordinator`, `worker`, `validator` and `halt`: the roles of a networked run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from covey.cli.common import (
    BLOBS_OPTION,
    DB_OPTION,
    DEVICE_HELP,
    KEY_OPTION,
    LOG_JSON,
    LOG_TO,
    REPLICA_OPTION,
    RUN_ID_OPTION,
    SET,
    WANDB_PROJECT,
    check_coordinator_url,
    check_device,
    check_name,
    check_tracker,
    fail,
    guard,
    load_config,
    setup_logs,
)
from covey.cli.root import app


@app.command()
def coordinator(
    config: Annotated[Path, typer.Argument(help="TOML run spec; its hash is the run id")],
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8470,
    data_dir: Annotated[
        Path, typer.Option(help="SQLite database, blobs and checkpoints; reuse it to resume")
    ] = Path("runs/coordinator"),
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    verbose: Annotated[bool, typer.Option(help="debug logging")] = False,
    log_json: Annotated[bool, LOG_JSON] = False,
    log: Annotated[str | None, LOG_TO] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="where the referee recomputes disputes: auto|cpu|cuda|cuda:N|mps; default "
            "the run's [peer] verify_device. On another class it judges nothing (warned)"
        ),
    ] = None,
    set_: Annotated[list[str] | None, SET] = None,
    wandb_project: Annotated[str | None, WANDB_PROJECT] = None,
    db: Annotated[str | None, DB_OPTION] = None,
    blobs: Annotated[str | None, BLOBS_OPTION] = None,
    key: Annotated[Path | None, KEY_OPTION] = None,
    replica: Annotated[bool, REPLICA_OPTION] = False,
) -> None:
    """Serve a training run: membership, rounds, blobs, checkpoints and the status page.

    Killed and restarted on the same --data-dir, it resumes from the last committed round;
    with --db, --blobs and --key, on any --data-dir (docs/operations.md)."""
    from covey.config import load_run_config

    cfg = load_config(config, {}, load_run_config, set_)
    check_device(device)
    setup_logs(verbose, "coordinator", log_json)
    check_tracker(log)
    from covey.coordinator.integrity import check_data_dir
    from covey.guards import check_port_free, lock_dir

    guard(lambda: check_port_free(host, port))  # before the banner, before any file
    guard(lambda: lock_dir(data_dir, "covey coordinator"))  # one coordinator per data dir
    guard(lambda: check_data_dir(data_dir))  # a damaged database or state: refused
    from covey.coordinator.app import serve
    from covey.coordinator.service import Coordinator
    from covey.coordinator.storage import Storage

    if replica:  # every replica serves; the lease holder drives the run
        if db is None or key is None:
            raise fail("--replica needs --db postgresql://... and --key: replicas share a run")
        storage = Storage(db=db, blobs=blobs, key=key)
        _serve_replica(cfg, data_dir, storage, host, port, log, threads, device)
        return
    try:
        storage = Storage(db=db, blobs=blobs, key=key)
        coord = Coordinator(cfg, data_dir, threads=threads, device=device, storage=storage)
    except ValueError as e:
        raise fail(str(e)) from None
    # the run id covers the coordinator's key: it is what peers are told to trust
    typer.echo(f"covey coordinator: {cfg.name}, status page http://{host}:{port}/")
    typer.secho(f"  run id: {coord.run_id}", bold=True)
    typer.echo(f"  coordinator key: {coord.identity.public_key}")
    typer.echo(f"  hand out: covey worker --coordinator URL --run-id {coord.run_id}")
    if log is None:
        serve(coord, host, port)
        return
    import threading

    from covey.tracking import follow_rounds, open_tracker

    tracker = open_tracker(log, data_dir, cfg.name, cfg.model_dump(mode="json"), wandb_project)
    assert tracker is not None  # check_tracker accepted `log`
    stop = threading.Event()
    follower = follow_rounds(tracker, coord.db, stop)
    try:
        serve(coord, host, port)
    finally:
        stop.set()
        follower.join(timeout=10)


def _serve_replica(
    cfg: Any,
    data_dir: Path,
    storage: Any,
    host: str,
    port: int,
    log: str | None,
    threads: int | None,
    device: str | None,
) -> None:
    """A replica of a rounds run (covey.coordinator.replica): a follower at once, the
    leader once it holds the run's lease."""
    from dataclasses import replace

    from covey.coordinator.app import create_app, quiet_gc
    from covey.coordinator.replica import exit_on_lost, holder_of, serve_replica, url_of
    from covey.coordinator.replica_rounds import RoundsFollower
    from covey.coordinator.service import Coordinator, load_run_corpus

    corpus = load_run_corpus(cfg)  # what takes longest to build, before the wait
    holder, url = holder_of(port), url_of(host, port)
    from covey.trust.identity import Identity

    Identity.load_or_create(storage.key)  # made once, before the follower and the leader

    def build_leader(fence: Any) -> Any:
        coord = Coordinator(
            cfg, data_dir, threads=threads, device=device, storage=replace(storage, fence=fence),
            corpus=corpus,
        )  # fmt: skip
        stops: list[Any] = [coord.stop]

        def start() -> None:
            coord.start()
            quiet_gc()
            if log is not None:
                import threading

                from covey.tracking import follow_rounds, open_tracker

                tracker = open_tracker(log, data_dir, cfg.name, cfg.model_dump(mode="json"), None)
                stop = threading.Event()
                follow_rounds(tracker, coord.db, stop)
                stops.insert(0, stop.set)

        return create_app(coord), start, lambda: [s() for s in stops]

    def build_follower() -> RoundsFollower:
        try:
            follower = RoundsFollower(cfg, data_dir, storage, corpus, url)
        except ValueError as e:
            raise fail(str(e)) from None
        typer.echo(f"covey coordinator: {cfg.name}, replica {holder} serving at {url}")
        typer.secho(f"  run id: {follower.host.run_id}", bold=True)
        return follower

    try:
        serve_replica(
            db_url=storage.db, holder=holder, own_url=url, host=host, port=port,
            limits=cfg.limits, build_follower=build_follower, build_leader=build_leader,
            on_lost=exit_on_lost(holder),
        )  # fmt: skip
    except ValueError as e:
        raise fail(str(e)) from None


@app.command()
def worker(
    coordinator: Annotated[
        str, typer.Option(help="the coordinator's URL")
    ] = "http://127.0.0.1:8470",
    identity: Annotated[
        Path | None,
        typer.Option(help="Ed25519 key file, created on first use (mode 600); id = its hash"),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="name on the status page; default: the id's start")
    ] = None,
    stake: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="credits staked when first joining (the key must hold them: the run's owner "
            "deposits them); default: the run's minimum stake",
            show_default=False,
        ),
    ] = None,
    behavior: Annotated[
        str,
        typer.Option(help="tests and demos: honest, or a cheat (see covey.peer.adversary)"),
    ] = "honest",
    device: Annotated[
        str | None,
        typer.Option(
            help=DEVICE_HELP + "; default: the run spec's [peer] device, where auto means the "
            "class the run verifies on (verify_device), so rounding cannot start a dispute"
        ),
    ] = None,
    threads: Annotated[int, typer.Option(help="torch CPU threads")] = 1,
    serve_blobs: Annotated[
        bool, typer.Option(help="serve contributions from our own blob server (else upload)")
    ] = True,
    blob_host: Annotated[
        str, typer.Option(help="address the blob server listens on")
    ] = "127.0.0.1",
    advertise_host: Annotated[
        str | None, typer.Option(help="address other peers reach the blob server at")
    ] = None,
    bandwidth_mbps: Annotated[float | None, typer.Option(help="link estimate, Mbit/s")] = None,
    slowdown: Annotated[
        float, typer.Option(help="emulate slower hardware: steps take this many times longer")
    ] = 1.0,
    store_dir: Annotated[Path | None, typer.Option(help="local blob store")] = None,
    max_rounds: Annotated[int | None, typer.Option(help="leave after this many rounds")] = None,
    connect_timeout: Annotated[
        float, typer.Option(help="seconds to keep trying to reach the coordinator at start")
    ] = 120.0,
    run_id: Annotated[str | None, RUN_ID_OPTION] = None,
    verbose: Annotated[bool, typer.Option(help="debug logging")] = False,
    log_json: Annotated[bool, LOG_JSON] = False,
    group: Annotated[
        str,
        typer.Option(
            help="under torchrun: ddp (every rank holds the model) or fsdp (FSDP2: gradients "
            "and optimizer moments sharded; DiLoCo only)"
        ),
    ] = "ddp",
    house_of: Annotated[
        Path | None,
        typer.Option(
            help="run owners: the coordinator's key file; this worker is then house worker "
            "--house-index of the run (its canaries, docs/trust.md), under a key derived "
            "from it (--identity is not used; --run-id is required)"
        ),
    ] = None,
    house_index: Annotated[
        int, typer.Option(min=0, max=63, help="with --house-of: which house key (0-63)")
    ] = 0,
) -> None:
    """Join a run and train: fetch the canonical state, train each round's assignment,
    publish contributions, apply certified rounds. Ctrl-C / SIGTERM leave cleanly."""
    from covey.peer.adversary import check_behavior

    if slowdown < 1:
        raise fail(f"--slowdown must be >= 1, got {slowdown}")
    try:  # a plain behavior, late:<kind>:<round> or intermittent:<kind>:<fraction>
        check_behavior(behavior)
    except ValueError as e:
        raise fail(f"--behavior: {e}") from None
    check_name(name)
    check_device(device)
    if group not in ("ddp", "fsdp"):
        raise fail(f"--group must be ddp or fsdp, got {group!r}")
    from covey.peer.group import rank_from_env

    if rank_from_env() > 0:  # under torchrun: rank 0 is the peer, the others follow it
        from covey.peer.group import run_follower

        raise typer.Exit(run_follower(device, threads, group))
    setup_logs(verbose, name or "worker", log_json)
    check_coordinator_url(coordinator, connect_timeout, log_json)
    from covey.peer.cheater import build_worker
    from covey.peer.worker import WorkerOptions
    from covey.trust.identity import IdentityError

    opts = WorkerOptions(
        coordinator=coordinator,
        identity=identity,
        name=name,
        stake=stake,
        behavior=behavior,
        device=device,
        group=group,
        threads=threads,
        serve_blobs=serve_blobs,
        blob_host=blob_host,
        advertise_host=advertise_host,
        bandwidth_mbps=bandwidth_mbps,
        slowdown=slowdown,
        store_dir=store_dir,
        max_rounds=max_rounds,
        connect_timeout_s=connect_timeout,
        run_id=run_id,
    )
    try:
        if house_of is None:
            peer = build_worker(opts)
        else:
            if behavior != "honest":
                raise fail("--house-of plays its own canaries: leave --behavior out")
            from covey.peer.house import HouseWorker

            peer = HouseWorker(opts, house_of, house_index)
    except (IdentityError, ValueError) as e:
        raise fail(str(e)) from None
    from covey.logs import set_peer

    set_peer(peer.name)  # the default name is the id's start, known only now
    raise typer.Exit(peer.run())


@app.command()
def validator(
    coordinator: Annotated[
        str, typer.Option(help="the coordinator's URL")
    ] = "http://127.0.0.1:8470",
    identity: Annotated[
        Path | None,
        typer.Option(help="Ed25519 key file (not a worker's), created on first use"),
    ] = None,
    name: Annotated[str | None, typer.Option(help="name on the status page")] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help=DEVICE_HELP + "; default: the run's verify_device. A validator on another "
            "device class or precision than the run's refuses to check (exit 1)"
        ),
    ] = None,
    threads: Annotated[int, typer.Option(help="torch CPU threads")] = 1,
    max_tasks: Annotated[
        int | None, typer.Option(help="stop after re-executing this many contributions")
    ] = None,
    connect_timeout: Annotated[
        float, typer.Option(help="seconds to keep trying to reach the coordinator at start")
    ] = 120.0,
    run_id: Annotated[str | None, RUN_ID_OPTION] = None,
    stake: Annotated[float, typer.Option(help="credits to stake at the first join")] = 0.0,
    aggregate: Annotated[
        bool,
        typer.Option(
            help="also aggregate the shards of sharded rounds drawn to this key (needs a "
            "stake; the run must use DiLoCo and not turn trust.sharded_above_peers off)"
        ),
    ] = False,
    blob_host: Annotated[
        str, typer.Option(help="--aggregate: address the shard blob server listens on")
    ] = "127.0.0.1",
    blob_port: Annotated[
        int, typer.Option(help="--aggregate: its port (0: any free one)", min=0, max=65535)
    ] = 0,
    advertise_host: Annotated[
        str | None, typer.Option(help="--aggregate: address others reach it at")
    ] = None,
    store_dir: Annotated[
        Path | None,
        typer.Option(help="where it keeps the ledger heads it is given (default .covey-peer/NAME)"),
    ] = None,
    verbose: Annotated[bool, typer.Option(help="debug logging")] = False,
    log_json: Annotated[bool, LOG_JSON] = False,
) -> None:
    """Re-execute sampled contributions of a run and dispute the ones that disagree.

    Each task is replayed from the round's start state on the same data; a disagreement
    is narrowed to one segment of the worker's commitments, which the coordinator's
    referee recomputes. Proven catches are paid in the run's ledger.

    With --aggregate (and a stake) it is also an aggregator of sharded rounds: for the
    shards a round's beacon draws to this key it reads only those shards' byte ranges of
    every contribution, computes the new shard, serves it from its own blob server and
    publishes its signed hash; a wrong shard is slashed."""
    if aggregate and stake <= 0:
        raise fail("--aggregate needs --stake > 0: aggregators are drawn from staked keys")
    check_name(name)
    check_device(device)
    setup_logs(verbose, name or "validator", log_json)
    check_coordinator_url(coordinator, connect_timeout, log_json)
    from covey.peer.validator import Validator, ValidatorOptions
    from covey.trust.identity import IdentityError

    opts = ValidatorOptions(
        coordinator=coordinator,
        identity=identity,
        name=name,
        device=device,
        threads=threads,
        max_tasks=max_tasks,
        connect_timeout_s=connect_timeout,
        run_id=run_id,
        stake=stake,
        aggregate=aggregate,
        blob_host=blob_host,
        blob_port=blob_port,
        advertise_host=advertise_host,
        store_dir=store_dir,
    )
    try:
        checker = Validator(opts)
    except IdentityError as e:
        raise fail(str(e)) from None
    from covey.logs import set_peer

    set_peer(checker.name)
    raise typer.Exit(checker.run())
