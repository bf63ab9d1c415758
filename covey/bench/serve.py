"""`covey bench serve`: what serving through covey costs and what its checks catch.

1. baseline: one process sampling like `covey generate` (covey.io.generate.sample), the
   requests one after another: tokens/s and per-request latency;
2. served: `covey serve server` + `--workers` honest `covey serve worker` processes on
   127.0.0.1, the same requests sent `--concurrency` at a time over HTTP: tokens/s and
   p50/p99 latency as a user sees it (queueing included);
3. verification overhead: the check of one answer (one prefill, covey.serve.checks) over
   the generation of it (covey.rl.sampling), times the share of answers checked;
4. catch probability per answer: for each cheat of covey.serve.cheater, the share of its
   answers the check rejects (d), times the share checked (r): P(caught per answer) =
   r x d, at a new worker's rate and an established one's.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import typer

from covey.bench.say import LOG_JSON, bench_say


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def baseline(model: Any, tok: Any, prompts: list[str], max_tokens: int) -> dict[str, float]:
    from covey.io.generate import sample

    lat, tokens, start = [], 0, time.perf_counter()
    for i, p in enumerate(prompts):
        t = time.perf_counter()
        text = sample(model, tok, p, max_new_tokens=max_tokens, temperature=1.0, seed=i)
        lat.append(time.perf_counter() - t)
        tokens += max(1, len(tok.encode(text)))
    wall = time.perf_counter() - start
    return {"tokens_per_s": tokens / wall, "p50_s": _pct(lat, 0.5), "p99_s": _pct(lat, 0.99)}


def served(
    model_dir: Path,
    prompts: list[str],
    max_tokens: int,
    workers: int,
    concurrency: int,
    port: int,
    slots: int = 1,
) -> dict[str, float]:
    import httpx

    from covey.io.deposit import fund_key

    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="covey-bench-serve-") as tmp:
        run = [sys.executable, "-m", "covey", "serve"]
        logs = open(Path(tmp) / "log", "ab")  # noqa: SIM115 -- closed below
        procs = [
            subprocess.Popen(
                [
                    *run,
                    "server",
                    "--data-dir",
                    f"{tmp}/d",
                    "--model",
                    str(model_dir),
                    "--port",
                    str(port),
                    "--set",
                    f"max_tokens={max_tokens}",
                    "--set",
                    "queue_per_worker=64",
                    "--set",
                    f"worker_slots={slots}",
                ],
                stdout=logs,
                stderr=logs,
            )
        ]
        try:
            _wait(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, 120)
            # the run's owner (the server's key) funds what each worker stakes (10 credits)
            keys = [Path(tmp) / f"w{i}.key" for i in range(workers)]
            for key in keys:
                fund_key(url, Path(tmp) / "d" / "coordinator.key", key, 10.0)
            for i in range(workers):
                procs.append(
                    subprocess.Popen(
                        [
                            *run,
                            "worker",
                            "--server",
                            url,
                            "--model",
                            str(model_dir),
                            "--name",
                            f"w{i}",
                            "--identity",
                            str(keys[i]),
                            "--slots",
                            str(slots),
                        ],
                        stdout=logs,
                        stderr=logs,
                    )
                )
            _wait(lambda: httpx.get(f"{url}/v1/serve/status").json()["serving"] == workers, 120)
            http = httpx.Client(base_url=url, timeout=120)

            def one(i: int) -> tuple[float, int]:
                t = time.perf_counter()
                r = http.post(
                    "/v1/completions",
                    json={"prompt": prompts[i], "seed": i, "max_tokens": max_tokens},
                )
                if r.status_code != 200:
                    raise RuntimeError(f"request {i}: {r.status_code} {r.text[:300]}")
                return time.perf_counter() - t, r.json()["usage"]["completion_tokens"]

            start = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(one, range(len(prompts))))
            wall = time.perf_counter() - start
            http.close()
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                p.wait(30)
            logs.close()
    lat = [r[0] for r in results]
    return {
        "tokens_per_s": sum(r[1] for r in results) / wall,
        "p50_s": _pct(lat, 0.5),
        "p99_s": _pct(lat, 0.99),
    }


def _wait(cond: Callable[[], bool], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout} s")


def checks(model: Any, tok: Any, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Verification overhead and the share of each cheat's answers the check rejects."""
    from covey.rl.proofs import build_proof
    from covey.rl.sampling import generate_batch
    from covey.serve.cheater import CHEATS, cheat_answer, corrupt
    from covey.serve.checks import check_answer
    from covey.serve.wire import Job

    jobs = [
        Job(
            job_id=f"{i:032x}",
            prompt_ids=tok.encode(p) or [tok.eos_id],
            max_tokens=max_tokens,
            temperature=1.0,
            top_p=1.0 if i % 2 else 0.9,
            seed=1000 + i,
            eos_id=tok.eos_id,
        )
        for i, p in enumerate(prompts)
    ]
    from covey.serve.house import canary_answer

    gen_s = check_s = 0.0
    honest_rejected = canaries_rejected = 0
    for job in jobs:
        t = time.perf_counter()
        from covey.serve.model import sampler

        g = generate_batch(
            sampler(model, job.top_p, job.temperature),
            [job.prompt_ids],
            job.max_tokens,
            job.temperature,
            [job.seed],
            job.eos_id,
        )[0]
        proof = build_proof(g.hidden)
        gen_s += time.perf_counter() - t
        t = time.perf_counter()
        honest_rejected += not check_answer(model, job.model_dump(), g.tokens, proof).ok
        check_s += time.perf_counter() - t
        # a house worker's canary answer to this request (covey.serve.house)
        bad = canary_answer(model, job)
        canaries_rejected += not check_answer(model, job.model_dump(), *bad).ok
    detected = {}
    for cheat in CHEATS:
        bad = corrupt(copy.deepcopy(model), cheat)
        caught = sum(
            not check_answer(model, j.model_dump(), *cheat_answer(bad, j, cheat)).ok for j in jobs
        )
        detected[cheat] = caught / len(jobs)
    return {
        "check_over_generation": check_s / gen_s,
        "honest_rejected": honest_rejected,
        "canaries_rejected": canaries_rejected,
        "answers": len(jobs),
        "detected": detected,
    }


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("serve")
    def bench_serve(
        model: Annotated[Path, typer.Option(help="an exported model folder (covey export)")],
        requests: Annotated[int, typer.Option(min=2, help="requests in each measurement")] = 24,
        max_tokens: Annotated[int, typer.Option(min=1, help="tokens per answer")] = 32,
        workers: Annotated[int, typer.Option(min=1, help="worker processes behind the server")] = 2,
        concurrency: Annotated[int, typer.Option(min=1, help="requests in flight at once")] = 4,
        slots: Annotated[
            int, typer.Option(min=1, max=64, help="requests each worker answers at a time")
        ] = 4,
        port: Annotated[int, typer.Option(help="the server's port on 127.0.0.1")] = 8871,
        verify_rate: Annotated[
            float, typer.Option(help="an established worker's checked share")
        ] = 0.1,
        new_rate: Annotated[float, typer.Option(help="a new worker's checked share")] = 1.0,
        log_json: Annotated[bool, LOG_JSON] = False,
    ) -> None:
        """Tokens/s and p50/p99 latency served by covey against one generate process, the
        verification overhead, and each cheat's catch probability per answer."""
        say = bench_say(log_json, "serve")
        import torch

        from covey.serve.model import load_model

        torch.set_num_threads(1)
        m, tok = load_model(model)
        prompts = [f"{i}: Once upon a time" for i in range(requests)]
        base = baseline(m, tok, prompts, max_tokens)
        say(
            f"one generate process: {base['tokens_per_s']:.1f} tokens/s, p50 "
            f"{base['p50_s']:.2f} s, p99 {base['p99_s']:.2f} s"
        )
        srv = served(model, prompts, max_tokens, workers, concurrency, port, slots)
        say(
            f"covey serve, {workers} workers of {slots} slots, {concurrency} in flight: "
            f"{srv['tokens_per_s']:.1f} tokens/s, p50 {srv['p50_s']:.2f} s, p99 "
            f"{srv['p99_s']:.2f} s"
        )
        c = checks(m, tok, prompts, max_tokens)
        ratio = c["check_over_generation"]
        say(
            f"one check / one generation: {ratio:.3f}; verification overhead at rate "
            f"{verify_rate}: {verify_rate * ratio:.1%} of serving compute, at {new_rate}: "
            f"{new_rate * ratio:.1%}; honest answers rejected: {c['honest_rejected']} of "
            f"{c['answers']}; house canary answers rejected by the check: "
            f"{c['canaries_rejected']} of {c['answers']}"
        )
        for cheat, d in c["detected"].items():
            say(
                f"cheat {cheat}: check rejects {d:.0%} of its answers; caught per answer "
                f"{new_rate * d:.2f} while new, {verify_rate * d:.3f} after"
            )
