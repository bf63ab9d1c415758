"""A peer excluded for fraud is refused everywhere, through the HTTP API of a real
coordinator process: a worker that sends noise is caught by a validator process, the
referee convicts it (a slash that bans it, in the ledger), and then its own key's signed
upload, submission and heartbeat are all refused (403) and store nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from covey.algorithms.codecs import get_codec
from covey.blobs.client import upload_headers
from covey.local.cluster import LocalCluster
from covey.protocol.content import content_id
from covey.trust.identity import NO_ROUND, Identity, request_purpose

pytestmark = [pytest.mark.network, pytest.mark.long]  # ~90 s: a catch, a verdict, a ban

SPEC = """
name = "banned"
seed = 3
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 32
[algorithm]
method = "diloco"
inner_steps = 4
codec = "fp32"
inner_state = "reset"
[rounds]
deadline_min_s = 3
eval_batches = 1
max_rounds = 30
[trust]
sample_rate = 1.0
min_stake = 10.0
commit_every = 2
"""
NUMEL = 120_576  # nano GPT's parameters: an fp32 contribution is a size this run takes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp: Path = tmp_path_factory.mktemp("banned")
    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    with LocalCluster(spec, tmp) as c:
        c.start_coordinator()
        c.start_worker("cheat", "--stake", "20", "--behavior", "noise")
        c.start_validator("checker")
        yield c


def test_a_banned_peer_uploads_and_submits_nothing(cluster: LocalCluster) -> None:
    cheat = Identity.load_or_create(cluster.key("cheat"))
    give_up = time.monotonic() + 120
    while True:  # the validator's catch, the referee's verdict, the slash: polled
        account = cluster.get("/v1/ledger/balances")["accounts"].get(cheat.peer_id, {})
        if account.get("banned"):
            break
        assert time.monotonic() < give_up, f"the noise worker was not banned: {account}"
        time.sleep(0.5)
    http = httpx.Client(base_url=cluster.url, timeout=20, trust_env=False)
    run_id = cluster.run_id
    data = get_codec("fp32").encode(torch.full((NUMEL,), 3e-4))
    cid = content_id(data)
    # a well-signed upload of a size the model implies: refused before the body is stored
    resp = http.put(
        f"/v1/blobs/{cid}", content=data, headers=upload_headers(cheat, run_id, cid, len(data))
    )
    assert resp.status_code == 403 and "excluded" in resp.json()["error"], resp.text
    assert http.get(f"/v1/blobs/{cid}").status_code == 404
    # a signed submission naming it, and a heartbeat: refused the same way
    info = http.get("/v1/round").json()
    rnd = max(info.get("round") or 0, 0)
    body = {
        "run_id": run_id,
        "round": rnd,
        "attempt": info.get("attempt") or 0,
        "peer_id": cheat.peer_id,
        "cid": cid,
        "start_hash": info.get("start_hash") or "0" * 64,
        "size": len(data),
        "tokens": 4 * 32 * 4,
        "inner_steps": 4,
    }
    path = f"/v1/rounds/{rnd}/contributions"
    resp = http.post(path, json=cheat.sign_request(body, rnd, purpose=request_purpose(path)))
    assert resp.status_code == 403 and "excluded" in resp.json()["error"], resp.text
    beat = {"run_id": run_id, "peer_id": cheat.peer_id}
    purpose = request_purpose("/v1/heartbeat")
    resp = http.post("/v1/heartbeat", json=cheat.sign_request(beat, NO_ROUND, purpose=purpose))
    assert resp.status_code == 403, resp.text
    assert http.get(f"/v1/blobs/{cid}").status_code == 404
