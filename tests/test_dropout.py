"""Models with dropout re-execute exactly: every inner step draws its randomness from its
own seed, a function of (run seed, round, data key, step) (covey.models.randomness,
covey.data.batches.step_seed). A worker's round trained as covey/peer/worker_train.py
trains it re-executes bit for bit in a validator's `reexecute`, a referee's segment that
starts mid-round recomputes the worker's commitment exactly, and without the seeding the
same round disagrees. A model whose randomness the seeding cannot reproduce is refused at
run start. One process, a tiny Hugging Face GPT-2 with its default dropout (0.1)."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from covey.algorithms import Strategy, build_strategy
from covey.algorithms.state import TrainState
from covey.config import DiLoCoConfig, InnerOptim, RunConfig
from covey.data.batches import assignment_batches, step_seed
from covey.data.corpus import Corpus
from covey.models.gpt import lm_loss
from covey.models.hf import ModelSourceError, hf_lm_loss
from covey.models.randomness import active_dropout, check_reproducible, step_rng
from covey.models.source import build_model, build_run_model
from covey.peer.worker_train import Training
from covey.trust.committer import Committer
from covey.trust.referee import STABILITY_MARGIN, referee
from covey.trust.sketch import state_hash
from covey.trust.verify import compare, reexecute
from tests.conftest import tiny_gpt
from tests.tiny_hf import tiny_gpt2

STEPS, K, TOL = 6, 2, 0.02
SEQ = 16
CFG = RunConfig.model_validate({"seed": 3, "data": {"seq_len": SEQ, "batch_size": 4}})
DILOCO = DiLoCoConfig(
    inner_steps=STEPS, optim=InnerOptim(name="adamw", lr=3e-3, grad_clip=1.0), codec="fp32"
)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "model", vocab_size=320)


def strategy(directory: Path) -> Strategy:
    model, loss, _ = build_model(f"hf:{directory}", 0)
    assert model.config.resid_pdrop == model.config.attn_pdrop == 0.1  # the default
    return build_strategy(DILOCO, model, loss)


class WorkerTraining(Training):
    """The worker's training half (its `_timed_step` and `_step_seed`) over a strategy, as
    covey.peer.worker.Worker holds it."""

    def __init__(self, strategy: Strategy, corpus: Corpus) -> None:
        self.strategy, self.cfg, self.corpus, self.seq_len = strategy, CFG, corpus, SEQ
        self.opts = SimpleNamespace(slowdown=1.0)


def worker_round(s: Strategy, corpus: Corpus, start: TrainState, round_: int, key: str):
    """A round trained through the worker's own step (`Training._timed_step`): the
    commitments every K steps and the contribution."""
    w = WorkerTraining(s, corpus)
    s.begin_round(start)
    committer = Committer(s, start, K)
    for step in range(STEPS):
        w._timed_step(
            s.inner_step,
            lambda step=step: w._batch(round_, key, step),
            w._step_seed(round_, key, step),
        )
        committer.after_step(step + 1)
    return committer.commitments, s.make_contribution()


def test_step_seed_is_a_pure_function_of_the_step() -> None:
    a = step_seed(seed=3, round=1, worker="k", step=2)
    assert a == step_seed(seed=3, round=1, worker="k", step=2)
    assert 0 <= a < 2**63
    others = {step_seed(seed=3, round=1, worker="k", step=s) for s in range(50)}
    others |= {step_seed(seed=s, round=r, worker=w, step=2) for s in (3, 4) for r in (1, 2)
               for w in ("k", "j")}  # fmt: skip
    assert len(others) == 50 + 8 - 1  # (3, 1, "k", 2) is in both


def test_a_dropout_round_reexecutes_bit_exactly_and_unseeded_it_does_not(
    gpt2_dir: Path, stdlib_corpus: Corpus
) -> None:
    w = strategy(gpt2_dir)
    start = w.init_state()
    commitments, c = worker_round(w, stdlib_corpus, start, 1, "peer-a")
    batch_fn = assignment_batches(CFG, stdlib_corpus, SEQ, 1, "peer-a")

    v = strategy(gpt2_dir)
    numel = sum(p.numel() for p in start.params.values())
    mine = reexecute(v, start, batch_fn, STEPS, K)  # the validator's code path
    verdict = compare(commitments, c.payload, mine, v.codec, numel, TOL)
    assert verdict.exact and verdict.agree, verdict.detail

    # the same batches without the per-step seeds: the masks differ, and so does the round
    unseeded = reexecute(v, start, lambda s: batch_fn(s), STEPS, K)
    verdict = compare(commitments, c.payload, unseeded, v.codec, numel, TOL)
    assert not verdict.agree and verdict.segment == 0, verdict  # far past the tolerance
    assert unseeded.payload != c.payload


def test_a_segment_starting_mid_round_recomputes_the_workers_commitment(
    gpt2_dir: Path, stdlib_corpus: Corpus
) -> None:
    """Segment 1 (steps 2..3) from the validator's state at step 2, and from the referee's
    own prefix, ends at the worker's commitment 2 exactly; the nudged probe moves it by
    rounding only (not by other masks), so an honest segment is not 'unstable'."""
    w = strategy(gpt2_dir)
    start = w.init_state()
    commitments, _ = worker_round(w, stdlib_corpus, start, 2, "peer-b")
    batch_fn = assignment_batches(CFG, stdlib_corpus, SEQ, 2, "peer-b")
    v = strategy(gpt2_dir)
    mine = reexecute(v, start, batch_fn, STEPS, K, keep_states=[1])
    # the validator's state is loaded where the worker's commitment hashes it (as older
    # workers' did); an intermediate commitment carries no hash: the referee's own prefix
    hashed = dataclasses.replace(commitments[1], hash=state_hash(mine.states[1]))
    for supplied, claimed in ((mine.states[1], hashed), (None, commitments[1])):
        r = referee(
            strategy(gpt2_dir),
            start,
            1,
            supplied,
            batch_fn,
            STEPS,
            K,
            claimed_start=claimed,
            tolerance=TOL,
        )
        # the validator's state was loaded (no complaint); none supplied: nothing ignored
        assert r.detail == "", r.detail
        assert r.end.sketch == commitments[2].sketch, r.detail  # bit for bit
        assert r.stability * STABILITY_MARGIN < TOL, r.stability
    # without the seeds the referee's segment ends elsewhere
    r = referee(
        strategy(gpt2_dir),
        start,
        1,
        mine.states[1],
        lambda s: batch_fn(s),
        STEPS,
        K,
        claimed_start=commitments[1],
        probe=False,
    )
    assert r.end.sketch != commitments[2].sketch


def test_seeding_does_not_change_a_model_without_randomness(tokens: torch.Tensor) -> None:
    """A deterministic model draws nothing: a seeded step is the unseeded step, bit for
    bit, and the caller's generator is where it was."""
    batch = tokens[: 4 * 17].long().view(4, 17)
    results = []
    torch.manual_seed(7)
    untouched = torch.rand(3)
    for seed in (None, 12345):
        s = build_strategy(DILOCO, tiny_gpt(), lm_loss)
        s.begin_round(s.init_state())
        torch.manual_seed(7)
        with step_rng(s.device, seed):
            s.inner_step(batch)
        assert torch.equal(torch.rand(3), untouched)
        results.append([p.detach().clone() for p in s.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_step_rng_restores_the_global_generator() -> None:
    torch.manual_seed(1)
    want = torch.rand(4)
    torch.manual_seed(1)
    with step_rng(torch.device("cpu"), 99):
        inside = torch.rand(4)
    assert torch.equal(torch.rand(4), want)
    with step_rng(torch.device("cpu"), 99):
        assert torch.equal(torch.rand(4), inside)


def test_a_forward_random_outside_the_global_generator_is_refused(gpt2_dir: Path) -> None:
    """A loss with a generator of its own (what a py: factory might return) cannot be
    reproduced by seeding: refused in one line naming the config's dropout fields."""
    model, _, info = build_model(f"hf:{gpt2_dir}", 0)
    own = torch.Generator().manual_seed(0)

    def noisy_loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return hf_lm_loss(m, b) + 1e-3 * torch.rand((), generator=own)

    with pytest.raises(ModelSourceError) as e:
        check_reproducible(model, noisy_loss, seq_len=SEQ, vocab_size=320, source=info.source)
    message = str(e.value)
    assert "\n" not in message
    for field in ("resid_pdrop=0.1", "embd_pdrop=0.1", "attn_pdrop=0.1"):
        assert field in message, message
    assert "train mode" in message and "re-execute" in message
    # the plain model, dropout and all, is reproducible: accepted, its mode left alone
    model.eval()
    check_reproducible(model, hf_lm_loss, seq_len=SEQ, vocab_size=320, source=info.source)
    assert not model.training


def test_a_py_factory_with_its_own_generator_is_refused_at_run_start() -> None:
    spec = SimpleNamespace(spec="py:tests.test_dropout:own_generator_model", init=None)
    with pytest.raises(ModelSourceError, match="randomness in its forward pass"):
        build_run_model(spec, 0, tokenizer_vocab=256, seq_len=SEQ)
    spec = SimpleNamespace(spec="py:tests.test_dropout:global_dropout_model", init=None)
    build_run_model(spec, 0, tokenizer_vocab=256, seq_len=SEQ)  # nn.Dropout: accepted


class _OwnNoise(torch.nn.Module):
    """A GPT whose forward adds noise from a generator it made itself."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny_gpt()
        self.noise = torch.Generator().manual_seed(0)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(self.gpt, batch)
        if self.training:
            loss = loss + 1e-3 * torch.rand((), generator=self.noise)
        return loss


def own_generator_model() -> tuple[torch.nn.Module, object]:
    return _OwnNoise(), lambda m, b: m(b)


def global_dropout_model() -> tuple[torch.nn.Module, object]:
    model = torch.nn.Sequential(torch.nn.Embedding(256, 16), torch.nn.Dropout(0.5))
    head = torch.nn.Linear(16, 256)
    model.append(head)

    def loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        logits = m(b[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), b[:, 1:].reshape(-1))

    return model, loss


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.long  # processes importing torch and transformers on busy cores: about a minute
def test_demo_with_a_dropout_gpt2_verifies_without_disputes(tmp_path: Path) -> None:
    """`covey demo` (a coordinator, two workers and a validator as processes) on a tiny HF
    GPT-2 with its default dropout: every sampled contribution the validator re-executes
    agrees, and nobody disputes or is banned."""
    from covey.local.demo import run_local_demo

    model = tiny_gpt2(tmp_path / "gpt2", vocab_size=320)
    s = run_local_demo(
        workers=2, minutes=3.0, rounds=4, out_dir=tmp_path / "run", model=f"hf:{model}",
        progress=False, overrides={"trust": {"sample_rate": 1.0}},
    )  # fmt: skip
    trust = s["trust"]
    assert s["rounds_committed"] >= 4
    assert trust["disputes"] == 0 and not trust["banned"], trust
    assert trust["agreed"] > 0, trust


def test_a_torchrun_group_refuses_a_model_with_dropout(gpt2_dir: Path) -> None:
    """A group's ranks each draw masks for their own rows: not reproducible, refused
    before any collective; without dropout the check lets it through."""
    from covey.peer.group import Group, attach

    s = strategy(gpt2_dir)
    with pytest.raises(ValueError, match=r"dropout .*resid_pdrop, embd_pdrop, attn_pdrop"):
        attach(s, Group(0, 2, torch.device("cpu")))
    assert "transformer.drop" in active_dropout(s.model)
    plain = build_strategy(DILOCO, tiny_gpt(), lm_loss)
    assert active_dropout(plain.model) == []


@pytest.mark.parametrize(
    "device",
    [
        torch.device("meta"),
        pytest.param(
            torch.device("cuda"),
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ),
    ],
)
def test_a_seeded_inner_step_makes_no_host_sync(device: torch.device) -> None:
    """The step's seed is host-side integer math and the generators' state lives on the
    host: seeding adds no device-to-host synchronization to an inner step."""
    from covey.bench.hostsync import no_host_sync, run_inner_steps

    pool = torch.randint(0, 256, (4, 2, 17), generator=torch.Generator().manual_seed(0))
    seeds = iter(step_seed(seed=0, round=0, worker="k", step=s) for s in range(100))

    @contextlib.contextmanager
    def seeded() -> Iterator[None]:
        with no_host_sync(device), step_rng(device, next(seeds)):
            yield

    assert run_inner_steps("diloco", tiny_gpt(), lambda i: pool[i % 4], 2, seeded, device) >= 2


def test_the_coordinator_refuses_such_a_model_at_start_in_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(
        '[model]\nsource = "py:tests.test_dropout:own_generator_model"\n'
        "[data]\nseq_len = 16\nbatch_size = 2\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "covey.cli", "coordinator", str(spec), "--port", "0",
         "--data-dir", str(tmp_path / "coordinator")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "randomness in its forward pass" in lines[0] and "Traceback" not in r.stderr
