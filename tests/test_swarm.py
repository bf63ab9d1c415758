"""The pure core of SWARM pipeline training (covey/swarm): plan, stages, codecs, routing,
rebalancing and a convergence check, all in one process, no sockets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from covey.models.gpt import GPT, GPTConfig
from covey.swarm.plan import block_param_costs, plan_stages, stage_modules


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny matrices: extra torch threads only contend for the machine's 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SMALL = GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32)


def small_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(SMALL)


def tiny_hf(kind: str) -> nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    else:
        cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.config.use_cache = False
    return model.eval()


def run_stages(stages: list[nn.Module], idx: torch.Tensor) -> torch.Tensor:
    x = idx
    for s in stages:
        x = s(x)
    return x


# ---- plan -------------------------------------------------------------------------------


def test_plan_balances_costs_contiguously() -> None:
    assert plan_stages([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert plan_stages([4, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4]]
    # Embedding and head costs land on the first and last stage.
    assert plan_stages([1, 1, 1, 1, 1, 1], 3, embed_cost=3, head_cost=3) == [[0], [1, 2, 3, 4], [5]]
    assert plan_stages([3, 3, 3], 3) == [[0], [1], [2]]
    plan = plan_stages([5, 1, 7, 2, 2, 9, 1, 1], 3)
    assert [i for s in plan for i in s] == list(range(8))
    assert max(sum([5, 1, 7, 2, 2, 9, 1, 1][i] for i in s) for s in plan) == 11


def test_plan_errors_name_values() -> None:
    with pytest.raises(
        ValueError, match=r"Number of stages \(5\) cannot be greater than blocks \(4\)"
    ):
        plan_stages([1, 1, 1, 1], 5)
    with pytest.raises(ValueError, match=r"Number of stages \(0\)"):
        plan_stages([1], 0)
    with pytest.raises(ValueError, match="-1"):
        plan_stages([1, -1], 2)
    with pytest.raises(ValueError, match="must cut blocks"):
        stage_modules(small_gpt(), [[0, 2], [1, 3]])


@torch.no_grad()
def test_gpt_stages_in_sequence_equal_the_whole_model() -> None:
    model = small_gpt().eval()
    plan = plan_stages(block_param_costs(model), 3)
    assert len(plan) == 3
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(
        run_stages(stage_modules(model, plan), idx), model(idx), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@torch.no_grad()
def test_hf_stages_in_sequence_equal_the_whole_model(kind: str) -> None:
    model = tiny_hf(kind)
    plan = plan_stages(block_param_costs(model), 3)
    idx = torch.randint(0, 64, (2, 12))
    whole = model(input_ids=idx, use_cache=False).logits
    torch.testing.assert_close(
        run_stages(stage_modules(model, plan), idx), whole, atol=1e-6, rtol=0
    )


# ---- stage ------------------------------------------------------------------------------


def test_stage_backward_recomputes_and_matches_whole_model_grads() -> None:
    from covey.models.gpt import lm_loss
    from covey.swarm.stage import Stage

    model = small_gpt()
    batch = torch.randint(0, 64, (3, 17))
    lm_loss(model, batch).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    modules = stage_modules(model, plan_stages(block_param_costs(model), 3))
    stages = [
        Stage(m, lambda ps: torch.optim.SGD(ps, lr=0.1), last=k == 2) for k, m in enumerate(modules)
    ]
    # Forward chain (no autograd state kept), then backward chain in reverse, each stage
    # recomputing from the input it is handed.
    acts = [batch[:, :-1]]
    for s in stages[:-1]:
        acts.append(s.forward(acts[-1]))
    assert not acts[-1].requires_grad
    loss, g = stages[-1].backward_loss(acts[-1], batch[:, 1:])
    for k in (1, 0):
        g = stages[k].backward(acts[k], g)
    assert g is None  # stage 0 takes token ids
    assert loss == pytest.approx(float(lm_loss(model, batch).detach()), rel=1e-6)
    # The tied wte/lm_head Parameter is shared by stages 0 and 2 here, so its grad sums both
    # uses, as loss.backward() does on the whole model. Grads are sample-weighted sums.
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad / 3, want[n], atol=1e-6, rtol=1e-5, msg=n)
    before = [p.detach().clone() for p in stages[1].params]
    assert stages[1].target_samples == 1 and stages[1].maybe_step()
    assert all(not torch.equal(a, p) for a, p in zip(before, stages[1].params, strict=True))
    assert all(p.grad is None for p in stages[1].params) and stages[1].samples == 0
    with pytest.raises(ValueError, match="no accumulated"):
        stages[1].step()
    with pytest.raises(ValueError, match="grad_outputs shape"):
        stages[1].backward(acts[1], torch.zeros(1, 2, 3))
    gpt2 = tiny_hf("gpt2").train()  # HF GPT-2 defaults to dropout 0.1
    with pytest.raises(ValueError, match=r"Dropout\(p=0.1\)"):
        Stage(stage_modules(gpt2, [[0, 1, 2, 3]])[0], torch.optim.SGD)


# ---- codecs -----------------------------------------------------------------------------


@pytest.mark.parametrize("block", [64, 256])
def test_int8_codec_round_trip_error_and_exact_size(block: int) -> None:
    from covey.swarm.codecs import decode_int8, encode_int8, int8_nbytes

    x = torch.randn(3, 7, 33) * torch.logspace(-3, 2, 33)  # scales vary across columns
    data = encode_int8(x, block)
    assert len(data) == int8_nbytes(x.shape, block) == 8 + 12 + 4 * -(-693 // block) + 693
    y = decode_int8(data)
    assert y.shape == x.shape and y.dtype == torch.float32
    # Error within half a step of each block's scale.
    flat, blocks = x.reshape(-1), -(-x.numel() // block)
    pad = torch.zeros(blocks * block)
    pad[: x.numel()] = flat
    step = pad.view(blocks, block).abs().amax(1) / 127
    bound = step.repeat_interleave(block)[: x.numel()] / 2 + 1e-7
    assert bool(((y.reshape(-1) - flat).abs() <= bound).all())
    assert torch.equal(decode_int8(encode_int8(torch.zeros(5), block)), torch.zeros(5))


def test_int8_codec_rejects_malformed_input() -> None:
    from covey.swarm.codecs import CodecError, decode_int8, encode_int8

    good = encode_int8(torch.randn(4, 10))
    bad = {
        "shorter than": good[:5],
        "magic": b"XXXX" + good[4:],
        "block size 65": good[:6] + (65).to_bytes(2, "little") + good[8:],
        "needs": good[:-1],
        "max_numel": None,
        "finite": good[:16] + b"\x00\x00\xc0\x7f" + good[20:],  # nan scale
        "-128": good[:-1] + b"\x80",
    }
    for match, data in bad.items():
        with pytest.raises(CodecError, match=match):
            if data is None:
                decode_int8(good, max_numel=39)
            else:
                decode_int8(data)
    with pytest.raises(ValueError, match="inf or nan"):
        encode_int8(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="block size 100"):
        encode_int8(torch.randn(3), 100)


def test_subspace_codec_is_exact_on_its_subspace_and_reports_bytes() -> None:
    from covey.swarm.codecs import SubspaceCodec, bytes_per_token

    codec = SubspaceCodec(32, 8, seed=7)
    u = codec.basis
    torch.testing.assert_close(u.T @ u, torch.eye(8), atol=1e-6, rtol=0)
    assert torch.equal(SubspaceCodec(32, 8, seed=7).basis, u)  # every peer rebuilds it
    assert not torch.equal(SubspaceCodec(32, 8, seed=8).basis, u)
    e_tok, h = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    p = codec.project(h, e_tok)
    c = codec.encode(p, e_tok)
    assert c.shape == (2, 5, 8)
    torch.testing.assert_close(codec.decode(c, e_tok), p, atol=1e-5, rtol=0)
    torch.testing.assert_close(codec.project(p, e_tok), p, atol=1e-5, rtol=0)  # idempotent
    with pytest.raises(ValueError, match="rank"):
        SubspaceCodec(4, 5)
    b = bytes_per_token(768, 64, 64)
    assert b == {"fp32": 3072.0, "int8": 816.0, "subspace": 256.0, "subspace_int8": 68.0}


# ---- routing and rebalancing ----------------------------------------------------------


def test_router_prefers_least_expected_finish_and_probes_new_servers() -> None:
    from covey.swarm.routing import NoServerError, Router

    r = Router(ema=0.5, probe_rate=0.0, seed=1)
    for name, stage in (("a", 0), ("b", 0), ("c", 1)):
        r.add_server(name, stage)
    assert r.choose(0, now=0.0) in {"a", "b"}  # nothing measured: probe
    r.started("a")
    r.finished("a", samples=8, seconds=1.0)  # a: 8/s
    r.started("b")
    r.finished("b", samples=8, seconds=2.0)  # b: 4/s
    assert r.choose(0, 0.0) == "a"
    for _ in range(2):
        r.started("a")  # a's queue of 2: finish 3/8 s, b's 1/4 s
    assert r.expected_finish("a") == pytest.approx(3 / 8)
    assert r.choose(0, 0.0) == "b"
    r.finished("a", 8, 1.0)
    r.finished("a", 16, 1.0)  # EMA: 0.5 * 8 + 0.5 * 16
    assert r.servers["a"].throughput == pytest.approx(12.0)
    # A new server is probed at about probe_rate, with a seeded generator.
    r2 = Router(probe_rate=0.2, seed=3)
    r2.add_server("old", 0)
    r2.started("old")
    r2.finished("old", 10, 1.0)
    r2.add_server("new", 0)
    picks = [r2.choose(0, 0.0) for _ in range(1000)]
    assert 150 < picks.count("new") < 250
    r3 = Router(probe_rate=0.2, seed=3, servers=r2.servers)
    assert [r3.choose(0, 0.0) for _ in range(1000)] == picks  # seeded: runs replay
    with pytest.raises(NoServerError, match="stage 5"):
        r.choose(5, 0.0)


def test_router_timeout_reroutes_and_invalid_reply_bans() -> None:
    from covey.swarm.routing import NoServerError, Router

    r = Router(probe_rate=0.0, slow_s=10.0)
    for name in ("fast", "slow"):
        r.add_server(name, 0)
        r.started(name)
    r.finished("fast", 10, 1.0)
    r.finished("slow", 5, 1.0)
    assert r.choose(0, now=0.0) == "fast"
    r.started("fast")
    r.timed_out("fast", now=100.0)
    assert r.reroutes == 1 and r.servers["fast"].throughput == 5.0
    assert r.choose(0, now=101.0) == "slow"  # fast is marked slow until 110
    assert r.choose(0, now=111.0) == "fast"  # ties on expected finish broken by name
    r.invalid("slow", "non-finite activations")
    r.timed_out("fast", now=200.0)
    assert r.choose(0, now=201.0) == "fast"  # every server slow: still better than none
    assert r.banned() == {"slow": "non-finite activations"}
    r.invalid("fast", "bad shape")
    with pytest.raises(NoServerError, match="stage 0"):
        r.choose(0, now=300.0)


def test_rebalance_moves_a_server_to_the_bottleneck_only_past_hysteresis() -> None:
    from covey.swarm.rebalance import plan_move, stage_throughputs

    costs = [1.0, 1.0, 1.0]
    servers = {"a": (0, 1.0), "b": (0, 1.0), "c": (0, 1.0), "d": (1, 1.0), "e": (2, 1.0)}
    # Stages 1 and 2 are both at the minimum: moving one server raises neither alone.
    assert stage_throughputs(costs, servers) == [3.0, 1.0, 1.0]
    assert plan_move(costs, servers, hysteresis=1.1) is None
    servers = {"a": (0, 1.0), "b": (0, 1.0), "c": (0, 1.0), "d": (1, 1.0), "e": (2, 2.0)}
    move = plan_move(costs, servers, hysteresis=1.1)
    assert move is not None and (move.server, move.from_stage, move.to_stage) == ("a", 0, 1)
    assert (move.min_before, move.min_after) == (1.0, 2.0)
    # A marginal gain (min 1.0 -> 1.05) does not pay for a move under hysteresis 1.2.
    load = {"a": (0, 2.0), "b": (0, 0.1), "c": (1, 1.0), "d": (2, 1.05)}
    assert plan_move(costs, load, hysteresis=1.2) is None
    small = plan_move(costs, load, hysteresis=1.01)
    assert small is not None and small.server == "b" and small.min_after == pytest.approx(1.05)
    with pytest.raises(ValueError, match=r"hysteresis \(1.0\)"):
        plan_move(costs, servers, hysteresis=1.0)


def test_rebalance_repeated_calls_on_a_fixed_load_do_not_oscillate() -> None:
    import random

    from covey.swarm.rebalance import plan_move, stage_throughputs

    rng = random.Random(0)
    for _ in range(300):
        n_stages = rng.randint(2, 5)
        costs = [rng.uniform(0.5, 3.0) for _ in range(n_stages)]
        servers = {
            f"s{i}": (rng.randrange(n_stages), rng.choice([1.0, 2.0, 4.0]) * rng.uniform(0.9, 1.1))
            for i in range(rng.randint(n_stages, 12))
        }
        seen = {tuple(sorted(servers.items()))}
        low = min(stage_throughputs(costs, servers))
        for _moves in range(100):
            move = plan_move(costs, servers, hysteresis=1.05)
            if move is None:
                break
            servers = {**servers, move.server: (move.to_stage, servers[move.server][1])}
            state = tuple(sorted(servers.items()))
            assert state not in seen  # never back to an earlier assignment
            seen.add(state)
            new_low = min(stage_throughputs(costs, servers))
            assert new_low == pytest.approx(move.min_after) and new_low > 1.05 * low
            low = new_low
        else:
            pytest.fail(f"no fixed point after 100 moves: {servers}")
        assert plan_move(costs, servers, hysteresis=1.05) is None  # stable once settled


# ---- convergence ------------------------------------------------------------------------


def _markov_batches(n: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    """Token rows from a fixed sparse Markov chain on 64 symbols: learnable, not trivial."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, 64, (64, 3), generator=g)
    out = []
    for _ in range(n):
        rows = torch.empty(batch, seq, dtype=torch.int64)
        rows[:, 0] = torch.randint(0, 64, (batch,), generator=g)
        for t in range(1, seq):
            pick = torch.randint(0, 3, (batch,), generator=g)
            rows[:, t] = nxt[rows[:, t - 1], pick]
        out.append(rows)
    return out


