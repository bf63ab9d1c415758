"""Hugging Face decoders in SWARM: a stage server loads only its stage's tensors
from safetensors by name, and a tiny Llama served by two stage servers over HTTP computes
what the whole model computes in one process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

LLAMA = {
    "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}  # fmt: skip


def save_tiny(directory: Path, kind: str = "llama") -> nn.Module:
    """A random-init tiny decoder (config built here) saved as config.json + safetensors."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(1)
    if kind == "llama":
        cfg = LlamaConfig(**LLAMA)
    else:
        cfg = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                         bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    model.config.use_cache = False
    return model.eval()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    d = tmp_path_factory.mktemp("tiny-llama")
    return d, save_tiny(d)


def test_a_stage_holds_only_its_tensors_and_stages_equal_the_whole_model(
    llama_dir: tuple[Path, nn.Module],
) -> None:
    from covey.swarm.hfmodel import load_stage_module

    d, whole = llama_dir
    stages = [load_stage_module(d, 0, 2, k) for k in range(2)]
    names0 = {n for n, _ in stages[0].named_parameters()}
    names1 = {n for n, _ in stages[1].named_parameters()}
    assert "embed_tokens.weight" in names0 and not any("lm_head" in n for n in names0)
    assert "lm_head.weight" in names1 and not any("embed" in n for n in names1)
    assert len(list(stages[0].blocks)) == 2 and len(list(stages[1].blocks)) == 2
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = stages[1](stages[0](idx))
        want = whole(input_ids=idx, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gpt2_last_stage_reads_the_tied_head_from_the_embedding(tmp_path: Path) -> None:
    """GPT-2 ties lm_head to wte: safetensors stores it once, the last stage finds it by
    its other name and holds its own copy."""
    from covey.swarm.hfmodel import load_stage_module

    whole = save_tiny(tmp_path, "gpt2")
    last = load_stage_module(tmp_path, 0, 2, 1)
    assert torch.equal(last.lm_head.weight, whole.transformer.wte.weight)
    assert last.lm_head.weight.data_ptr() != whole.transformer.wte.weight.data_ptr()


def test_a_run_refuses_a_directory_with_another_config(tmp_path: Path) -> None:
    import json

    from covey.swarm.config import SwarmConfig
    from covey.swarm.wire import build_stage

    save_tiny(tmp_path / "a")
    cfg = SwarmConfig(model=f"hf:{tmp_path / 'a'}", stages=2, seq_len=16)
    assert len(cfg.model_digest) == 64
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 2}))
    other = cfg.model_copy(update={"model": f"hf:{tmp_path / 'b'}"})
    with pytest.raises(ValueError, match="digest"):
        build_stage(other, 0)
    with pytest.raises(ValueError, match="seq_len"):
        build_stage(cfg.model_copy(update={"seq_len": 64}), 0)


