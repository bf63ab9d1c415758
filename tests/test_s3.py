"""Blobs in an S3-compatible object store (covey.blobs.s3) against a real S3 HTTP server
(moto's, its own process on 127.0.0.1: the `s3` fixture), and a rounds run on PostgreSQL
and S3 whose coordinator is SIGKILLed and restarted on an empty data dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from covey.blobs import BlobClient, BlobError, S3BlobStore, open_store
from covey.blobs.s3 import parse_url
from covey.local.cluster import LocalCluster
from covey.protocol.content import content_id
from tests.services import Postgres, S3Server, nano_diloco_spec


@pytest.fixture
def aws(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """The standard environment variables pointing boto3 at the test server."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    yield s3


def test_urls() -> None:
    assert parse_url("s3://bucket") == ("bucket", "")
    assert parse_url("s3://my.bucket-1/runs/a/") == ("my.bucket-1", "runs/a/")
    for bad in ("s3://", "s3://UPPER/x", "file:///tmp", "s3://a"):
        with pytest.raises(ValueError, match="s3://bucket/prefix"):
            parse_url(bad)
    with pytest.raises(ValueError, match="leave it out"):
        open_store("gs://x", Path("/nonexistent"))


def test_a_missing_bucket_is_refused_clearly(aws: S3Server, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot reach bucket 'covey-no-such-bucket'"):
        S3BlobStore("s3://covey-no-such-bucket/x", tmp_path)


def test_blobs_reach_the_bucket_and_come_back_checked(aws: S3Server, tmp_path: Path) -> None:
    url = f"s3://{aws.bucket()}/run/1"
    store = S3BlobStore(url, tmp_path / "a", max_blob_bytes=1 << 20)
    small = store.put(b"a small blob")
    data = os.urandom(300_000)
    w = store.writer(content_id(data), len(data))  # a streamed upload, as from a peer
    for i in range(0, len(data), 65536):
        w.write(data[i : i + 65536])
    w.commit()
    scratch = store.scratch()
    scratch.write_bytes(b"a state the coordinator wrote")
    adopted, _ = store.adopt(scratch)  # uncapped: the owner's own states
    keys = {o["Key"] for o in aws.client().list_objects_v2(Bucket=store.bucket)["Contents"]}
    assert keys == {f"run/1/{c[:2]}/{c}" for c in (small, content_id(data), adopted)}
    # an empty cache (a coordinator on a fresh data dir) finds every blob in the bucket
    fresh = S3BlobStore(url, tmp_path / "b")
    assert fresh.has(content_id(data)) and fresh.size(content_id(data)) == len(data)
    assert not (tmp_path / "b" / content_id(data)[:2]).exists()  # asked, not downloaded
    assert fresh.get(content_id(data)) == data and fresh.read_range(small, 2, 6) == b"small"
    assert fresh.cids() == sorted([small, content_id(data), adopted])
    assert not fresh.has("f" * 64) and not fresh.has("../x")
    with pytest.raises(BlobError, match="max_blob_bytes"):
        store.put(os.urandom((1 << 20) + 1))  # still capped
    # a copy in the bucket that is not its content id is never handed out
    aws.client().put_object(Bucket=store.bucket, Key=fresh.key(small), Body=b"tampered")
    other = S3BlobStore(url, tmp_path / "c")
    with pytest.raises(BlobError, match="hashes to"):
        other.get(small)
    assert list((tmp_path / "c").rglob("*")) == [tmp_path / "c" / small[:2]]  # nothing kept
    assert fresh.modified(adopted) > 0  # asked of the bucket, not downloaded:
    fresh.delete(adopted)  # from the bucket, without fetching it first
    assert not (tmp_path / "b" / adopted[:2] / adopted).exists()
    assert not S3BlobStore(url, tmp_path / "d").has(adopted)


def test_a_presigned_url_serves_ranges_to_a_redirected_client(
    aws: S3Server, tmp_path: Path
) -> None:
    """What a peer does with the coordinator's 307: the blob client follows one redirect
    from a provider it was told to trust, and only from it, and checks the bytes."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    store = S3BlobStore(f"s3://{aws.bucket()}/p", tmp_path)
    data = os.urandom(200_000)
    cid = store.put(data)
    got = httpx.get(store.presigned_url(cid), headers={"Range": "bytes=10-19"})
    assert got.status_code == 206 and got.content == data[10:20]

    class Redirect(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(307)
            self.send_header("Location", store.presigned_url(self.path.rsplit("/", 1)[1]))
            self.send_header("Content-Length", "0")
            self.end_headers()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    coordinator = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        trusting = BlobClient(chunk_bytes=64 << 10, redirects_from=[coordinator])
        assert trusting.fetch(cid, [coordinator], size=len(data)) == data  # ranged chunks
        assert trusting.fetch(cid, [coordinator]) == data  # whole
        with pytest.raises(BlobError, match="HTTP 307"):
            BlobClient().fetch(cid, [coordinator])  # not told to trust it: not followed
    finally:
        httpd.shutdown()
        httpd.server_close()


SPEC = nano_diloco_spec("test-s3", deadline_min_s=4, eval_batches=2, checkpoint_every=2)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.long  # ~70 s here; tests/test_postgres.py resumes a coordinator in-process
def test_a_run_on_postgres_and_s3_survives_sigkill_onto_an_empty_data_dir(
    postgres: Postgres, s3: S3Server, tmp_path: Path
) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    bucket = s3.bucket()
    args = ["--db", postgres.database(), "--blobs", f"s3://{bucket}/run"]
    cluster = LocalCluster(
        spec, tmp_path, env=s3.env, coordinator_args=args, key=tmp_path / "secret" / "c.key"
    )
    moto_log = Path(s3.log_path)

    def presigned_gets() -> int:  # moto logs every request it serves
        lines = moto_log.read_text(errors="replace").splitlines()
        return sum(f'"GET /{bucket}/run/' in line and "Signature=" in line for line in lines)

    with cluster:
        cluster.start_coordinator()
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        before = cluster.wait_for(
            lambda s: s["committed_rounds"] >= 2 and s["phase"] == "open", 240, "2 rounds"
        )
        # the workers took the state from the object store, by presigned URL
        assert presigned_gets() >= 1
        cluster.signal("coordinator", signal.SIGKILL)
        cluster.wait_exit("coordinator", 10)
        cluster.data_dir = (tmp_path / "fresh-data-dir").resolve()  # nothing on local disk
        cluster.start_coordinator()
        after = cluster.status()
        assert after["committed_rounds"] >= before["committed_rounds"]
        status = cluster.wait_for(
            lambda s: s["committed_rounds"] >= after["committed_rounds"] + 2,
            240,
            "2 rounds after the restart on an empty data dir",
        )
        certs = [
            cluster.get(f"/v1/rounds/{r}/certificate") for r in range(status["committed_rounds"])
        ]
        verify = subprocess.run(
            [sys.executable, "-m", "covey", "ledger", "verify", cluster.url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr
    assert [c["round"] for c in certs] == list(range(len(certs)))
    assert not (tmp_path / "fresh-data-dir" / "coordinator.db").exists()
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert "resumed run" in log


def test_the_scale_compose_file_passes_flags_the_cli_has() -> None:
    """compose.scale.yaml (no container runtime here to run it): PostgreSQL, MinIO with
    its bucket, and a coordinator given both, every flag one `covey coordinator` has."""
    yaml = pytest.importorskip("yaml")
    from typer.main import get_command

    from covey.cli import app

    root = Path(__file__).resolve().parents[1]
    services = yaml.safe_load((root / "compose.scale.yaml").read_text())["services"]
    command = services["coordinator"]["command"]
    flags = dict(f.split("=", 1) for f in command if f.startswith("--"))
    env = services["postgres"]["environment"]
    assert flags["--db"] == (
        f"postgresql://{env['POSTGRES_USER']}:{env['POSTGRES_PASSWORD']}@postgres/"
        f"{env['POSTGRES_DB']}"
    )
    bucket = parse_url(flags["--blobs"])[0]
    assert f"local/{bucket}" in services["make-bucket"]["entrypoint"][-1]
    assert services["coordinator"]["environment"]["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert (root / command[1].replace("/configs/", "configs/")).is_file()
    known = {opt for p in get_command(app).commands["coordinator"].params for opt in p.opts}  # type: ignore[attr-defined]
    assert set(flags) <= known, set(flags) - known
    assert 'ARG EXTRAS=""' in (root / "Dockerfile").read_text()


def test_the_scale_compose_file_agrees_with_the_cli_on_ports_env_and_services() -> None:
    """What else of compose.scale.yaml could rot unseen: the coordinator listens on every
    address at the port the file publishes; its environment is the AWS SDK's names that
    covey's --blobs help and covey.blobs.s3 name, with MinIO's own credentials; every
    service it depends on exists; its --key sits on a volume, its --data-dir does not."""
    yaml = pytest.importorskip("yaml")
    from typer.main import get_command

    from covey.blobs import s3 as s3_store
    from covey.cli import app
    from covey.coordinator.storage import BLOBS_HELP

    root = Path(__file__).resolve().parents[1]
    compose = yaml.safe_load((root / "compose.scale.yaml").read_text())
    services = compose["services"]
    coordinator = services["coordinator"]
    command = coordinator["command"]
    flags = dict(f.split("=", 1) for f in command if f.startswith("--"))
    cli = get_command(app).commands[command[0]]  # type: ignore[attr-defined]
    params = {opt: p for p in cli.params for opt in p.opts}
    assert params["--port"].default == int(flags["--port"])  # covey's default port too
    assert flags["--host"] == "0.0.0.0"
    published = [str(p).rsplit(":", 1) for p in coordinator["ports"]]
    assert [container for _, container in published] == [flags["--port"]]
    env = coordinator["environment"]
    sdk = {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}
    assert set(env) == sdk
    source = Path(s3_store.__file__).read_text()
    for name in sdk:
        assert name in source, name  # the names covey's S3 store documents and asks for
    assert "AWS_ENDPOINT_URL" in BLOBS_HELP and "AWS_ACCESS_KEY_ID" in BLOBS_HELP
    minio = services["minio"]["environment"]
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (
        minio["MINIO_ROOT_USER"],
        minio["MINIO_ROOT_PASSWORD"],
    )
    assert set(coordinator["depends_on"]) <= set(services)
    mounts = {v.split(":")[1] for v in coordinator["volumes"]}
    assert str(Path(flags["--key"]).parent) in mounts  # the run id covers the key: kept
    assert not any(flags["--data-dir"].startswith(m) for m in mounts)  # a cache only
    for name in compose.get("volumes", {}):
        assert any(name in str(v) for s in services.values() for v in s.get("volumes", []))