def _held_out_loss(modules: list[nn.Module], held_out: list[torch.Tensor]) -> float:
    with torch.no_grad():
        total = 0.0
        for b in held_out:
            x = b[:, :-1]
            for m in modules:
                x = m(x)
            total += float(nn.functional.cross_entropy(x.reshape(-1, 64), b[:, 1:].reshape(-1)))
    return total / len(held_out)


def _train_stages(
    modules: list[nn.Module], batches: list[torch.Tensor], lr: float
) -> tuple[list[float], int]:
    from covey.swarm.pipeline import int8_wire, train_microbatch
    from covey.swarm.stage import Stage

    stages = [
        Stage(m, lambda ps: torch.optim.AdamW(ps, lr=lr), target_samples=8, last=k == 2)
        for k, m in enumerate(modules)
    ]
    wire = int8_wire(64)
    losses = []
    for b in batches:
        losses.append(train_microbatch(stages, b, wire))
        assert all(s.maybe_step() for s in stages[1:])
        stages[0].maybe_step()
    return losses, wire.bytes_sent


def test_int8_pipeline_converges_like_one_process() -> None:
    """Same model, same batches: 3 stages with 8-bit activations and gradients between them
    reach a held-out loss within 2% of training in one process, (a) in-process stages
    sharing GPT's tied wte/lm_head Parameter vs the whole GPT, and (b) each stage its own
    copy (as on real servers: the tie is untied) vs those same copies trained as one
    module with one optimizer."""
    import copy

    from covey.models.gpt import lm_loss

    steps, lr = 30, 3e-3
    data = _markov_batches(steps + 4, 8, 17)
    batches, held_out = data[:steps], data[steps:]
    base = small_gpt()
    plan = plan_stages([1.0] * 4, 3)

    whole = copy.deepcopy(base)
    opt = torch.optim.AdamW(whole.parameters(), lr=lr)
    for b in batches:
        opt.zero_grad(set_to_none=True)
        lm_loss(whole, b).backward()
        opt.step()
    shared = stage_modules(copy.deepcopy(base), plan)
    losses, sent = _train_stages(shared, batches, lr)
    want, got = _held_out_loss([whole], held_out), _held_out_loss(shared, held_out)
    assert losses[-1] < 0.8 * losses[0]  # it learned
    assert abs(got - want) / want < 0.02, (got, want)
    # 2 boundaries x (forward + backward) x 8 x 16 x 32 values, 8-bit plus scales.
    assert sent == steps * 4 * (8 + 12 + 4 * 64 + 4096)

    untied = [copy.deepcopy(m) for m in stage_modules(copy.deepcopy(base), plan)]
    one = nn.Sequential(*copy.deepcopy(untied))
    opt = torch.optim.AdamW(one.parameters(), lr=lr)
    for b in batches:
        opt.zero_grad(set_to_none=True)
        x = one(b[:, :-1])
        nn.functional.cross_entropy(x.reshape(-1, 64), b[:, 1:].reshape(-1)).backward()
        opt.step()
    _train_stages(untied, batches, lr)
    want, got = _held_out_loss([one], held_out), _held_out_loss(untied, held_out)
    assert abs(got - want) / want < 0.02, (got, want)


