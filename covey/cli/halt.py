"""`covey halt`: the run owner stops a run, in any coordinator mode (rounds, RL, SWARM).

The coordinator's GET /v1/run says which run it serves and in which mode; the run id is
recomputed from what it serves (spec, and the data, first policy or key the id covers),
so the owner signs a HALT for the run it hands out, never for an id the server merely
names. Exit 0 once the HALT is in the ledger, 2 if it was refused. Only typer is imported
here; the rest loads when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

MODES = ("rounds", "rl", "swarm")
RUN_ID = typer.Option(
    "--run-id",
    help="the run id the coordinator printed: refuse a coordinator serving any other run; "
    "without it, the id its spec hashes to is taken",
)


def register(app: typer.Typer) -> None:
    """Add `covey halt` to `app`."""

    @app.command()
    def halt(
        coordinator: Annotated[str, typer.Option(help="the coordinator's URL")],
        key: Annotated[
            Path,
            typer.Option(
                help="the run owner's key file: the one whose public key is the spec's "
                "owner_key, or, when the spec names none, the coordinator's "
                "(DATA_DIR/coordinator.key; an RL trainer's DATA_DIR/trainer.key)"
            ),
        ],
        reason: Annotated[
            str, typer.Option(help="why: written to the ledger and shown to every worker")
        ] = "halted by the run owner",
        run_id: Annotated[str | None, RUN_ID] = None,
    ) -> None:
        """Stop a run for good, as its owner: a data-parallel coordinator, an RL trainer or
        a SWARM coordinator.

        The owner's signed HALT is written to the run's ledger and the run stops: no round
        opens again (rounds), no policy step is taken (RL), nothing more is paid (SWARM);
        workers, validators, servers and trainers exit with status 3 at their next
        heartbeat or request (a rounds worker that cannot hear stops training when its
        participation lease runs out). The coordinator keeps serving the ledger (`covey
        ledger verify` accepts a halted run) and the last model. Exit 0 once the HALT is
        in the ledger, 2 if it was refused."""
        halt_run(coordinator, key, reason, run_id)


def halt_run(coordinator: str, key: Path, reason: str, run_id: str | None) -> None:
    from covey.errors import UserError, check_coordinator
    from covey.peer.client import CoordinatorClient, CoordinatorLost, PeerRejected
    from covey.trust.identity import Identity, IdentityError

    if not key.is_file():
        raise _fail(f"no key file at {key}")
    try:
        info = check_coordinator(coordinator, 10.0, modes=MODES)
        owner = Identity.load_or_create(key)
    except (UserError, IdentityError) as e:
        raise _fail(str(e)) from None
    client = CoordinatorClient(coordinator, timeout_s=30.0, lost_s=30.0, identity=owner)
    try:
        spec_run_id = served_run_id(info)
        if spec_run_id != info["run_id"] or (run_id is not None and spec_run_id != run_id):
            raise _fail(
                f"the coordinator serves run {info['run_id']} (its spec hashes to "
                f"{spec_run_id}), not --run-id {run_id}"
            )
        body = {"run_id": spec_run_id, "owner_key": owner.public_key, "reason": reason}
        halted = client.post("/v1/halt", body)["halted"]
    except PeerRejected as e:
        raise _fail(f"the coordinator refused the HALT: {e}") from None
    except (CoordinatorLost, ValueError, KeyError, TypeError) as e:
        raise _fail(f"{type(e).__name__}: {e}") from None
    finally:
        client.close()
    typer.echo(
        f"run {spec_run_id} HALTED at round {halted['round']} (ledger entry {halted['index']}): "
        f"{halted['reason']}"
    )


def served_run_id(info: dict[str, Any]) -> str:
    """The run id that what GET /v1/run serves hashes to, by mode (ValueError, KeyError or
    TypeError for a description that does not parse)."""
    mode = info.get("mode", "rounds")
    if mode == "rl":
        from covey.rl.runspec import RLSpec
        from covey.rl.runspec import run_id_of as rl_run_id

        spec = info["spec"]
        return rl_run_id(
            RLSpec.model_validate(spec["rl"]),
            spec["model"],
            str(info["policy0"]),
            str(info["coordinator_key"]),
        )
    if mode == "swarm":
        from covey.swarm.config import SwarmConfig

        return SwarmConfig.received(info["spec"]).run_id
    from covey.config import RunConfig, run_id_of

    # spec and data: the id the owner handed out
    return run_id_of(RunConfig.model_validate(info["spec"]), str(info["corpus_fingerprint"]))


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)
