"""The API says what it does: schemathesis, run against the OpenAPI
document that a real coordinator process serves, finds no undocumented status code,
content type, header or body shape, no 5xx, and no request the schema forbids that the
server accepts. Plus direct probes of what the fuzzer once found: integers too large for
SQLite were a 500, and strings were taken for numbers the schema says are numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from covey.coordinator.openapi import document, errors
from covey.local.cluster import LocalCluster
from covey.protocol import schemas

SPEC = """
name = "openapi"
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
[rounds]
deadline_min_s = 120
deadline_max_s = 120
eval_batches = 1
[limits]
max_json_bytes = 4096
max_blob_bytes = 1048576
# the fuzzer is one client sending ~1500 requests: rate limits stay documented (429) but
# must not answer for the endpoints under test
address_rate = 10000
address_burst = 10000
peer_rate = 10000
peer_burst = 10000
"""
# a long-poll would hold each generated request up to 30 s: the fuzzer asks without one
SCHEMATHESIS_TOML = """
[checks.negative_data_rejection]
expected-statuses = ["4xx"]

[[operations]]
include-path = "/v1/rounds/{round}/certificate"
parameters = { wait = 0 }

[[operations]]
include-path = "/v1/round"
parameters = { wait = 0 }
"""
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "negative_data_rejection",
)
# per operation in the fuzzing phase; the coverage phase adds its own boundary cases (~1100
# in all). The stateful phase is left out: the document has no links for it to follow, and
# it cost a fifth of the time. ~15 s on 2 idle cores, ~45 s on 2 cores at load 15.
MAX_EXAMPLES = 20
PHASES = "coverage,fuzzing"
SIGNED = (
    "/v1/join",
    "/v1/heartbeat",
    "/v1/leave",
    "/v1/halt",
    "/v1/verify/claim",
    "/v1/verify/report",
)


def test_document_adds_what_no_route_declares() -> None:
    """Pure: a plain FastAPI app with one signed POST and one GET gets the middleware's,
    the server's and authentication's codes, all with the ErrorReply body."""
    app = FastAPI()

    @app.post("/v1/leave")
    def leave(req: schemas.LeaveRequest) -> dict[str, Any]:
        return {}

    @app.get("/v1/thing", responses=errors(404))
    def thing() -> dict[str, Any]:
        return {}

    document(app, "0123456789abcdef")
    doc = app.openapi()
    post = doc["paths"]["/v1/leave"]["post"]["responses"]
    get = doc["paths"]["/v1/thing"]["get"]["responses"]
    everywhere = {"200", "408", "413", "429", "503"}
    assert set(post) == everywhere | {"400", "401", "403", "404", "409", "410", "422"}
    assert set(get) == everywhere | {"404"}  # no body and no parameters: no 400 or 422
    assert doc["components"]["schemas"]["LeaveRequest"]["properties"]["run_id"]["enum"] == [
        "0123456789abcdef"
    ]
    error = {"$ref": "#/components/schemas/ErrorReply"}
    assert all(post[c]["content"]["application/json"]["schema"] == error for c in ("401", "422"))
    assert post["429"]["headers"]["Retry-After"]
    assert app.openapi() is doc  # built once


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("openapi")
    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    with LocalCluster(spec, tmp) as c:
        c.start_coordinator()
        yield c


@pytest.fixture(scope="module")
def http(cluster: LocalCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.url, timeout=10, trust_env=False) as client:
        yield client


@pytest.fixture(scope="module")
def doc(http: httpx.Client) -> dict[str, Any]:
    resp = http.get("/openapi.json")
    assert resp.status_code == 200
    return resp.json()


@pytest.mark.network
def test_every_operation_documents_its_refusals(doc: dict[str, Any]) -> None:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            codes = set(op["responses"])
            where = f"{method.upper()} {path}"
            assert {"408", "413", "429", "503"} <= codes, where  # middleware and server
            assert "text/plain" in op["responses"]["503"]["content"], where  # uvicorn's
            for code, reply in op["responses"].items():
                if code.startswith("4"):
                    schema = reply["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorReply"}, where
    for path in SIGNED:
        codes = set(doc["paths"][path]["post"]["responses"])
        assert {"200", "400", "401", "403", "404", "409", "410", "422", "429"} <= codes, path
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # never sent


@pytest.mark.network
def test_blob_endpoints_document_bytes(doc: dict[str, Any]) -> None:
    blob = doc["paths"]["/v1/blobs/{cid}"]
    octet = "application/octet-stream"
    assert octet in blob["put"]["requestBody"]["content"]
    assert {"400", "401", "403", "411", "413", "429"} <= set(blob["put"]["responses"])
    for method in ("get", "head"):
        replies = blob[method]["responses"]
        assert octet in replies["200"]["content"] and octet in replies["206"]["content"]
        assert "Content-Range" in replies["206"]["headers"]
        assert {"404", "416"} <= set(replies)
    cid = next(p for p in blob["get"]["parameters"] if p["name"] == "cid")
    assert cid["schema"]["pattern"] == "^[0-9a-f]{64}$"


@pytest.mark.network
def test_request_schemas_say_what_the_server_enforces(
    doc: dict[str, Any], http: httpx.Client
) -> None:
    schemas = doc["components"]["schemas"]
    run_id = http.get("/v1/run").json()["run_id"]
    assert schemas["HeartbeatRequest"]["properties"]["run_id"]["enum"] == [run_id]
    assert schemas["HeartbeatRequest"]["additionalProperties"] is False
    sketch = schemas["CommitmentIn"]["properties"]["sketch"]
    assert sketch["additionalProperties"] is False  # only the pattern's keys, as enforced
    assert schemas["ContributionRequest"]["properties"]["round"]["maximum"] == 2**53 - 1


@pytest.mark.network
def test_out_of_range_integers_are_refused_not_a_server_error(http: httpx.Client) -> None:
    huge = 2**70  # past SQLite's INTEGER: was a 500 (OverflowError) before the bounds
    for path, params in (
        (f"/v1/rounds/{huge}/certificate", {}),
        ("/v1/ledger", {"start": huge}),
        ("/v1/ledger/receipt", {"round": huge, "peer_id": "0" * 32}),
        ("/v1/rounds/-1/certificate", {}),
    ):
        resp = http.get(path, params=params)
        assert resp.status_code == 422, (path, resp.text)
        assert resp.json()["error"] == "invalid request"


@pytest.mark.network
def test_values_of_the_wrong_json_type_are_refused(http: httpx.Client) -> None:
    """A string for a number or a number for a bool is what the schema forbids; lax
    parsing used to take "0.5" as 0.5 and 1 as true. An integral 2.0 is an integer."""
    run_id = http.get("/v1/run").json()["run_id"]
    base = {
        "run_id": run_id,
        "peer_id": "0" * 32,
        "public_key": "0" * 64,
        "step_time_s": 0.5,
        "nonce": "0" * 13 + "-" + "0" * 16,
        "signature": "0" * 128,
    }
    for field, bad in (("step_time_s", "0.5"), ("accepts_connections", 1), ("stake", "1")):
        resp = http.post("/v1/join", json={**base, field: bad})
        assert resp.status_code == 422, (field, resp.text)
        assert field in " ".join(resp.json()["problems"])
    # well-formed (an integral float where an integer goes): refused later, by the checks
    contribution = {
        **{k: base[k] for k in ("run_id", "peer_id", "nonce", "signature")},
        "round": 0.0,
        "attempt": 0,
        "cid": "a" * 64,
        "start_hash": "b" * 64,
        "size": 8.0,
        "tokens": 1,
        "inner_steps": 1,
    }
    resp = http.post("/v1/rounds/0/contributions", json=contribution)
    assert resp.status_code in (401, 404), resp.text  # unknown peer: authentication


@pytest.mark.network
@pytest.mark.long  # a fuzzing run; every operation's documented refusals run by default
def test_schemathesis_finds_no_conformance_failure(cluster: LocalCluster, tmp_path: Path) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_TOML)
    junit = tmp_path / "junit.xml"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
        "--config-file",
        str(config),
        "run",
        f"{cluster.url}/openapi.json",
        "--checks",
        ",".join(CHECKS),
        "--phases",
        PHASES,
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        "1",  # the same cases every run: a failure here is reproducible, never flaky
        "--generation-database",
        "none",
        "--workers",
        "1",
        "--request-timeout",
        "10",
        "--no-color",
        "--report",
        "junit",
        "--report-junit-path",
        str(junit),
    ]
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost"}
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        env.pop(key, None)
    run = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-8000:]
    suites = ET.parse(junit).getroot()
    cases = suites.findall(".//testcase")
    failed = [c.get("name") for c in cases if c.find("failure") is not None]
    errored = [c.get("name") for c in cases if c.find("error") is not None]
    assert not failed and not errored, (failed, errored, output[-4000:])
    tested = {c.get("name") for c in cases}
    for operation in ("POST /v1/join", "PUT /v1/blobs/{cid}", "GET /metrics", "GET /healthz"):
        assert operation in tested, sorted(tested)