# ---- the network layer's pure parts: averaging rounds, wire, adversaries ----------------


def test_averaging_round_commits_all_or_nothing_and_drops_the_silent() -> None:
    from covey.swarm.averaging import Averaging

    avg = Averaging(n_stages=1, target_samples=8, round_timeout_s=10.0)
    for p in ("a", "b"):
        avg.state(p, 0, 0, "s0")
    avg.tick({"a": (0, 0, 4), "b": (0, 0, 3)}, set(), now=0.0)
    assert avg.stages[0].round is None  # 7 < 8 samples pending
    avg.tick({"a": (0, 0, 4), "b": (0, 0, 4)}, set(), now=1.0)
    r = avg.stages[0].round
    assert r is not None and r.members == ["a", "b"]
    assert avg.report("a", 0, r.id, "ga", 4, "u") == "ok"
    assert "not a member" in avg.report("c", 0, r.id, "gc", 4, "u")
    avg.tick({"a": (0, 0, 0), "b": (0, 0, 4)}, set(), now=5.0)
    assert avg.stages[0].round is r  # waits for b until the deadline
    avg.tick({"a": (0, 0, 0), "b": (0, 0, 4)}, set(), now=12.0)
    book = avg.stages[0]
    assert book.round is None and book.step == 1 and book.samples == 4
    assert r.status == "committed" and list(r.reports) == ["a"]
    # a applies the round; b, who missed it, catches up by applying it too (its own sum
    # waits for the next round); were its state then another, it would resync
    assert avg.directive("a", 0, 0, "s0")["apply"]["reports"]["a"]["cid"] == "ga"
    avg.state("a", 0, 1, "s1")
    assert avg.directive("b", 0, 0, "s0")["apply"]["reports"] == {"a": r.reports["a"]}
    assert avg.directive("b", 0, 1, "other")["resync"] == "s1"
    assert "apply" not in avg.directive("a", 0, 1, "s1")
    # a round without any sample by its deadline aborts: nothing is accepted
    avg.state("b", 0, 1, "s1")
    avg.tick({"a": (0, 1, 8), "b": (0, 1, 0)}, set(), now=13.0)
    r2 = avg.stages[0].round
    assert r2 is not None
    avg.report("a", 0, r2.id, "g", 0, "u")
    avg.tick({"a": (0, 1, 0), "b": (0, 1, 0)}, set(), now=30.0)
    assert r2.status == "aborted" and avg.stages[0].step == 1