@pytest.fixture(scope="module")
def hf_swarm(
    llama_dir: tuple[Path, nn.Module], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[object]:
    from covey.swarm.config import SwarmConfig
    from covey.swarm.local import LocalSwarm
    from tests.tiny_hf import TEXTS, tiny_tokenizer

    d, _ = llama_dir
    tok = tiny_tokenizer(tmp_path_factory.mktemp("hf-tok"), vocab_size=300)
    data = tmp_path_factory.mktemp("hf-data") / "stories.txt"
    data.write_text("\n\n".join(TEXTS * 4))
    # trainers tokenize with this tokenizer.json (servers see ids only)
    cfg = SwarmConfig(model=f"hf:{d}", stages=2, seq_len=16, microbatch=2, codec="plain",
                      verify_rate=0.0, rebalance_s=3600, target_samples=8,
                      tokenizer=f"hf:{tok}", data_paths=(str(data),))  # fmt: skip
    s = LocalSwarm(cfg, tmp_path_factory.mktemp("hf-swarm"))
    try:
        s.add_server("h0", 0, model=f"hf:{d}")
        s.add_server("h1", 1)
        s.ready(["h0", "h1"])
        yield s
    finally:
        s.close()


@pytest.mark.network
def test_a_tiny_hf_llama_through_two_stages_over_http_equals_in_process(
    hf_swarm: object, llama_dir: tuple[Path, nn.Module]
) -> None:
    """One microbatch hop by hop over HTTP (fp32 on the wire): the loss equals the whole
    model's to 1e-5 and each stage's per-parameter gradient norms equal autograd's on the
    whole model to 1e-4 (relative)."""
    import torch.nn.functional as F

    from covey.swarm import compute
    from covey.swarm.trainer import SwarmTrainer
    from covey.swarm.wire import encode_tensor, pack, unpack

    _, whole = llama_dir
    idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    t = SwarmTrainer(hf_swarm.url, name="hf", inflight=1, progress=lambda _: None,  # type: ignore[attr-defined]
                     tokens=torch.arange(256))  # fmt: skip
    try:
        t.refresh()
        h0 = t.hop(0, "forward", pack(encode_tensor(idx[:, :-1], "plain")), 2)
        out0, _ = unpack(h0.reply, 2)
        h1 = t.hop(1, "backward", pack(out0, encode_tensor(idx[:, 1:], "")), 2)
        grad1, _ = unpack(h1.reply, 2)
        h2 = t.hop(0, "backward", pack(encode_tensor(idx[:, :-1], ""), grad1), 2)
        (_, meta1), (_, meta0) = compute.parse_reply(h1.reply), compute.parse_reply(h2.reply)
    finally:
        t.close()
    whole.zero_grad()
    logits = whole(input_ids=idx[:, :-1], use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
    loss.backward()
    assert meta1["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    params = dict(whole.named_parameters())
    first = ["model.embed_tokens.weight"] + [
        n for n in params if n.startswith(("model.layers.0.", "model.layers.1."))
    ]
    last = [n for n in params if n.startswith(("model.layers.2.", "model.layers.3."))]
    last += ["model.norm.weight", "lm_head.weight"]
    want0 = [float(params[n].grad.norm()) for n in first]  # type: ignore[union-attr]
    want1 = [float(params[n].grad.norm()) for n in last]  # type: ignore[union-attr]
    assert sorted(meta0["sketch"]) == pytest.approx(sorted(want0), rel=1e-4, abs=1e-7)
    assert sorted(meta1["sketch"]) == pytest.approx(sorted(want1), rel=1e-4, abs=1e-7)


@pytest.mark.network
def test_hf_stages_train_and_average_over_http(hf_swarm: object) -> None:
    """A trainer's microbatches through the HF stages: the loss is finite and every stage
    commits an averaging round that its server applies (step and agreed state)."""
    from covey.swarm.launch import status, wait_for
    from covey.swarm.trainer import SwarmTrainer

    url = hf_swarm.url  # type: ignore[attr-defined]
    t = SwarmTrainer(url, name="hf-train", inflight=2, progress=lambda _: None)
    assert int(t.tokens.max()) >= 256  # the run's BPE tokenizer, not covey's bytes
    try:
        st = t.train(samples=24)
    finally:
        t.close()
    assert st.samples >= 24 and st.dropped == 0
    assert all(0 < x < 10 for x in st.losses)

    def applied() -> dict | None:
        s = status(url)
        if s is None or any(b["rounds"] < 1 for b in s["averaging"]):
            return None
        agreed = {b["stage"]: (b["step"], b["agreed"]) for b in s["averaging"]}
        ok = all((x["step"], x["state"]) == agreed[x["stage"]] for x in s["servers"])
        return s if ok else None

    wait_for(applied, 60, "each stage to commit and apply an averaging round")


RACE = """
import sys, threading
from covey.swarm.config import SwarmConfig
from covey.swarm.wire import build_stage
cfg = SwarmConfig(model="hf:" + sys.argv[1], stages=2, seq_len=16)
errs = []
def build(k):
    try:
        build_stage(cfg, k)
    except Exception as e:
        errs.append(repr(e))
threads = [threading.Thread(target=build, args=(k % 2,)) for k in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print("errors", errs)
"""


@pytest.mark.long
def test_threads_of_a_fresh_process_build_hf_stages_at_once(
    llama_dir: tuple[Path, nn.Module],
) -> None:
    """A coordinator builds stages from request threads; transformers' first import is
    not thread-safe ("cannot import name 'CONFIG_MAPPING'" seen in a coordinator), so HF
    stage building is serialized. Needs a fresh process: this one imported it already."""
    import subprocess
    import sys

    d, _ = llama_dir
    out = subprocess.run([sys.executable, "-c", RACE, str(d)], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("errors []"), out.stdout[-2000:]
