"""Big blobs and states: they stream to disk in chunks, are hashed on
arrival, and never sit whole in a process's memory; a corrupt chunk is caught.

Real sockets on 127.0.0.1; the memory bound is measured as the peak RSS of a fresh
subprocess that fetches a 96 MiB blob in 4 MiB ranges.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from covey.algorithms import TrainState
from covey.blobs import BlobClient, BlobError, BlobServer, BlobStore, parse_range
from covey.protocol.checkpoint import (
    CheckpointError,
    max_state_bytes,
    safetensors_nbytes,
    state_from_bytes,
    state_from_file,
    state_to_bytes,
    state_to_file,
    write_state,
)
from covey.protocol.content import content_id, file_content_id

MIB = 1 << 20


def big_blob(store: BlobStore, size: int) -> str:
    """A `size`-byte blob of distinct 1 MiB pieces (written in pieces, not built in memory)."""
    tmp = store.scratch()
    with tmp.open("wb") as f:
        for i in range(size // MIB):
            f.write(i.to_bytes(8, "little") * (MIB // 8))
    return store.adopt(tmp)[0]


def leftovers(store: BlobStore) -> list[str]:
    return sorted(p.name for p in store.root.rglob(".tmp-*"))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[BlobStore, BlobServer, str]]:
    store = BlobStore(tmp_path / "source")
    with BlobServer(store) as server:
        yield store, server, server.url


class CorruptRanges:
    """A provider that serves `store`'s blobs with Range support, flipping one byte of
    every response that covers offset `bad_at` (a lying or broken peer)."""

    def __init__(self, store: BlobStore, bad_at: int) -> None:
        outer = self
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests += 1
                cid = self.path.rsplit("/", 1)[-1]
                size = store.size(cid)
                ranged = parse_range(self.headers.get("Range"), size)
                start, end = ranged or (0, size - 1)
                body = bytearray(store.read_range(cid, start, end))
                if start <= bad_at <= end:
                    body[bad_at - start] ^= 0xFF
                self.send_response(206 if ranged else 200)
                self.send_header("Content-Length", str(len(body)))
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


# ---- store: ranges, adoption, views ---------------------------------------------------


def test_range_writer_takes_ranges_in_any_order_and_checks_the_hash(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, max_blob_bytes=1024)
    data = bytes(range(256)) * 40  # 10240 bytes: over the cap, which binds uploads only
    cid = content_id(data)
    with pytest.raises(BlobError, match="max_blob_bytes"):
        store.range_writer(cid, len(data))
    w = store.range_writer(cid, len(data), capped=False)
    for start in (8192, 0, 4096):
        w.write_at(start, data[start : start + 4096])
    with pytest.raises(BlobError, match="outside"):
        w.write_at(10000, b"x" * 1000)
    w.commit()
    assert store.get(cid) == data and leftovers(store) == []

    bad = store.range_writer(content_id(b"abcd"), 4, capped=False)
    bad.write_at(0, b"abce")
    with pytest.raises(BlobError, match="hashes to"):
        bad.commit()
    short = store.range_writer(content_id(b"abcd"), 4, capped=False)
    short.write_at(0, b"ab")
    with pytest.raises(BlobError, match="2 of 4"):
        short.commit()
    assert not store.has(content_id(b"abcd")) and leftovers(store) == []


def test_adopt_stores_own_files_of_any_size_and_view_maps_them(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, max_blob_bytes=1024)
    cid = big_blob(store, 2 * MIB)  # 2048x the upload cap: the store's own data is not capped
    assert store.size(cid) == 2 * MIB and file_content_id(store.path(cid)) == cid
    view = store.view(cid)
    assert len(view) == 2 * MIB and bytes(view[MIB : MIB + 8]) == (1).to_bytes(8, "little")
    tmp = store.scratch()
    tmp.write_bytes(b"same bytes twice")
    first = store.adopt(tmp)
    tmp = store.scratch()
    tmp.write_bytes(b"same bytes twice")
    assert store.adopt(tmp) == first and not tmp.exists()  # immutable: stored once
    assert bytes(store.view(store.put(b""))) == b""
    with pytest.raises(BlobError, match="not stored"):
        store.view("0" * 64)
    assert leftovers(store) == []


# ---- fetch_into: streamed, chunked, verified ------------------------------------------


@pytest.mark.network
def test_fetch_into_streams_whole_and_ranged_bodies(
    served: tuple[BlobStore, BlobServer, str], tmp_path: Path
) -> None:
    source, _, url = served
    cid = big_blob(source, 12 * MIB)
    small = source.put(b"a small blob")
    dest = BlobStore(tmp_path / "dest", max_blob_bytes=MIB)  # the cap binds uploads only
    with BlobClient(chunk_bytes=MIB, parallel=3, retries=2, backoff_s=0.01) as c:
        path = c.fetch_into(dest, cid, [url], size=12 * MIB, max_bytes=16 * MIB)
        assert path == dest.path(cid) and file_content_id(path) == cid
        assert c.served[url] == 12 * MIB
        assert c.fetch_into(dest, cid, [url], size=12 * MIB) == path  # already here
        assert c.served[url] == 12 * MIB
        c.fetch_into(dest, small, [url])  # size unknown: whole body, hashed as it arrives
        assert dest.get(small) == b"a small blob"
        with pytest.raises(BlobError, match="exceeds max_bytes"):
            c.fetch_into(BlobStore(tmp_path / "d2"), cid, [url], size=12 * MIB, max_bytes=MIB)
    assert leftovers(dest) == []


@pytest.mark.network
def test_a_corrupt_chunk_is_caught_and_another_provider_used(
    served: tuple[BlobStore, BlobServer, str], tmp_path: Path
) -> None:
    source, _, honest = served
    cid = big_blob(source, 8 * MIB)
    liar = CorruptRanges(source, bad_at=5 * MIB + 17)  # inside the 6th 1 MiB chunk
    try:
        alone = BlobStore(tmp_path / "alone")
        with BlobClient(chunk_bytes=MIB, parallel=2, retries=1) as c:
            with pytest.raises(BlobError, match=r"hashes to|hashing to") as err:
                c.fetch_into(alone, cid, [liar.url], size=8 * MIB)
            assert liar.url in str(err.value)
        assert not alone.has(cid) and leftovers(alone) == []  # nothing stored under the id

        dest = BlobStore(tmp_path / "dest")
        with BlobClient(chunk_bytes=MIB, parallel=2, retries=1) as c:
            path = c.fetch_into(dest, cid, [liar.url, honest], size=8 * MIB)
        assert file_content_id(path) == cid and leftovers(dest) == []
    finally:
        liar.close()


_FETCH_AND_MEASURE = """
import json, resource, sys
from pathlib import Path
from covey.blobs import BlobClient, BlobStore
url, cid, size, dest = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with BlobClient(chunk_bytes=4 << 20, parallel=4, timeout_s=20.0) as c:
    path = c.fetch_into(BlobStore(Path(dest)), cid, [url], size=size)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "after": after, "size": path.stat().st_size}))
