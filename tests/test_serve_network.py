"""The serving mode with real processes on 127.0.0.1: a server, two honest workers, one
dishonest worker (covey.serve.cheater) and a validator; the official `openai` client,
unmodified, asks for completions, chats and streams. The dishonest worker is caught,
slashed and excluded; no honest one is; the ledger replays (`covey ledger verify`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.rl_helpers import stop, wait_for
from tests.serve_helpers import peer_process, server_process, tiny_served_model

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.network, pytest.mark.long]  # ~90 s on a loaded 2-core box


def _status(url: str) -> dict:
    return httpx.get(f"{url}/v1/serve/status", timeout=5).json()


def _workers_by_name(url: str) -> dict[str, dict]:
    return {w["name"]: w for w in _status(url)["workers"].values()}


def test_openai_client_honest_and_dishonest_workers(tmp_path: Path) -> None:
    model = tiny_served_model(tmp_path / "model")
    # every answer is re-checked (a new worker's rate is 1 for its first 50 answers)
    sets = ("new_worker_answers=50", "max_tokens=24", "request_timeout_s=60")
    with server_process(tmp_path, model, sets) as (url, _):
        procs = [
            peer_process(tmp_path, url, model, "worker", "honest-a"),
            peer_process(tmp_path, url, model, "worker", "honest-b"),
            peer_process(tmp_path, url, model, "worker", "cheat", behavior="quantized"),
            peer_process(tmp_path, url, model, "validator", "validator"),
        ]
        try:
            wait_for(lambda: _status(url)["serving"] == 3, 90, "three workers pulling")
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=8)
            assert [m.id for m in client.models.list().data] == ["serve"]
            for i in range(6):  # the cheat answers some of these: each is checked
                c = client.completions.create(
                    model="serve", prompt=f"Once upon a time {i}", max_tokens=8, seed=i
                )
                assert c.usage.prompt_tokens > 0 and 1 <= c.usage.completion_tokens <= 8
                assert c.choices[0].finish_reason in ("stop", "length")
            chat = client.chat.completions.create(
                model="serve",
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=6,
                temperature=0.7,
                top_p=0.9,
                seed=3,
            )
            assert chat.choices[0].message.role == "assistant"
            assert chat.usage.completion_tokens <= 6
            pieces = list(
                client.chat.completions.create(
                    model="serve",
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=6,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens <= 6
            text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
            assert isinstance(text, str)
            streamed = list(
                client.completions.create(
                    model="serve", prompt="Once", max_tokens=5, stream=True, seed=1
                )
            )
            assert streamed[-1].choices[0].finish_reason in ("stop", "length")

            # keep asking until the cheat has answered (and been caught)
            def caught() -> bool:
                client.completions.create(model="serve", prompt="more", max_tokens=4)
                return _workers_by_name(url)["cheat"]["banned"]

            wait_for(caught, 120, "the dishonest worker to be caught")
            wait_for(
                lambda: (
                    _status(url)["answers"].get("pending", 0) == 0
                    and _status(url)["answers"].get("claimed", 0) == 0
                ),
                60,
                "every check",
            )
            workers = _workers_by_name(url)
            assert workers["cheat"]["banned"] and workers["cheat"]["stake"] < 10
            assert not workers["honest-a"]["banned"] and not workers["honest-b"]["banned"]
            assert workers["honest-a"]["balance"] + workers["honest-b"]["balance"] > 0
            assert procs[2].wait(30) == 1  # the cheat was told it is excluded, and stopped
            # same seed, same answer, whichever honest worker serves it
            a = client.completions.create(model="serve", prompt="A", max_tokens=6, seed=7)
            b = client.completions.create(model="serve", prompt="A", max_tokens=6, seed=7)
            assert a.choices[0].text == b.choices[0].text
            ledger = httpx.get(f"{url}/v1/ledger", params={"limit": 5000}, timeout=10).json()
            kinds = {e["type"] for e in ledger}
            assert {"slash", "dispute", "verification", "reward"} <= kinds
            verify = subprocess.run(
                [sys.executable, "-m", "covey", "ledger", "verify", url],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert verify.returncode == 0, verify.stdout + verify.stderr
        finally:
            for p in procs:
                if p.poll() is None:
                    stop(p)
