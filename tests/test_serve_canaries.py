"""Serving validators are checked too (covey.serve.canaries): a validator that agrees with
every answer without checking passes planted canaries and loses stake; a diligent one
catches them and is paid; the ledger, canary draws included, replays. Real sockets: the
server on uvicorn in a thread, a worker and two validators in threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from covey.config import TrustConfig
from covey.trust.identity import Identity
from tests.rl_helpers import wait_for
from tests.serve_helpers import funded, tiny_served_model
from tests.test_serve import _thread, in_process_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_served_model(tmp_path_factory.mktemp("canaries") / "model")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_validator_that_agrees_without_checking_is_caught(
    tmp_path: Path, model_dir: Path
) -> None:
    from covey.io.audit import verify
    from covey.serve.cheater import LazyServeValidator
    from covey.serve.validator import ServeValidator
    from covey.serve.worker import ServeWorker

    cfg = dict(
        max_tokens=6,
        new_worker_answers=1000,  # every answer is drawn for a check
        heartbeat_s=0.5,
        dead_after_s=3.0,
        pull_wait_s=1.0,
        trust=TrustConfig(canary_rate=0.5, check_reward=0.01),
    )
    with in_process_server(tmp_path / "server", model_dir, **cfg) as (url, s):
        stop = threading.Event()
        worker = funded(s, ServeWorker(url, Identity.generate(), model_dir, name="w", stop=stop))
        honest = funded(s, ServeValidator(url, Identity.generate(), model_dir, name="v", stop=stop))
        lazy = funded(
            s, LazyServeValidator(url, Identity.generate(), model_dir, name="lazy", stop=stop)
        )
        threads = [_thread(p.run_loop) for p in (worker, honest, lazy)]
        book = s.accounts.book.accounts
        try:
            wait_for(lambda: len(s.live_validators(time.time())) == 2, 30)
            http = httpx.Client(base_url=url, timeout=60)

            def both_met_canaries() -> bool:
                http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 6})
                return book[lazy.identity.peer_id].canaries_passed >= 1 and any(
                    r.get("outcome") == "canary caught" for r in getattr(honest, "reports", [])
                )

            wait_for(both_met_canaries, 90, "each validator to be handed a canary")
            lazy_account, honest_account = (
                book[lazy.identity.peer_id],
                book[honest.identity.peer_id],
            )
            assert lazy_account.slashed > 0 and lazy_account.canaries_passed >= 1
            assert honest_account.canaries_passed == 0 and honest_account.slashed == 0
            assert not book[worker.identity.peer_id].banned  # a canary convicts nobody
            counts = httpx.get(f"{url}/v1/serve/status").json()["canaries"]
            assert counts.get("passed", 0) >= 1 and counts.get("caught", 0) >= 1, counts
        finally:
            stop.set()
            for t in threads:
                t.join(20)
        audit = verify(url)  # canary draws, penalties and check pay replay from the ledger
        assert audit.summary["accounts"][lazy.identity.peer_id]["slashed"] > 0