def test_averaging_agreed_state_is_the_majority_and_a_divergent_server_resyncs() -> None:
    from covey.swarm.averaging import Averaging

    avg = Averaging(n_stages=2, target_samples=1, round_timeout_s=1.0)
    for p, cid in (("a", "x"), ("b", "x"), ("c", "y")):
        avg.state(p, 1, 0, cid)
    # before the first round nobody votes: every server builds the seeded weights
    assert avg.stages[1].agreed is None and "resync" not in avg.directive("c", 1, 0, "y")
    live = {p: (1, 0, 1) for p in "abc"}
    avg.tick(live, set(), 0.0)
    r = avg.stages[1].round
    assert r is not None
    for p in "abc":
        avg.report(p, 1, r.id, f"sum-{p}", 1, "u", 1.0)
    avg.tick(live, set(), 0.5)  # every member reported: committed
    for p, cid in (("a", "x"), ("b", "x"), ("c", "y"), ("newcomer", "y")):
        avg.state(p, 1, 1, cid)
    assert avg.stages[1].agreed == "x"  # two of the three voters; the newcomer is none
    assert avg.directive("c", 1, 1, "y")["resync"] == "x"
    assert "resync" not in avg.directive("a", 1, 1, "x")
    with pytest.raises(ValueError, match=r"stage 2; stages are 0..1"):
        avg.directive("a", 2, 0, "x")


