"""The coordinator's blob plane as a component (covey.coordinator.uploads.Blobs), without
a process: the upload gate over a real SQLite database and a real store. The same checks
are attacked over HTTP in test_dos.py (and a ban in test_banned.py, long)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from covey.blobs import BlobClient, BlobStore
from covey.blobs.client import upload_headers
from covey.config import load_run_config
from covey.coordinator.db import Database
from covey.coordinator.rejected import Rejected
from covey.coordinator.uploads import Blobs
from covey.protocol.content import content_id
from covey.trust.identity import Identity

RUN = "ab" * 8
SIZES = {64: "contribution", 96: "local state"}


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Blobs, dict[str, Identity]]]:
    spec = tmp_path / "run.toml"
    spec.write_text('name = "blobs"\n[limits]\nmax_pending_uploads = 2\n')
    db = Database(tmp_path / "coordinator.db")
    keys = {name: Identity.generate() for name in ("member", "banned", "gone")}
    with db.transaction() as c:
        for name, key in keys.items():
            state = "left" if name == "gone" else "live"
            c.execute(
                "INSERT INTO peers (peer_id, public_key, name, role, state) "
                "VALUES (?, ?, ?, 'worker', ?)",
                (key.peer_id, key.public_key, name, state),
            )

    def check_not_banned(peer_id: str) -> None:
        if peer_id == keys["banned"].peer_id:
            raise Rejected(403, f"peer {peer_id[:12]} was excluded from this run for fraud")

    fetcher = BlobClient(timeout_s=2, retries=1)
    blobs = Blobs(
        db,
        load_run_config(spec),
        BlobStore(tmp_path / "blobs"),
        fetcher,
        SIZES,
        check_not_banned,
        run_id=RUN,
    )
    yield blobs, keys
    fetcher.close()
    db.close()


def admit(blobs: Blobs, key: Identity, data: bytes) -> object:
    cid = content_id(data)
    headers = {k.lower(): v for k, v in upload_headers(key, RUN, cid, len(data)).items()}
    return blobs.admit(cid, headers, str(len(data)))


def refused(status: int, words: str, call: object, *args: object) -> None:
    with pytest.raises(Rejected) as e:
        call(*args)  # type: ignore[operator]
    assert e.value.status == status and words in e.value.message, e.value.message


def test_the_gate_admits_members_of_sizes_the_model_implies(
    world: tuple[Blobs, dict[str, Identity]],
) -> None:
    blobs, keys = world
    data = bytes(range(64))
    ticket = admit(blobs, keys["member"], data)
    writer = blobs.writer(ticket)  # type: ignore[arg-type]
    writer.write(data)
    writer.commit()
    blobs.done(ticket, stored=True)  # type: ignore[arg-type]
    assert blobs.store.has(content_id(data)) and blobs.is_payload_size(64)
    assert blobs.is_local_state_size(96) and not blobs.is_payload_size(96)
    refused(403, "excluded", admit, blobs, keys["banned"], bytes(64))  # banned: nothing stored
    refused(403, "is left", admit, blobs, keys["gone"], bytes(64))
    refused(413, "this run's blobs are", admit, blobs, keys["member"], bytes(65))
    refused(403, "only members", admit, blobs, Identity.generate(), bytes(64))
    # pending: max_pending_uploads (2) blobs no submission names, then 429 until named
    second = admit(blobs, keys["member"], bytes([1]) * 64)
    blobs.done(second, stored=True)  # type: ignore[arg-type]
    refused(429, "no submission names", admit, blobs, keys["member"], bytes([2]) * 64)
    blobs.named(keys["member"].peer_id, [content_id(data)])
    blobs.done(admit(blobs, keys["member"], bytes([2]) * 64), stored=False)  # type: ignore[arg-type]


def test_fetch_from_peer_needs_a_server_and_the_right_size(
    world: tuple[Blobs, dict[str, Identity]],
) -> None:
    blobs, keys = world
    member = keys["member"].peer_id
    t0 = time.monotonic()
    refused(409, "was not uploaded", blobs.fetch_from_peer, member, "cd" * 32, 64)
    data = bytes(range(64))
    cid = blobs.store.put(data)  # uploaded already: no fetch, but the size must match
    blobs.fetch_from_peer(member, cid, 64)
    refused(422, "has 64 bytes, not 96", blobs.fetch_from_peer, member, cid, 96)
    assert time.monotonic() - t0 < 1  # no network: the peer serves no blobs
