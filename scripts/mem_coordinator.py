"""Peak memory of the coordinator's rounds, phase by phase (docs/memory.md).

Runs a real `covey.coordinator.service.Coordinator` in this process, without HTTP: the
demo's 124M spec (`covey.local.demo.demo_spec`: DiLoCo, fp32 payloads, inner state reset,
outer momentum, trimmed mean + norm clip, evaluation and samples every round) on a GPT-2
shaped Hugging Face model of about --mparams million parameters (or --model hf:DIR), two
peers that join and submit through the coordinator's own intake, their payloads already
in its blob store (as an upload leaves them), and the driver's `tick` closing each round;
the evaluator's loop is run in this thread after each commit. Rounds 0 and 1 are
measured (round 1's start carries the outer momentum), then a restart on the same data
directory.

Each phase's peak is the kernel's VmHWM from the end of the previous phase to its own end
(so nothing between phases is missed), above the process's RSS before the coordinator was
built (torch imported, no model); figures are in model sizes (M = the fp32 parameter
bytes). The contributions are seeded: the last line's weights hash is the same for any
code that computes the same rounds.

    .venv/bin/python scripts/mem_coordinator.py --mparams 30
    .venv/bin/python scripts/mem_coordinator.py --model hf:configs/gpt2-124m

Linux only (reads /proc/self/status). Exit 2 with `error: ...` on bad input.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import covey.coordinator.evaluator as evaluator_mod
import covey.coordinator.rounds as rounds_mod
from covey.algorithms import TrainState
from covey.config import RunConfig
from covey.coordinator.auth import _RECEIVED_AT
from covey.coordinator.service import Coordinator
from covey.local.demo import demo_spec
from covey.memory import reset_peak, rss_mib
from covey.protocol import schemas
from covey.trust.identity import Identity, request_purpose

WIDTH, VOCAB, POSITIONS = 512, 512, 128
SCRIPTS_OWN = "(this script makes and stores 2 payloads)"  # not the coordinator's memory


def gpt2_dir(mparams: float, folder: Path) -> Path:
    """A GPT-2 shaped config.json of about `mparams` million parameters (width 512)."""
    per_layer = 12 * WIDTH * WIDTH + 13 * WIDTH
    layers = max(1, round((mparams * 1e6 - (VOCAB + POSITIONS) * WIDTH) / per_layer))
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": VOCAB,
        "n_positions": POSITIONS, "n_ctx": POSITIONS, "n_embd": WIDTH, "n_layer": layers,
        "n_head": 8, "activation_function": "gelu_new", "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02, "tie_word_embeddings": True,
        "bos_token_id": VOCAB - 1, "eos_token_id": VOCAB - 1,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _warm_imports(folder: Path) -> None:
    """Build a tiny model of the same kind once: transformers' lazily imported modules
    then count in the baseline, not in the coordinator's start-up."""
    from covey.models.hf import build_hf_model

    config = json.loads((gpt2_dir(1, folder) / "config.json").read_text())
    config.update(n_layer=1, n_embd=64, n_head=2)
    (folder / "config.json").write_text(json.dumps(config))
    build_hf_model(str(folder), 0, pretrained=False)


