"""/healthz and /metrics of a real coordinator process during a real run (one worker
process), scraped over HTTP and parsed with prometheus-client's own parser; plus the pure
label helpers."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from covey.coordinator.metrics import reason_label, route_label
from covey.local.cluster import LocalCluster
from covey.trust.identity import Identity, request_purpose

SPEC = """
name = "metrics"
seed = 5
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[algorithm]
method = "diloco"
inner_steps = 3
[rounds]
deadline_min_s = 5
deadline_max_s = 60
eval_batches = 1
"""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(http: httpx.Client) -> Samples:
    """Every sample of /metrics by (name, sorted labels), parsed as Prometheus parses it."""
    resp = http.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain"), resp.headers
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"no sample {key}; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


def test_reason_label_keeps_the_kind_and_drops_ids_and_numbers() -> None:
    assert reason_label("round 12's deadline has passed: late") == "round <n>'s deadline has passed"
    assert reason_label("contribution 0a1b2c3d4e5f is unusable: NaN") == (
        "contribution <id> is unusable"
    )
    assert (
        reason_label("claims 7 inner steps; assigned 4") == "claims <n> inner steps; assigned <n>"
    )
    assert reason_label("no contribution") == "no contribution"
    assert reason_label("round 9.0 is not open (open round: 4.1): late") == "round <n> is not open"
    assert reason_label("") == "unknown"
    assert len(reason_label("x" * 500)) == 80


def test_route_label_is_the_template_never_the_raw_path() -> None:
    class Route:
        path = "/v1/rounds/{round}/certificate"

    assert route_label({"route": Route()}) == "/v1/rounds/{round}/certificate"
    assert route_label({}) == "unmatched"


@pytest.mark.network
@pytest.mark.long  # ~14 s; /metrics is also read by test_dos.py and test_openapi.py
def test_healthz_and_metrics_move_during_a_run(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    with (
        LocalCluster(spec, tmp_path) as cluster,
        httpx.Client(base_url=cluster.url, timeout=10, trust_env=False) as http,
    ):
        cluster.start_coordinator()
        health = http.get("/healthz")
        assert health.status_code == 200 and health.json() == {"ok": True}
        before = scrape(http)
        assert value(before, "covey_rounds_committed_total") == 0
        assert value(before, "covey_contributions_accepted_total") == 0
        assert value(before, "covey_live_peers", role="worker") == 0
        height_before = value(before, "covey_ledger_height")
        assert height_before >= 1  # "run created"

        cluster.start_worker("w0")
        cluster.wait_for(lambda s: s["committed_rounds"] >= 2, 120, "2 committed rounds")
        # w0's own key signs a contribution to a round that is not open: an authenticated
        # refusal, recorded, that the rejected counter must show by its kind of reason
        key = Identity.load_or_create(cluster.key("w0"))
        late = 10**6
        body = {
            "run_id": http.get("/v1/run").json()["run_id"],
            "round": late,
            "attempt": 0,
            "peer_id": key.peer_id,
            "cid": "ab" * 32,
            "start_hash": "cd" * 32,
            "size": 1,
            "tokens": 1,
            "inner_steps": 1,
        }
        path = f"/v1/rounds/{late}/contributions"
        signed = key.sign_request(body, late, purpose=request_purpose(path))
        refused = http.post(path, json=signed)
        assert refused.status_code == 409 and "not open" in refused.text, refused.text
        # a raw path with a number must be counted under its template
        http.get("/v1/rounds/987654/certificate")
        assert http.get("/no/such/path").status_code == 404
        after = scrape(http)
        assert http.get("/healthz").status_code == 200
        host = http.get("/v1/host").json()  # what the status page's shared frame shows
        assert host["live"]["worker"] == 1 and host["ledger"]["length"] > height_before
        assert '<script src="/frame.js">' in http.get("/").text

    assert value(after, "covey_rounds_committed_total") >= 2
    assert value(after, "covey_round") >= 2
    assert value(after, "covey_contributions_accepted_total") >= 2
    assert value(after, "covey_contribution_bytes_total") > 0
    assert value(after, "covey_tokens_total") > 0
    assert value(after, "covey_live_peers", role="worker") == 1
    assert value(after, "covey_ledger_height") > height_before
    assert value(after, "covey_disputes_open") == 0
    # the decentralization multiplier: a worker's compute is useful, the rest is booked
    assert value(after, "covey_decentralization_multiplier") >= 1.0
    assert value(after, "covey_peer_seconds_total", part="useful") > 0
    assert value(after, "covey_contributions_rejected_total", reason="round <n> is not open") >= 1

    template = "/v1/rounds/{round}/certificate"
    assert value(after, "covey_http_requests_total", method="GET", route=template, status="404")
    assert (
        value(after, "covey_http_request_duration_seconds_count", method="POST", route="/v1/join")
        >= 1
    )
    assert value(after, "covey_http_received_bytes_total", route="/v1/join") > 0
    assert value(after, "covey_http_sent_bytes_total", route="/v1/round") > 0
    assert (
        value(after, "covey_http_requests_total", method="GET", route="unmatched", status="404")
        >= 1
    )
    routes = {dict(labels).get("route") for name, labels in after if name.startswith("covey_http")}
    assert not any(r and "987654" in r for r in routes), routes
