"""`covey serve server | worker | validator`: the serving mode from the command line.

Only typer is imported at module level: torch loads when a command runs. Bad input exits 2
with `error: ...`. A worker's --behavior other than honest (tests, `covey bench serve`)
loads covey.serve.cheater; nothing else does.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

serve_app = typer.Typer(
    help="Serve a trained model: an OpenAI-compatible API answered by untrusted inference "
    "workers, re-checked by staked validators.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
# `covey serve demo`'s house requests: the run owner's own traffic, one every few seconds,
# whose answers the server drops; a house worker's canaries answer some of them
DEMO_HOUSE_REQUESTS = (
    {"prompt": "Once upon a time", "max_tokens": 16},
    {"prompt": "The cat sat", "max_tokens": 16, "temperature": 0.7},
    {"prompt": "Hello there", "max_tokens": 16, "top_p": 0.9},
)
DEMO_HOUSE_EVERY_S = 2.0
# a quarter of the house worker's answers to them are canaries: a new key's first answers
# are all checked, so a validator meets one within minutes; a caught one burns a key (an
# unchecked one does not): at 0.5 its 64 keys lasted about 11 minutes (8 caught in 80 s),
# at 0.25 they last several times longer; at the default 0.05 a short demo seldom shows one
DEMO_CANARY_RATE = 0.25

ServerUrl = Annotated[
    str,
    typer.Option(
        "--server",
        "--coordinator",
        help="the server's URL, e.g. http://127.0.0.1:8800 (--coordinator, as for other peers)",
    ),
]
ModelDir = Annotated[
    Path, typer.Option(help="the exported model folder (the server's model, by content id)")
]
IdentityPath = Annotated[
    Path | None,
    typer.Option(help="Ed25519 key file (created mode 600 if missing); default: a fresh key"),
]


def register(app: typer.Typer) -> None:
    """Add the `serve` command group to the main `covey` app."""
    app.add_typer(serve_app, name="serve")


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def _setup(name: str, threads: int) -> threading.Event:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per long-poll otherwise
    import torch

    torch.set_num_threads(threads)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _identity(path: Path | None):
    from covey.trust.identity import Identity, IdentityError

    try:
        return Identity.generate() if path is None else Identity.load_or_create(path)
    except IdentityError as e:
        raise _fail(str(e)) from None


@serve_app.command("server")
def server(
    data_dir: Annotated[Path, typer.Option(help="the run's database, key and ledger")],
    model: Annotated[
        str | None,
        typer.Option(
            help="an exported model folder, or a rounds run directory (its latest "
            "certified checkpoint); not needed to reopen a data dir"
        ),
    ] = None,
    spec: Annotated[Path | None, typer.Option(help="TOML with a [serve] table")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="KEY=VALUE; repeat")] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port", min=1, max=65535)] = 8800,
    threads: Annotated[int, typer.Option(help="torch threads (the referee)", min=1)] = 1,
    house_requests: Annotated[
        Path | None,
        typer.Option(
            help="the owner's house requests: one JSON OpenAI completion request per line, "
            "sent by the server itself (answers dropped); house workers' canaries answer "
            "some of them (docs/trust.md, Canaries)"
        ),
    ] = None,
    house_every: Annotated[
        float, typer.Option(help="seconds between house requests, on average", min=0.01)
    ] = 10.0,
) -> None:
    """Serve the model's OpenAI-compatible API; workers and validators join it."""
    from covey.errors import UserError
    from covey.spec import load_spec

    try:
        values = {}
        if spec is not None:
            from covey.config.parts import load_toml

            values = load_toml(spec).get("serve", {})
        from covey.serve.config import ServeConfig

        cfg = load_spec(ServeConfig, spec, values, sets or [])
        house = None
        if house_requests is not None:
            from covey.serve.canaries import house_request_bodies

            house = house_request_bodies(house_requests.read_text().splitlines())
    except (UserError, OSError, ValueError) as e:
        raise _fail(str(e)) from None
    _setup("server", threads)
    from covey.serve.app import serve
    from covey.serve.service import ServeCoordinator

    try:
        s = ServeCoordinator(cfg, data_dir, model)
    except ValueError as e:
        raise _fail(str(e)) from None
    typer.echo(f"serving {cfg.name} (run {s.run_id}) on http://{host}:{port}/v1", err=True)
    serve(s, host, port, house, house_every)