def _corpus(path: Path) -> Path:
    """About 1 MB of the standard library's source: the demo's kind of text, small."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(errors="replace") for p in sorted(lib.glob("[a-f]*.py")))
    path.write_text(text[: 1 << 20])
    return path


class Peer:
    """A worker that joins and submits by hand; its payloads are put in the store first."""

    def __init__(self, coord: Coordinator, name: str) -> None:
        self.coord, self.key = coord, Identity.generate()
        body = {"run_id": coord.run_id, "peer_id": self.key.peer_id,
                "public_key": self.key.public_key, "name": name, "step_time_s": 1.0,
                "stake": coord.cfg.trust.min_stake}  # fmt: skip
        raw = self._signed(body, "/v1/join")
        self._call("/v1/join", lambda: coord.join(schemas.JoinRequest.model_validate(raw), raw))

    def _signed(self, body: dict[str, Any], path: str, round_: int = -1) -> dict[str, Any]:
        return self.key.sign_request(body, round_, purpose=request_purpose(path))

    @staticmethod
    def _call(path: str, fn: Callable[[], Any]) -> Any:
        token = _RECEIVED_AT.set(request_purpose(path))
        try:
            return fn()
        finally:
            _RECEIVED_AT.reset(token)

    def put_payload(self, seed: int) -> tuple[str, int]:
        """A seeded pseudo-gradient, encoded by the run's codec, in the coordinator's store."""
        strategy, state = self.coord.rounds.strategy, self.coord.state
        names = strategy.fragment_names(strategy.round_fragment(state.round))
        numel = sum(self.coord.rounds.template.params[n].numel() for n in names)
        delta = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3
        payload = strategy.codec.encode(delta)
        del delta
        cid = self.coord.blobs.put(payload)
        return cid, len(payload)

    def submit(self, cid: str, size: int) -> None:
        rnd = self.coord.open_round()
        assert rnd is not None, "no open round"
        body = {
            "run_id": self.coord.run_id, "round": rnd.round, "attempt": rnd.attempt,
            "peer_id": self.key.peer_id, "cid": cid, "start_hash": self.coord.state_hash,
            "size": size, "tokens": 64, "inner_steps": rnd.assignments[self.key.peer_id][
                "inner_steps"],
        }  # fmt: skip
        path = f"/v1/rounds/{rnd.round}/contributions"
        raw = self._signed(body, path, rnd.round)
        req = schemas.ContributionRequest.model_validate(raw)
        self._call(path, lambda: self.coord.submit(rnd.round, req, raw))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mparams", type=float, default=30.0, help="model size, millions")
    ap.add_argument("--model", default=None, help="hf:DIR instead of --mparams")
    ap.add_argument("--rounds", type=int, default=2, help="rounds to close (>= 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = ap.parse_args(argv)
    if args.mparams <= 0 or args.rounds < 1:
        print("error: --mparams must be > 0 and --rounds >= 1", file=sys.stderr)
        return 2
    if args.model is not None and not args.model.startswith("hf:"):
        print(f"error: --model {args.model!r} is not hf:DIR", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = args.model or f"hf:{gpt2_dir(args.mparams, tmp / 'model')}"
        spec = demo_spec("diloco", model=model, workers=2, rounds=args.rounds + 1,
                         inner_steps=2, batch_size=2, seq_len=64,
                         data=(str(_corpus(tmp / "corpus.txt")),))  # fmt: skip
        spec["rounds"]["samples_every"] = 1  # the status page's samples, every round
        cfg = RunConfig.model_validate(spec)
        _warm_imports(tmp / "tiny")
        gc.collect()
        base = rss_mib()["VmRSS"]
        rows: list[tuple[str, float, float]] = []  # (stage: phase, peak in M, seconds)
        clock = [time.perf_counter()]
        mb = [1.0]
        stage = ["start-up"]

        def mark(name: str) -> None:
            now = time.perf_counter()
            peak = (rss_mib()["VmHWM"] - base) / mb[0]
            rows.append((f"{stage[0]}: {name}", peak, now - clock[0]))
            clock[0] = now
            reset_peak()

        def wrap(obj: Any, attr: str, name: str) -> None:
            inner = getattr(obj, attr)

            def wrapped(*a: Any, **k: Any) -> Any:
                mark(f"(before {name})")
                out = inner(*a, **k)
                mark(name)
                return out

            setattr(obj, attr, wrapped)

        reset_peak()
        coord = Coordinator(cfg, tmp / "data")
        mb[0] = coord.rounds.parameters * 4 / 2**20
        mark("model built, round-0 state stored")
        rounds = coord.rounds
        digest = TrainState.digest
        wrap(rounds.strategy, "aggregate", "aggregate (2 mapped contributions)")
        for update in ("apply_round", "apply_round_consuming"):  # whichever the close calls
            if hasattr(rounds.strategy, update):
                wrap(rounds.strategy, update, "outer step")
        wrap(rounds, "_store_state", "store the new state")
        wrap(TrainState, "digest", "hash the new state")
        wrap(rounds_mod, "make_certificate", "certificate")
        wrap(coord.verification, "record_round", "ledger (record_round)")
        wrap(rounds_mod, "write_checkpoint", "checkpoint copy")
        wrap(rounds_mod, "prune_blobs", "prune")
        wrap(evaluator_mod, "held_out_loss", "evaluate (held-out loss)")
        wrap(rounds.evaluator, "_refresh_samples", "samples")
        peers = [Peer(coord, f"p{i}") for i in range(2)]
        gc.collect()
        held = [("held after start-up", (rss_mib()["VmRSS"] - base) / mb[0])]
        for r in range(args.rounds):
            stage[0] = f"round {r}"
            rounds.tick(time.time())  # opens round r
            payloads = [p.put_payload(100 * r + i) for i, p in enumerate(peers)]
            gc.collect()
            mark(SCRIPTS_OWN)
            for p, (cid, size) in zip(peers, payloads, strict=True):
                p.submit(cid, size)
            mark("intake (2 submissions)")
            rounds.tick(time.time())  # closes round r: all submitted
            assert rounds.state.round == r + 1, f"round {r} did not commit"
            mark("(rest of the close)")
            rounds.evaluator._evals.put(None)
            rounds.evaluator._evaluate()  # the evaluator thread's loop, here
            mark("(after the evaluation)")
            gc.collect()
            held.append((f"held after round {r}", (rss_mib()["VmRSS"] - base) / mb[0]))
        weights_hash = coord.state_hash
        TrainState.digest = digest  # type: ignore[method-assign]  # unwrapped
        coord.stop()
        del coord, rounds, peers
        gc.collect()
        base_restart = rss_mib()["VmRSS"]
        reset_peak()
        coord = Coordinator(cfg, tmp / "data")
        over = (rss_mib()["VmHWM"] - base_restart) / mb[0]
        rows.append(("restart: state read back", over, time.perf_counter() - clock[0]))
        held.append(("held after the restart", (rss_mib()["VmRSS"] - base_restart) / mb[0]))
        resumed = coord.state_hash == weights_hash
        coord.stop()
    peak = max(o for n, o, _ in rows if not n.endswith(SCRIPTS_OWN))
    if args.json:
        print(json.dumps({"model_mib": mb[0], "phases": {n: round(o, 3) for n, o, _ in rows},
                          "held": dict(held), "round_peak": peak,
                          "weights_hash": weights_hash, "resumed": resumed}))  # fmt: skip
        return 0
    print(f"model {mb[0]:.0f} MiB (M), {mb[0] * 2**20 / 4e6:.1f}M parameters; "
          f"baseline (torch, no model) {base:.0f} MiB")  # fmt: skip
    print(f"{'phase':<52} {'peak above baseline (M)':>24} {'seconds':>8}")
    for name, o, secs in rows:
        if "(before " not in name:
            print(f"{name:<52} {o:>24.2f} {secs:>8.2f}")
    for name, o in held:
        print(f"{name:<52} {o:>24.2f}")
    print(f"{'peak (the coordinator phases)':<52} {peak:>24.2f}")
    print(f"weights hash after {args.rounds} rounds: {weights_hash} (restart: "
          f"{'same' if resumed else 'DIFFERENT'})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