def test_wire_round_trips_and_refuses_malformed_bytes() -> None:
    from covey.swarm.wire import WireError, decode_tensor, encode_tensor, pack, unpack

    ids = torch.randint(0, 256, (3, 5))
    assert torch.equal(decode_tensor(encode_tensor(ids, "int8")), ids)
    x = torch.randn(2, 3, 4)
    assert torch.equal(decode_tensor(encode_tensor(x, "plain")), x)
    assert torch.allclose(decode_tensor(encode_tensor(x, "int8")), x, atol=0.05)
    assert unpack(pack(b"ab", b"", b"c"), 3) == [b"ab", b"", b"c"]
    for bad in (b"", b"CVID" + b"\x01" * 8, b"junk" * 10, encode_tensor(ids, "")[:-1]):
        with pytest.raises(WireError):
            decode_tensor(bad)
    with pytest.raises(WireError, match="pack 2"):
        unpack(pack(b"a"), 2)
    with pytest.raises(WireError, match="do not add up"):
        unpack(pack(b"a", b"b") + b"x", 2)


def test_stage_state_bytes_round_trip_exactly_and_adamw_matches_torch() -> None:
    from covey.swarm.config import SwarmConfig
    from covey.swarm.optim import AdamW
    from covey.swarm.wire import build_stage, load_state, state_bytes

    cfg = SwarmConfig(n_layer=2, n_embd=16, n_head=2, seq_len=8, stages=2)
    a = build_stage(cfg, 1)
    x = torch.randn(2, 8, 16)
    a.backward_loss(x, torch.randint(0, 256, (2, 8)))
    a.step()
    data = state_bytes(a)
    b = build_stage(cfg, 1)
    assert state_bytes(b) != data
    load_state(b, data)
    assert state_bytes(b) == data and b.steps == 1
    p = nn.Parameter(torch.randn(4, 3))
    q = nn.Parameter(p.detach().clone())
    mine, theirs = AdamW([p], lr=0.01), torch.optim.AdamW([q], lr=0.01)
    for _ in range(5):
        g = torch.randn(4, 3)
        p.grad, q.grad = g.clone(), g.clone()
        mine.step()
        theirs.step()
    assert torch.equal(p, q)