@serve_app.command("worker")
def worker(
    server_url: ServerUrl,
    model: ModelDir,
    behavior: Annotated[
        str, typer.Option(help="honest, or a cheat (tests): covey.serve.cheater.CHEATS")
    ] = "honest",
    identity: IdentityPath = None,
    name: Annotated[str, typer.Option(help="name in the ledger")] = "worker",
    stake: Annotated[float, typer.Option(help="credits staked on joining", min=0)] = 10.0,
    max_answers: Annotated[int | None, typer.Option(help="stop after this many", min=1)] = None,
    threads: Annotated[int, typer.Option(help="torch threads", min=1)] = 1,
    slots: Annotated[
        int | None,
        typer.Option(help="requests answered at a time [default: the run's worker_slots]", min=1),
    ] = None,
    house_of: Annotated[
        Path | None,
        typer.Option(
            help="run owners: the server's key file (DATA_DIR/coordinator.key); this worker "
            "is then house worker --house-index of the run, whose answers to the server's "
            "house requests are its canaries (docs/trust.md, Canaries)"
        ),
    ] = None,
    house_index: Annotated[
        int, typer.Option(min=0, max=63, help="with --house-of: its first house key (0-63)")
    ] = 0,
) -> None:
    """Answer the server's requests and get paid per verified token."""
    from covey.peer.client import CoordinatorLost

    stop = _setup(name, threads)
    try:
        if house_of is not None:
            if behavior != "honest" or identity is not None:
                raise _fail("--house-of plays its own canaries under its own keys: leave "
                            "--behavior and --identity out")  # fmt: skip
            from covey.serve.house import HouseServeWorker

            def make(url, _, model, **k):
                return HouseServeWorker(url, house_of, model, house_index, **k)
        elif behavior == "honest":
            from covey.serve.worker import ServeWorker as make
        else:
            from covey.serve.cheater import serve_worker

            def make(*a, **k):
                return serve_worker(behavior, *a, **k)

        w = make(server_url, _identity(identity), model, name=name, stake=stake, stop=stop)
        n = w.run_loop(max_answers, slots)
    except (CoordinatorLost, ValueError) as e:
        raise _fail(str(e)) from None
    typer.echo(f"worker {name}: {n} answers" + (f"; stopped: {w.stopped}" if w.stopped else ""))
    if w.stopped:
        raise typer.Exit(1)


@serve_app.command("validator")
def validator(
    server_url: ServerUrl,
    model: ModelDir,
    identity: IdentityPath = None,
    name: Annotated[str, typer.Option(help="name in the ledger")] = "validator",
    stake: Annotated[float, typer.Option(help="credits staked on joining", min=0)] = 10.0,
    max_checks: Annotated[int | None, typer.Option(help="stop after this many", min=1)] = None,
    threads: Annotated[int, typer.Option(help="torch threads", min=1)] = 1,
) -> None:
    """Re-check drawn answers by one prefill; paid per check and per proven catch."""
    from covey.peer.client import CoordinatorLost
    from covey.serve.validator import ServeValidator

    stop = _setup(name, threads)
    try:
        v = ServeValidator(
            server_url, _identity(identity), model, name=name, stake=stake, stop=stop
        )
        n = v.run_loop(max_checks)
    except (CoordinatorLost, ValueError) as e:
        raise _fail(str(e)) from None
    typer.echo(f"validator {name}: {n} checks")


