"""Cross-check covey's DiLoCo against torchft's, an independent implementation.

What is compared: two replicas of the same tiny GPT (same seed, same batches) trained for
ROUNDS outer rounds of H inner AdamW steps each, once with covey's DiLoCo strategy (driven
through its round interface in one process) and once with ``torchft.local_sgd.DiLoCo``
running on a real torchft stack: a ``LighthouseServer``, one ``Manager`` per replica,
``ProcessGroupGloo`` collectives, each replica in its own thread, all on 127.0.0.1.

Why: covey's outer step, pseudo-gradient sign and averaging are re-derived in covey's own
code; agreement with torchft (Meta's fault-tolerant DiLoCo, which sets the all-reduced
pseudo-gradient as ``p.grad`` of a ``torch.optim.SGD(nesterov=True)`` outer optimizer)
checks that covey computes the published algorithm rather than a self-consistent variant.

torchft settings that make the two compute the same thing: one fragment (the whole
model), ``fragment_sync_delay=0`` (sync right after the H-th inner step, no overlap),
``fragment_update_alpha=0`` (the new global weights replace the local ones),
``should_quantize=False`` and no bucketization (a plain fp32 AVG all-reduce), and
``init_sync=False`` (both replicas start from identical seeded weights, so no checkpoint
is sent). Equal batch sizes make covey's token-weighted mean a plain mean.

Checks: per-round parameters, the outer momentum buffers and the inner losses agree to
1e-5; the parameters moved far from their initial values (so a no-op on both sides cannot
pass); and changing covey's outer learning rate breaks the agreement (so the comparison is
sensitive to the outer step).
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import pytest
import torch

pytest.importorskip(
    "torchft",
    reason="torchft (with its native extension) is needed for the DiLoCo cross-check",
)

import torch.distributed as dist
from torchft._torchft import LighthouseServer
from torchft.checkpointing.transport import CheckpointTransport
from torchft.local_sgd import DiLoCo as TorchftDiLoCo
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from covey.algorithms import TrainState, build_strategy
from covey.config import DiLoCoConfig, InnerOptim
from covey.data.batches import sample_batch
from covey.models.gpt import GPT, GPTConfig, lm_loss

# torchft 0.2.0 logs through the deprecated Logger.warn; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning")

N_REPLICAS = 2
H = 3  # inner steps per round
ROUNDS = 3
BATCH_SIZE = 4
SEQ_LEN = 16
DATA_SEED = 11
INNER_LR = 1e-3
BETAS = (0.9, 0.95)
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9

TOLERANCE = 1e-5
MIN_MOVEMENT = 1e-3  # the weights must move at least this far from init (>> TOLERANCE)
PERTURBED_OUTER_LR = 0.5
MIN_PERTURBED_DIFF = 1e-4

TORCHFT_OP_TIMEOUT = timedelta(seconds=15)  # every torchft rpc, collective and quorum
REPLICA_WAIT_S = 90.0  # for all replica threads to finish their whole runs

Params = dict[str, torch.Tensor]
T = TypeVar("T")


@dataclass
class Run:
    """One replica's (or covey's) trajectory."""

    rounds: list[Params]  # parameters after each outer step
    momentum: Params  # outer momentum buffers after the last round
    losses: list[float]  # inner losses, worker by worker, each in step order


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32))


def corpus() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (20_000,), generator=g, dtype=torch.uint8)


def batch(tokens: torch.Tensor, worker: int, rnd: int, step: int) -> torch.Tensor:
    return sample_batch(
        tokens,
        batch_size=BATCH_SIZE,
        seq_len=SEQ_LEN,
        seed=DATA_SEED,
        round=rnd,
        worker=worker,
        step=step,
    )


def snapshot(model: torch.nn.Module) -> Params:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: Params, b: Params) -> float:
    assert a.keys() == b.keys(), f"parameter names differ: {sorted(a.keys() ^ b.keys())}"
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


# -- covey --------------------------------------------------------------------------------


def run_covey(base: GPT, tokens: torch.Tensor, outer_lr: float) -> Run:
    cfg = DiLoCoConfig(
        inner_steps=H,
        outer_lr=outer_lr,
        outer_momentum=OUTER_MOMENTUM,
        nesterov=True,
        optim=InnerOptim(name="adamw", lr=INNER_LR, grad_clip=0.0, weight_decay=0.0, betas=BETAS),
    )
    workers = [build_strategy(cfg, copy.deepcopy(base), lm_loss) for _ in range(N_REPLICAS)]
    state: TrainState = workers[0].init_state()
    for w in workers:
        w.load_state(state)
    rounds: list[Params] = []
    losses: list[list[float]] = [[] for _ in workers]
    for rnd in range(ROUNDS):
        contributions = []
        for i, w in enumerate(workers):
            for step in range(H):
                losses[i].append(float(w.inner_step(batch(tokens, i, rnd, step))))
            contributions.append(w.make_contribution())
        state = workers[0].apply_round(state, contributions)
        for w in workers:
            w.adopt(state)
        rounds.append({n: t.clone() for n, t in state.params.items()})
    prefix = "momentum/"
    momentum = {k[len(prefix) :]: v for k, v in state.outer.items() if k.startswith(prefix)}
    return Run(rounds, momentum, [x for per_worker in losses for x in per_worker])


# -- torchft ------------------------------------------------------------------------------


class NoCheckpointTransport(CheckpointTransport[dict[str, object]]):
    """Replicas start identical (init_sync=False), so nothing is ever healed.

    Replacing torchft's default HTTP transport also avoids an HTTP server bound to every
    interface; if torchft ever did try to heal, the test fails loudly here.
    """

    def metadata(self) -> str:
        return "<no checkpoint transport>"

    def send_checkpoint(
        self,
        dst_ranks: list[int],
        step: int,
        state_dict: dict[str, object],
        timeout: timedelta,
    ) -> None:
        raise AssertionError(f"unexpected checkpoint send to {dst_ranks} at step {step}")

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, object]:
        raise AssertionError(f"unexpected checkpoint receive from {src_rank} at step {step}")


def torchft_replica(replica: int, lighthouse_addr: str, base: GPT, tokens: torch.Tensor) -> Run:
    """One replica group of world size 1, as a torchft training script would run it."""
    model = copy.deepcopy(base)
    inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR, betas=BETAS, weight_decay=0.0)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    store = dist.TCPStore(
        host_name="127.0.0.1",
        port=0,
        is_master=True,
        wait_for_workers=False,
        timeout=TORCHFT_OP_TIMEOUT,
    )
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TORCHFT_OP_TIMEOUT),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=N_REPLICAS,
        use_async_quorum=False,  # DiLoCo requires a synchronous quorum
        timeout=TORCHFT_OP_TIMEOUT,
        quorum_timeout=TORCHFT_OP_TIMEOUT,
        connect_timeout=TORCHFT_OP_TIMEOUT,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=f"covey_crosscheck_{replica}",
        port=0,
        hostname="127.0.0.1",
        checkpoint_transport=NoCheckpointTransport(),
        init_sync=False,
        max_retries=0,  # a failed commit raises instead of silently skipping a round
    )
    rounds: list[Params] = []
    losses: list[float] = []
    try:
        with TorchftDiLoCo(
            manager,
            [model],
            inner,
            outer,
            sync_every=H,
            pin_memory=False,
            use_bucketization=False,
            should_quantize=False,
            fragment_sync_delay=0,
            fragment_update_alpha=0.0,
        ):
            for rnd in range(ROUNDS):
                for step in range(H):
                    inner.zero_grad()
                    loss = lm_loss(model, batch(tokens, replica, rnd, step))
                    loss.backward()
                    inner.step()  # DiLoCo's post-hook syncs after the H-th step
                    losses.append(float(loss.detach()))
                # Every round must have committed, or torchft silently reverted it.
                assert manager.current_step() == rnd + 1, (
                    f"replica {replica}: round {rnd} did not commit "
                    f"(manager step {manager.current_step()})"
                )
                rounds.append(snapshot(model))
        momentum = {
            n: outer.state[p]["momentum_buffer"].detach().clone()
            for n, p in model.named_parameters()
        }
        return Run(rounds, momentum, losses)
    finally:
        manager.shutdown(wait=False)


def in_daemon_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """Run fn in a daemon thread: a hung replica can time out without blocking exit."""
    fut: Future[T] = Future()

    def target() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut


def run_torchft(base: GPT, tokens: torch.Tensor) -> list[Run]:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=N_REPLICAS)
    try:
        # address() names the machine's hostname; dial the loopback address it is bound to.
        port = urlsplit(lighthouse.address()).port
        addr = f"http://127.0.0.1:{port}"
        futures = [
            in_daemon_thread(
                lambda r=r: torchft_replica(r, addr, base, tokens), f"torchft_replica_{r}"
            )
            for r in range(N_REPLICAS)
        ]
        deadline = time.monotonic() + REPLICA_WAIT_S
        return [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futures]
    finally:
        lighthouse.shutdown()


# -- tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_and_tokens() -> tuple[GPT, torch.Tensor]:
    return tiny_gpt(), corpus()


@pytest.fixture(scope="module")
def torchft_runs(base_and_tokens: tuple[GPT, torch.Tensor]) -> Iterator[list[Run]]:
    base, tokens = base_and_tokens
    with pytest.MonkeyPatch.context() as mp:
        # Keep Gloo's pairs on loopback instead of whatever the hostname resolves to.
        if sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
            mp.setenv("GLOO_SOCKET_IFNAME", "lo")
        yield run_torchft(base, tokens)


def test_torchft_replicas_agree_with_each_other(torchft_runs: list[Run]) -> None:
    first = torchft_runs[0]
    for other in torchft_runs[1:]:
        for rnd in range(ROUNDS):
            assert max_abs_diff(first.rounds[rnd], other.rounds[rnd]) == 0.0
        # Different data per replica: identical losses would mean the batches were shared.
        assert first.losses != other.losses


def test_covey_diloco_matches_torchft(
    base_and_tokens: tuple[GPT, torch.Tensor], torchft_runs: list[Run]
) -> None:
    base, tokens = base_and_tokens
    ours = run_covey(base, tokens, OUTER_LR)
    init = snapshot(base)

    losses_ft = [x for run in torchft_runs for x in run.losses]
    assert ours.losses == pytest.approx(losses_ft, abs=TOLERANCE)

    for rnd in range(ROUNDS):
        diff = max_abs_diff(ours.rounds[rnd], torchft_runs[0].rounds[rnd])
        assert diff <= TOLERANCE, f"round {rnd}: covey vs torchft max |diff| = {diff:.3e}"
    assert max_abs_diff(ours.momentum, torchft_runs[0].momentum) <= TOLERANCE

    moved = max_abs_diff(ours.rounds[-1], init)
    assert moved >= MIN_MOVEMENT, f"weights moved only {moved:.3e}: the check would be vacuous"
    assert max_abs_diff(torchft_runs[0].rounds[-1], init) >= MIN_MOVEMENT


def test_crosscheck_detects_a_different_outer_lr(
    base_and_tokens: tuple[GPT, torch.Tensor], torchft_runs: list[Run]
) -> None:
    base, tokens = base_and_tokens
    perturbed = run_covey(base, tokens, PERTURBED_OUTER_LR)
    diff = max_abs_diff(perturbed.rounds[-1], torchft_runs[0].rounds[-1])
    assert diff > MIN_PERTURBED_DIFF, f"outer lr 0.5 vs 0.7 differ by only {diff:.3e}"