@pytest.mark.parametrize("behavior", ["wrong", "noise", "zero"])
def test_adversarial_replies_are_beyond_tolerance_and_honest_ones_within(behavior: str) -> None:
    from covey.swarm import compute
    from covey.swarm.config import SwarmConfig
    from covey.swarm.server import misbehave
    from covey.swarm.wire import build_stage, encode_tensor, pack

    cfg = SwarmConfig(n_layer=2, n_embd=16, n_head=2, seq_len=8, stages=2)
    ids = torch.randint(0, 256, (2, 8))
    s0, s1 = build_stage(cfg, 0), build_stage(cfg, 1)
    fwd = pack(encode_tensor(ids, "int8"))
    honest = compute.forward(cfg, 0, s0, fwd)
    assert compute.reply_distance(compute.forward(cfg, 0, s0, fwd), honest) == 0.0
    out, _ = compute.parse_reply(honest)
    assert out is not None
    bwd = pack(encode_tensor(out, "int8"), encode_tensor(ids, ""))
    honest_b = compute.backward(cfg, 1, s1, bwd)
    replies = [("forward", honest), ("backward", honest_b)]
    far = [
        compute.reply_distance(misbehave(behavior, kind, r, "int8"), r) > cfg.tolerance
        for kind, r in replies
    ]
    assert far == ([True, True] if behavior != "zero" else [False, True])


