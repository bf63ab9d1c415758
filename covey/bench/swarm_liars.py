"""`covey bench swarm-liars`: how soon a stage server that lies now and then is caught.

Each trial starts a swarm coordinator and four stage servers as processes on 127.0.0.1
(a0, a1 on stage 0; b0 honest and b1 "subtle" on stage 1: one request in SUBTLE_EVERY,
chosen by the request's hash, answered with an error of 1.4x the tolerance,
covey.swarm.server.misbehave); this process is the trainer, at the run's `verify_rate`.
It trains until the liar is banned (the referee convicted it on a duplicated hop whose
replies disagreed) or `seconds` pass. Per trial: microbatches, checks and the liar's
replies until the ban, the lies among those replies (the rule is public: a bench can
count them from the requests it sent), and whether the conviction's evidence recomputes
(`covey ledger verify --recompute` over HTTP, covey.swarm.ledger_evidence).

Every hop to b1 is a lie with probability 1 / SUBTLE_EVERY and a duplicated hop with
probability verify_rate; a duplicated lie is a disagreement (b0 is honest), so each lie is
caught with probability about verify_rate, and the lies before the catch, which the
trainer used, number about 1 / verify_rate - 1.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SETTINGS = {
    "n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "stages": 2, "microbatch": 4,
    "target_samples": 16, "rebalance_s": 3600, "request_timeout_s": 10, "payout_s": 1.0,
}  # fmt: skip


def run_trial(verify_rate: float, seconds: float, echo: Callable[[str], None]) -> dict[str, Any]:
    from covey.io import audit
    from covey.swarm.launch import Swarm, status
    from covey.swarm.ledger_evidence import recompute_disputes
    from covey.swarm.server import SUBTLE_EVERY
    from covey.swarm.trainer import SwarmTrainer
    from covey.swarm.wire import sha

    work = Path(tempfile.mkdtemp(prefix="covey-bench-swarm-liars-"))
    swarm = Swarm(work, {**SETTINGS, "verify_rate": verify_rate})
    try:
        swarm.start_coordinator(wait=False)
        for name in ("a0", "a1", "b0"):
            swarm.start_server(name, "--emulate-s", "0.01", "--stage", str(int(name[0] == "b")))
        swarm.start_server("b1", "--emulate-s", "0.01", "--stage", "1", "--behavior", "subtle")
        who = {x["name"]: x["peer_id"] for x in swarm.ready(["a0", "a1", "b0", "b1"])["servers"]}
        liar = who["b1"]
        t = SwarmTrainer(swarm.url, name="bench", inflight=4, progress=lambda _: None)
        sent = {"replies": 0, "lies": 0}
        send, lock = t._send, threading.Lock()

        def counted(server: str, k: int, kind: str, body: bytes, check: bool = False) -> Any:
            hop = send(server, k, kind, body, check)
            if server == liar:
                with lock:
                    sent["replies"] += 1
                    sent["lies"] += int(sha(body)[:8], 16) % SUBTLE_EVERY == 0
            return hop

        banned_at: dict[str, Any] = {}
        note, start = t._note, time.monotonic()

        def noted(event: str, server: str, *args: Any) -> None:
            note(event, server, *args)  # called under the trainer's lock
            if event == "invalid" and server == liar and not banned_at:
                with lock:  # the moment the referee's verdict reached the trainer
                    banned_at.update(s=round(time.monotonic() - start, 1),
                                     microbatches=t.stats.microbatches, checks=t.stats.checks,
                                     **sent)  # fmt: skip
                t.stop.set()

        t._send = counted  # type: ignore[method-assign]
        t._note = noted  # type: ignore[method-assign]
        run = threading.Thread(target=lambda: t.train(seconds=seconds), daemon=True)
        run.start()
        run.join()
        t.close()
        st = status(swarm.url) or {}
        caught = liar in st.get("banned", {})
        recomputed = 0
        if caught:
            report = audit.verify(swarm.url, recompute=True, recomputers=[recompute_disputes])
            recomputed = report.swarm_recomputed
        row = {
            "verify_rate": verify_rate,
            "caught": caught,
            "seconds_to_ban": banned_at.get("s"),
            "microbatches_to_ban": banned_at.get("microbatches"),
            "checks_to_ban": banned_at.get("checks"),
            "liar_replies_to_ban": (banned_at or sent)["replies"],
            "lies_to_ban": (banned_at or sent)["lies"],
            "convictions_recomputed": recomputed,
        }
        echo(json.dumps(row))
        return row
    finally:
        swarm.close()
        shutil.rmtree(work, ignore_errors=True)


def run_swarm_liars_bench(
    trials: int, verify_rate: float, seconds: float, json_path: Path | None,
    echo: Callable[[str], None],
) -> list[dict[str, Any]]:  # fmt: skip
    """`trials` trials (rows as `run_trial` returns them), and a summary row."""
    rows: list[dict[str, Any]] = []
    for _ in range(trials):
        rows.append(run_trial(verify_rate, seconds, echo))
        if json_path is not None:
            json_path.write_text(json.dumps(rows, indent=1))
    caught = [r for r in rows if r["caught"]]
    lies = sum(r["lies_to_ban"] for r in caught)
    summary = {
        "summary": f"subtle stage server, verify_rate {verify_rate}",
        "trials": len(rows),
        "caught": len(caught),
        "lies_per_catch": round(lies / len(caught), 2) if caught else None,
        "catch_per_lie": round(len(caught) / lies, 3) if lies else None,
        "microbatches_per_catch": round(
            sum(r["microbatches_to_ban"] for r in caught) / len(caught), 1
        )
        if caught
        else None,
        "recomputed": sum(r["convictions_recomputed"] >= 1 for r in caught),
    }
    rows.append(summary)
    echo(json.dumps(summary))
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=1))
    return rows
