"""The `covey` command line. Arguments are parsed before torch is imported, so --help is instant.

One module per command group: `run` (sim), `demo`, `peers` (coordinator, worker,
validator), `halt` (every mode), `bench`; `common` holds what they share and `root` the app
object. Command groups of other packages register themselves here (ledger,
tokenizer/export/generate, swarm, rl).
"""

from __future__ import annotations

import sys

import typer

from covey.bench.agreement_cli import register as register_bench_agreement
from covey.bench.gpu_cli import register as register_bench_gpu
from covey.bench.hostsync_cli import register as register_bench_hostsync
from covey.bench.rl_cli import register as register_bench_rl
from covey.bench.serve import register as register_bench_serve
from covey.bench.shards_cli import register as register_bench_shards
from covey.bench.swarm_cli import register as register_bench_swarm
from covey.cli import common
from covey.cli.root import app, bench_app
from covey.io.cli import register as register_io
from covey.io.ledger_cli import register as register_ledger
from covey.rl.cli import register as register_rl
from covey.rl.ledger_terms import ledger_terms as rl_terms
from covey.serve.cli import register as register_serve
from covey.serve.config import ledger_terms as serve_terms
from covey.swarm.cli import register as register_swarm
from covey.swarm.ledger_evidence import ledger_terms as swarm_terms
from covey.swarm.ledger_evidence import recompute_disputes as recompute_swarm_disputes

register_ledger(
    app,
    recomputers=[recompute_swarm_disputes],
    terms=[rl_terms, swarm_terms, serve_terms],  # each mode's treasury terms (its spec's)
)
register_io(app)  # tokenizer train, export, generate
register_bench_gpu(bench_app)  # covey bench gpu (covey/bench/gpu_cli.py)
register_swarm(app)  # swarm coordinator, server, trainer, demo
register_bench_swarm(bench_app)  # covey bench swarm
register_bench_shards(bench_app)  # covey bench shards (gather vs sharded rounds)
register_bench_agreement(bench_app)  # covey bench agreement (simulator vs network)
register_bench_rl(bench_app)  # covey bench rl (covey/bench/rl_cli.py)
register_bench_serve(bench_app)  # covey bench serve (covey/bench/serve.py)
register_bench_hostsync(bench_app)  # covey bench hostsync (syncs per inner step)
register_rl(app)  # rl trainer, worker, validator, demo
register_serve(app)  # serve server, worker, validator (covey/serve/cli.py)

# the commands register as their modules load, in the order `covey --help` lists them
import covey.cli.run  # noqa: E402, I001
import covey.cli.demo  # noqa: E402
import covey.cli.peers  # noqa: E402
import covey.cli.bench  # noqa: E402
import covey.cli.database  # noqa: E402,F401
from covey.cli.halt import register as register_halt  # noqa: E402

register_halt(app)  # covey halt, in every coordinator mode

__all__ = ["app", "bench_app", "main"]


def main() -> None:
    """The entry point: an error from the input that no command turned into a message
    still ends in one line and exit code 2 (with --debug, after its traceback)."""
    try:
        app()
    except Exception as e:
        from covey.errors import user_message

        message = user_message(e)
        if message is None:
            raise
        if common.DEBUG:
            import traceback

            traceback.print_exc()
        typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
        sys.exit(2)