"""


@pytest.mark.network
def test_a_96_mib_blob_moves_in_chunks_with_bounded_memory(
    served: tuple[BlobStore, BlobServer, str], tmp_path: Path
) -> None:
    """The fetching process's peak RSS grows by a fraction of the blob: 4 ranges of 4 MiB
    in flight, each written to disk piece by piece (the in-memory fetch would add >= 96 MiB)."""
    source, _, url = served
    size = 96 * MIB
    cid = big_blob(source, size)
    out = subprocess.run(
        [sys.executable, "-c", _FETCH_AND_MEASURE, url, cid, str(size), str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["size"] == size
    grew = got["after"] - got["before"]
    assert grew < 40 * MIB, f"peak RSS grew by {grew / MIB:.1f} MiB fetching {size / MIB} MiB"


# ---- states: streamed to and from files ---------------------------------------------------


def mixed_state() -> TrainState:
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64]
    params = {f"layer{i}.w": torch.randn(7, 5, generator=g).to(dt) for i, dt in enumerate(dtypes)}
    params["empty"] = torch.zeros(0, 3)
    outer = {"layer0.w": torch.randn(7, 5, generator=g), "step": torch.tensor(3.0)}
    return TrainState(params, outer, 4)


def test_write_state_is_byte_identical_to_state_to_bytes(tmp_path: Path) -> None:
    state = mixed_state()
    data = state_to_bytes(state)
    named = {f"params/{k}": v for k, v in state.params.items()}
    named |= {f"outer/{k}": v for k, v in state.outer.items()}
    meta = {"covey": json.dumps({"format": "covey-state-1", "round": 4}, sort_keys=True)}
    assert safetensors_nbytes(named, meta) == len(data)  # sized without serializing
    buf = io.BytesIO()
    assert write_state(state, buf) == (content_id(data), len(data))
    assert buf.getvalue() == data  # same bytes, so peers and coordinator agree on the cid
    cid, size = state_to_file(state, tmp_path / "s.safetensors")
    assert (cid, size) == (content_id(data), len(data))
    template = TrainState({k: torch.zeros_like(v) for k, v in state.params.items()}, {}, 0)
    back = state_from_file(tmp_path / "s.safetensors", template)
    assert back.digest() == state.digest() == state_from_bytes(data, template).digest()
    (tmp_path / "bad").write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="not a safetensors state"):
        state_from_file(tmp_path / "bad", template)
    assert max_state_bytes(template) > 3 * sum(
        v.numel() * v.element_size() for v in state.params.values()
    )


@pytest.mark.network
def test_a_state_over_the_blob_cap_is_stored_served_and_fetched(
    tmp_path: Path,
) -> None:
    """The coordinator's own state is not bounded by max_blob_bytes; a peer fetches it in
    ranges up to what the model implies (max_state_bytes) and parses it from disk."""
    params = {f"h{i}": torch.full((512, 512), float(i)) for i in range(8)}  # 8 MiB
    state = TrainState(params, {k: v * 0.5 for k, v in params.items()}, 2)
    coordinator = BlobStore(tmp_path / "coordinator", max_blob_bytes=MIB)
    tmp = coordinator.scratch()
    cid, size = coordinator.adopt(tmp, state_to_file(state, tmp)[0])
    assert size > 16 * MIB
    template = TrainState({k: torch.zeros_like(v) for k, v in params.items()}, {}, 0)
    with BlobServer(coordinator) as server, BlobClient(chunk_bytes=MIB, max_bytes=MIB) as c:
        dest = BlobStore(tmp_path / "peer", max_blob_bytes=MIB)
        path = c.fetch_into(dest, cid, [server.url], size, max_bytes=max_state_bytes(template))
    assert state_from_file(path, template).digest() == state.digest()


def test_local_state_size_is_computed_without_serializing() -> None:
    """The upload gate sizes a local state from shapes (a 124M model's is 1.5 GB)."""
    from covey.algorithms import build_strategy
    from covey.config import DiLoCoConfig
    from covey.models.gpt import GPT, gpt_config, lm_loss
    from covey.trust.verify import local_state_nbytes, local_state_to_bytes

    torch.manual_seed(0)
    model = GPT(gpt_config("nano"))
    strategy = build_strategy(DiLoCoConfig(inner_steps=2, error_feedback=True), model, lm_loss)
    state = strategy.local_state(copy=False)
    assert local_state_nbytes(state) == len(local_state_to_bytes(state))