# ---- the swarm coordinator in-process (FastAPI TestClient: signed requests, no sockets) --


def _swarm_client(tmp_path, **settings):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from covey.swarm.app import create_app
    from covey.swarm.config import SwarmConfig
    from covey.swarm.service import SwarmCoordinator

    cfg = SwarmConfig(n_layer=2, n_embd=16, n_head=2, seq_len=8, stages=2, **settings)
    coord = SwarmCoordinator(cfg, tmp_path / "run")
    return coord, TestClient(create_app(coord))


def _post(client, identity, path: str, body: dict):  # type: ignore[no-untyped-def]
    return client.post(path, json=identity.sign_request(body, -1, purpose=f"POST {path}"))


def test_swarm_coordinator_assigns_rebalances_pays_and_refuses_bad_requests(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from covey.trust.identity import Identity

    coord, client = _swarm_client(tmp_path, hysteresis=1.1, payout_s=1.0)
    run = coord.run_id
    ids = [Identity.generate() for _ in range(4)]

    def join(i: int, role: str = "server", **extra):  # type: ignore[no-untyped-def]
        body = {"run_id": run, "peer_id": ids[i].peer_id, "public_key": ids[i].public_key,
                "name": f"p{i}", "role": role, "stake": 0.0, "url": "http://127.0.0.1:9",
                "blob_url": "http://127.0.0.1:9", **extra}  # fmt: skip
        return _post(client, ids[i], "/v1/swarm/join", body)

    # fewest servers first: 0 -> stage 0, 1 -> stage 1, 2 -> stage 0 (tie: least throughput)
    assert [join(i).json()["stage"] for i in range(3)] == [0, 1, 0]
    assert join(3, "oracle").status_code == 422  # no such role (covey.protocol.swarm)
    body = {"run_id": run, "peer_id": ids[3].peer_id, "public_key": ids[3].public_key,
            "name": "x", "role": "server", "url": "http://127.0.0.1:9",
            "blob_url": "http://127.0.0.1:9"}  # fmt: skip
    forged = ids[3].sign_request(body, -1, purpose="POST /v1/swarm/heartbeat")
    assert client.post("/v1/swarm/join", json=forged).status_code == 401  # signed for another path

    def beat(i: int, stage: int, claim: float = 1000.0) -> dict:
        """A heartbeat; every server claims to be fast: claims steer nothing."""
        body = {"run_id": run, "peer_id": ids[i].peer_id, "stage": stage, "step": 0,
                "state": "0" * 64 if stage == 0 else "1" * 64, "pending": 0, "throughput": claim,
                "queue": 0}  # fmt: skip
        r = _post(client, ids[i], "/v1/swarm/heartbeat", body)
        assert r.status_code == 200, r.text
        return r.json()

    join(3, "trainer")

    def measure(tps: dict[int, float]) -> None:
        """The trainer's router measured these servers (samples/s)."""
        body = {"run_id": run, "peer_id": ids[3].peer_id, "samples": 0, "loss": None,
                "reroutes": 0, "banned": {}, "served": {},
                "measured": {ids[i].peer_id: tp for i, tp in tps.items()}}  # fmt: skip
        assert _post(client, ids[3], "/v1/swarm/report", body).status_code == 200

    # stage 0 costs two requests per microbatch: 2 servers at 10/s give it 10 samples/s,
    # stage 1's one server at 2/s gives 2: moving one server to stage 1 gives min 5 > 1.1 x 2
    beat(0, 0), beat(1, 1), beat(2, 0)
    coord._rebalance(now=0.0)
    assert coord.rebalances == []  # nobody measured by a trainer: no move on claims alone
    measure({0: 10.0, 1: 2.0, 2: 10.0})
    coord._rebalance(now=0.0)
    assert len(coord.rebalances) == 1 and coord.rebalances[0]["to"] == 1
    moved = next(i for i in (0, 2) if coord.servers[ids[i].peer_id].stage == 1)
    assert beat(moved, 0)["stage"] == 1  # told to move
    beat(moved, 1)
    measure({moved: 10.0})  # measured afresh on its new stage
    coord._rebalance(now=1.0)
    # stage 0 (one server at 10/s) now gives 5, stage 1 12: the 2/s server on stage 0
    # makes it 6 > 1.1 x 5; then stage 1 keeps one server, so no donor is left
    assert len(coord.rebalances) == 2 and coord.rebalances[1]["to"] == 0
    beat(1, 0)
    measure({1: 2.0})
    coord._rebalance(now=1.5)
    assert len(coord.rebalances) == 2  # settled
    for lie in (-1.0, 1e9, True, "fast"):  # measurements are checked too
        bad = {"run_id": run, "peer_id": ids[3].peer_id, "samples": 0, "loss": None,
               "reroutes": 0, "banned": {}, "served": {},
               "measured": {ids[0].peer_id: lie}}  # fmt: skip
        assert _post(client, ids[3], "/v1/swarm/report", bad).status_code == 422, lie

    # a trainer reports served microbatches (shown on the status page, never paid)
    report = {"run_id": run, "peer_id": ids[3].peer_id, "samples": 8, "loss": 3.0,
              "reroutes": 1, "banned": {}, "served": {ids[0].peer_id: 2}}  # fmt: skip
    # what a dishonest reporter would send: a server paying itself, counts that lie, and
    # ids that are not servers of this run; each refused or unpaid, nothing else changes
    own = {**report, "peer_id": ids[0].peer_id, "served": {ids[0].peer_id: 10_000}}
    assert _post(client, ids[0], "/v1/swarm/report", own).status_code == 403  # no trainer
    own = {**own, "served": {ids[0].peer_id: 10**6}}  # past what one report may claim
    assert _post(client, ids[0], "/v1/swarm/report", own).status_code == 422
    for lie in (-5, 10**9, 2.5, True, "7"):
        bad = {**report, "served": {ids[0].peer_id: lie}}
        assert _post(client, ids[3], "/v1/swarm/report", bad).status_code == 422, lie
    ghost = {**report, "served": {"f" * 32: 10}}
    assert _post(client, ids[3], "/v1/swarm/report", ghost).status_code == 200
    assert coord.unpaid == {}
    assert _post(client, ids[3], "/v1/swarm/report", report).status_code == 200
    coord.pay(now=2.0)  # a trainer's word pays nothing: checks do (tests/test_swarm_pay.py)
    assert coord.accounts.book.accounts[ids[0].peer_id].balance == 0
    status = client.get("/v1/swarm/status").json()
    assert status["rebalances"] == 2 and status["reroutes"] == 1
    assert "covey swarm" in client.get("/").text
    coord.stop()


def test_swarm_coordinator_fills_an_empty_stage_before_measuring(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from covey.trust.identity import Identity

    coord, client = _swarm_client(tmp_path)
    ids = [Identity.generate() for _ in range(2)]
    for i, ident in enumerate(ids):
        body = {"run_id": coord.run_id, "peer_id": ident.peer_id, "name": f"p{i}",
                "public_key": ident.public_key, "role": "server", "url": "http://127.0.0.1:9",
                "blob_url": "http://127.0.0.1:9", "stage": 0}  # fmt: skip
        assert _post(client, ident, "/v1/swarm/join", body).json()["stage"] == 0
    bad = {**body, "stage": 7}
    assert _post(client, ids[1], "/v1/swarm/join", bad).status_code == 400
    coord._rebalance(now=0.0)  # no throughput measured yet: stage 1 is empty, so move now
    assert sorted(s.stage for s in coord.servers.values()) == [0, 1]
    coord.stop()
