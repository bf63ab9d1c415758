"""`covey validator --aggregate`: a validator that also aggregates its drawn shards.

A staked validator is in every sharded round's draw (covey.coordinator.shard_rounds). This
loop, on its own thread beside the re-execution loop (a long re-execution must not make
it miss a shard's publish deadline), polls `GET /v1/shards` and does this key's work on
the pending board (covey.peer.aggregator.ShardAggregator.poll): aggregate the shards it
was drawn first for, check the ones it was drawn to check. Its new shards are served from
a blob server of its own, which the coordinator and the workers fetch them from.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from covey.algorithms import TrainState
from covey.blobs import BlobServer, BlobStore
from covey.config import DiLoCoConfig, RunConfig, StreamingDiLoCoConfig
from covey.peer.aggregator import ShardAggregator
from covey.trust.identity import Identity

log = logging.getLogger("covey.aggregator")

#: shard blobs kept for late fetchers, in rounds' worth (older ones are deleted)
KEEP_ROUNDS = 3


def unsupported(cfg: RunConfig) -> str | None:
    """Why this run has no shards to aggregate, or None."""
    if not cfg.trust.sharded_above_peers:
        return "the run does not shard (trust.sharded_above_peers is off)"
    algo = cfg.algorithm
    if not isinstance(algo, DiLoCoConfig) or isinstance(algo, StreamingDiLoCoConfig):
        return f"sharded aggregation supports DiLoCo only, not {algo.method!r}"
    return None


class AggregatorLoop:
    """Poll and aggregate until `stop` is set; `close` stops serving and removes the blobs.

    OSError when the blob server cannot bind `host`:`port`."""

    def __init__(
        self,
        coordinator: str,
        identity: Identity,
        run_id: str,
        cfg: RunConfig,
        strategy: Any,
        template: TrainState,
        stop: threading.Event,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self.template, self.stop, self.poll_s = template, stop, poll_s
        self.shards = cfg.trust.shards
        self.dir = Path(tempfile.mkdtemp(prefix="covey-aggregator-"))
        self.store = BlobStore(self.dir)
        self.server = BlobServer(self.store, host, port)
        served = self.server.start()
        port = served.rsplit(":", 1)[1]
        self.url = served if advertise_host is None else f"http://{advertise_host}:{port}"
        self.agg = ShardAggregator(
            coordinator,
            identity,
            run_id,
            strategy,
            cfg.algorithm,
            self.store,
            self.url,  # type: ignore[arg-type]
        )
        self.thread = threading.Thread(target=self._loop, name="aggregator", daemon=True)
        self.thread.start()
        log.info("aggregating drawn shards; serving them at %s", self.url)

    def _loop(self) -> None:
        while not self.stop.wait(self.poll_s):
            try:
                for line in self.agg.poll(self.template):
                    log.info("[aggregator] %s", line)
                self._prune()
            except Exception as e:  # the next poll tries again; a ban ends the loop
                if "excluded" in str(e):
                    log.error("[aggregator] refused by the coordinator: %s", e)
                    return
                log.warning("[aggregator] %s", e)

    def _prune(self) -> None:
        cids = self.store.cids()
        keep = KEEP_ROUNDS * self.shards
        if len(cids) > keep:
            by_age = sorted(cids, key=lambda c: self.store.path(c).stat().st_mtime)
            for cid in by_age[: len(cids) - keep]:
                self.store.delete(cid)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.agg.close()
        self.server.close()
        shutil.rmtree(self.dir, ignore_errors=True)
