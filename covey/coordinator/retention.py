"""What the rounds coordinator keeps on disk: the last `rounds.keep_checkpoints` certified
checkpoints, and of the blob store only what a peer may still ask for."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from covey.blobs import BlobStore
from covey.config import RunConfig

from .db import Database

ORPHAN_GRACE_S = 600.0


def write_checkpoint(
    data_dir: Path, blobs: BlobStore, round_: int, cid: str, cfg: RunConfig
) -> None:
    """Copy state `cid` to `data_dir`/checkpoints/round-NNNNNN.safetensors; keep the
    newest cfg.rounds.keep_checkpoints of them."""
    folder = data_dir / "checkpoints"
    path = folder / f"round-{round_:06d}.safetensors"
    tmp = path.with_suffix(".tmp")
    shutil.copyfile(blobs.path(cid), tmp)  # the state's blob, copied in pieces
    tmp.replace(path)
    for old in sorted(folder.glob("round-*.safetensors"))[: -cfg.rounds.keep_checkpoints]:
        old.unlink(missing_ok=True)


def prune_blobs(db: Database, blobs: BlobStore, round_: int, keep: set[str]) -> None:
    """Drop blobs no peer needs any more. Kept: `keep` (the current state, the model's
    files, what verification still needs), the initial state, kept checkpoints, the last
    few rounds' states and contributions, and anything younger than ORPHAN_GRACE_S (an
    upload whose submission may still be on its way). Whatever else was uploaded, garbage
    included, goes."""
    recent = round_ - 3
    keep = keep | {db.get_meta("initial_cid")}  # type: ignore[operator]
    keep |= {r["cid"] for r in db.query("SELECT cid FROM checkpoints")}
    keep |= {
        r["new_cid"] for r in db.query("SELECT new_cid FROM rounds WHERE round >= ?", (recent,))
    }
    keep |= {
        r["cid"] for r in db.query("SELECT cid FROM contributions WHERE round >= ?", (recent,))
    }
    keep |= {  # recent end local states (the next rounds' committed starts)
        r["end_cid"]
        for r in db.query("SELECT end_cid FROM local_states WHERE round >= ?", (recent,))
    }
    cutoff = time.time() - ORPHAN_GRACE_S
    for cid in blobs.cids():
        if cid not in keep and blobs.modified(cid) < cutoff:
            blobs.delete(cid)