@serve_app.command("demo")
def demo(
    model: Annotated[
        str, typer.Option(help="an exported model folder, or a run directory (covey demo's)")
    ],
    out: Annotated[Path, typer.Option(help="the server's data dir")] = Path("runs/serve-demo"),
    workers: Annotated[int, typer.Option(help="honest worker processes", min=1)] = 2,
    adversaries: Annotated[
        int, typer.Option(help="cheating workers (quantized weights): watch them go", min=0)
    ] = 0,
    validators: Annotated[int, typer.Option(help="validator processes", min=0)] = 1,
    port: Annotated[int, typer.Option(help="port on 127.0.0.1", min=1, max=65535)] = 8800,
    minutes: Annotated[
        float | None, typer.Option(help="stop after this long (default: Ctrl-C)", min=0.05)
    ] = None,
    house_workers: Annotated[
        int,
        typer.Option(
            min=0,
            help="of the honest workers, how many are the run owner's house workers, whose "
            "canary answers to the server's own house requests test the validators "
            "(docs/serve.md); 0: none (always 0 without validators, and one plain worker "
            "is kept)",
        ),
    ] = 1,
) -> None:
    """A server, workers and validators as processes on 127.0.0.1, serving `model`; the
    server sends house requests of its own, and a house worker's canary answers to some of
    them test the validators."""
    import subprocess
    import sys
    import time

    import httpx

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    from covey.io.deposit import DepositRefused, fund_key
    from covey.serve.model import model_dir
    from covey.trust.house import HOUSE_KEYS

    try:
        folder = model_dir(model, out)  # a run directory is exported once, into out/model
    except (ValueError, OSError) as e:
        raise _fail(str(e)) from None
    url = f"http://127.0.0.1:{port}"
    run = [sys.executable, "-m", "covey", "serve"]
    out.mkdir(parents=True, exist_ok=True)
    logs = open(out / "processes.log", "ab")  # noqa: SIM115 -- closed below
    server = [*run, "server", "--data-dir", str(out), "--model", str(folder)]
    houses = max(0, min(house_workers, workers - 1)) if validators else 0
    if houses:  # the owner's own requests, whose answers are dropped (covey.serve.canaries)
        requests = out / "house-requests.jsonl"
        requests.write_text("".join(json.dumps(b) + "\n" for b in DEMO_HOUSE_REQUESTS))
        server += ["--house-requests", str(requests), "--house-every", str(DEMO_HOUSE_EVERY_S)]
        server += ["--set", f"trust.canary_rate={DEMO_CANARY_RATE}"]
    procs = [subprocess.Popen([*server, "--port", str(port)], stdout=logs, stderr=logs)]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not stop.is_set():
            if procs[0].poll() is not None:
                raise _fail(f"the server exited; see {out / 'processes.log'}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        peer = ["--server", url, "--model", str(folder)]

        def funded(name: str) -> list[str]:
            # the owner (the server's key) deposits what the peer stakes (the default 10
            # credits): a key bonds only credits it holds
            key = out / "keys" / f"{name}.key"
            try:
                fund_key(url, out / "coordinator.key", key, 10.0)
            except DepositRefused as e:
                raise _fail(f"cannot fund {name}: {e}") from None
            return ["--name", name, "--identity", str(key)]

        for i in range(workers + adversaries):
            cheat = ["--behavior", "quantized"] if i >= workers else []
            name = f"cheat{i - workers}" if cheat else f"w{i}"
            if (k := i - (workers - houses)) >= 0 and not cheat:  # named like any worker
                first = str(k * (HOUSE_KEYS // houses))  # its first house key of 64
                cheat = ["--house-of", str(out / "coordinator.key"), "--house-index", first]
                typer.echo(f"{name} is the run owner's house worker: its canary answers to "
                           "the server's house requests test the validators")  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [*run, "worker", *peer, *funded(name), *cheat], stdout=logs, stderr=logs
                )
            )
        if validators and not houses:
            typer.echo("warning: no house worker plays canaries: the validators are unchecked")
        for i in range(validators):
            procs.append(
                subprocess.Popen(
                    [*run, "validator", *peer, *funded(f"v{i}")], stdout=logs, stderr=logs
                )
            )
        typer.echo(f"waiting for {workers + adversaries} workers to load the model...")
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not stop.wait(0.5):
            status = httpx.get(f"{url}/v1/serve/status", timeout=5).json()
            if status["serving"] >= workers + adversaries:
                break
        typer.echo(
            f"serving {folder} at {url}/v1 (logs: {out / 'processes.log'}); try:\n"
            f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' "
            '-d \'{"prompt": "Once upon a time", "max_tokens": 40}\'\n'
            f"status: {url}/v1/serve/status   Ctrl-C stops everything"
        )
        stop.wait(None if minutes is None else minutes * 60)
        if houses:  # revealed with their verdicts (covey.serve.canaries)
            counts = httpx.get(f"{url}/v1/serve/status", timeout=5).json()["canaries"]
            typer.echo(
                f"canaries: caught {counts.get('caught', 0)}, passed (convicted by the "
                f"referee after an agreement) {counts.get('convicted', 0)}"
            )
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        logs.close()
