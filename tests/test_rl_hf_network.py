"""An HF causal LM as the policy of a real RL run over HTTP on 127.0.0.1: a trainer with
`--policy hf:DIR` (the tiny GPT-2 of tests/test_rl_hf.py), an honest worker and a validator.
The worker's batch is checked with the policy's own tokenizer, accepted, trained on, and
version v+1 is published as safetensors that load into the model the descriptor builds.

Prompts come from a Parquet file through the data layer, rewarded by `reward_length` (a
random policy earns varied rewards, so the step has non-zero advantages and changes the
weights). The fast test serves the trainer from this process (uvicorn in a thread: real sockets, no
torch/transformers import in a subprocess); the long one runs `covey rl trainer` itself."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from covey.bench.rl_hf_verify import make_hf_policy
from covey.rl import policy as pol
from covey.rl.hf_policy import dir_newline_id
from covey.rl.runspec import RLSpec, TaskSpec
from covey.rl.validator import RolloutValidator
from covey.rl.worker import RolloutWorker
from covey.trust.identity import Identity
from tests.rl_helpers import OWNERS, free_port, fund, join_funded, trainer_process, wait_for

pytestmark = pytest.mark.network
ROOT = Path(__file__).resolve().parents[1]
SPEC = dict(
    prompts_per_step=2,
    group_size=4,
    samples_per_step=8,
    audit_rate=0.0,
    verify_timeout_s=10,
    eval_prompts=4,
    eval_every=1000,
    heartbeat_s=1,
    dead_after_s=3,
)


def reward_length(record: dict[str, Any], completion: str) -> float:
    """A py: reward that varies between a random policy's samples: the completion's length."""
    return len(completion) / 10


def _prompts(directory: Path) -> TaskSpec:
    path = directory / "prompts.parquet"
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return TaskSpec(
        kind="jsonl", path=str(path), reward="py:tests.test_rl_hf_network:reward_length"
    )


def _get(url: str) -> Any:
    """GET as JSON, None on a refusal (a 429 from the rate limiter under load) or an error:
    the caller polls again before its deadline."""
    try:
        r = httpx.get(url, timeout=10)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


@contextlib.contextmanager
def in_process_trainer(data_dir: Path, policy: str) -> Iterator[str]:
    """A Trainer served by uvicorn in a thread of this process, on a free port."""
    import uvicorn

    from covey.rl.service import create_app
    from covey.rl.trainer import Trainer

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spec = RLSpec(**SPEC, task=_prompts(data_dir.parent), **pol.spec_defaults(policy))
    t = Trainer(data_dir, spec=spec, policy_dir=policy, url=url)
    OWNERS[url] = data_dir  # its key funds the keys the test stakes
    server = uvicorn.Server(
        uvicorn.Config(create_app(t), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    t.start()
    try:
        wait_for(lambda: _get(f"{url}/v1/rl/policy"), 60, "the trainer to serve")
        yield url
    finally:
        server.should_exit = True
        thread.join(20)
        t.stop()


@contextlib.contextmanager
def subprocess_trainer(data_dir: Path, policy: str) -> Iterator[str]:
    """`covey rl trainer --policy hf:DIR --spec TOML` as its own process."""
    task = _prompts(data_dir.parent)
    spec = "".join(f"{k} = {v}\n" for k, v in SPEC.items())
    spec += f'[task]\nkind = "jsonl"\npath = "{task.path}"\nreward = "{task.reward}"\n'
    # torch + transformers imports on a loaded machine
    with trainer_process(data_dir, spec, policy=policy, serve_timeout_s=180) as url:
        yield url


def _accepted_and_trained_on(url: str, policy_dir: Path) -> None:
    run = _get(f"{url}/v1/rl/spec")
    desc = run["model"]
    assert desc["arch"] == "hf" and desc["config"]["model_type"] == "gpt2"
    assert run["spec"]["eos_id"] == dir_newline_id(policy_dir)  # "\n" of its tokenizer
    v = RolloutValidator(url, Identity.generate(), name="v-hf")
    fund(url, v.identity.public_key, v.stake)  # it joins in run_loop
    thread = threading.Thread(target=v.run_loop, kwargs={"poll_s": 0.1}, daemon=True)
    thread.start()
    try:
        w = RolloutWorker(url, Identity.generate(), name="w-hf")
        join_funded(url, w, "worker")
        info = wait_for(lambda: _get(f"{url}/v1/rl/policy"), 30, "the policy")
        assert w.step(info) is not None
        me = w.identity.peer_id

        def mine() -> list[dict[str, Any]]:
            rows = _get(f"{url}/v1/rl/batches") or []
            return [b for b in rows if b["worker_id"] == me]

        row = wait_for(
            lambda: next((b for b in mine() if b["status"] not in ("pending", "claimed")), None),
            60,
            "a verdict on the HF batch",
        )
        assert row["status"] in ("accepted", "consumed"), row
        new = wait_for(
            lambda: (p := _get(f"{url}/v1/rl/policy")) and p["version"] > info["version"] and p,
            60,
            "version v+1",
        )
        wait_for(lambda: mine()[0]["status"] == "consumed", 30, "the batch to be trained on")
        assert new["cid"] != info["cid"]
        blob = httpx.get(f"{url}/v1/blobs/{new['cid']}", timeout=30).content
        updated = pol.load_weights(pol.build_policy(desc), blob)  # a peer can load v+1
        assert pol.policy_bytes(updated) == blob
        w.membership.leave()
    finally:
        v.stop.set()
        thread.join(20)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_policy(tmp_path_factory.mktemp("hfnet") / "gpt2", "gpt2")


def test_hf_policy_batches_are_accepted_and_trained_on(hf_dir: Path, tmp_path: Path) -> None:
    with in_process_trainer(tmp_path / "run", f"hf:{hf_dir}") as url:
        _accepted_and_trained_on(url, hf_dir)


@pytest.mark.long
def test_hf_policy_trainer_process(hf_dir: Path, tmp_path: Path) -> None:
    with subprocess_trainer(tmp_path / "run", f"hf:{hf_dir}") as url:
        _accepted_and_trained_on(url, hf_dir)
