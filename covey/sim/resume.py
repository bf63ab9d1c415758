"""`covey sim --resume`: the simulator's checkpoint after each round, and resuming from it.

A snapshot is everything the next round depends on: the canonical state, each worker's
membership, local state (`Strategy.local_state`, which restores bit for bit) and byte
counters, the churn schedule's RNG, the records so far and the running totals. A run
resumed from round k's snapshot therefore continues exactly as the uninterrupted run would
have (bit for bit when compute is modelled, `compute.step_time_s`; measured times differ).

On disk, ``<run dir>/checkpoint/``: ``tensors.safetensors`` (no pickle) and ``sim.json``,
written after the tensors, each through a temporary file and an atomic rename: a run killed
mid-write leaves the previous snapshot, or (json and tensors of different rounds) one that
`load_snapshot` refuses with `SnapshotError`. sim.json records the tensors file's sha256
(checked on load: a flipped byte is refused); a snapshot written before it did loads
unchecked.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from covey.errors import UserError
from covey.guards import check_sha256, sha256_file

if TYPE_CHECKING:  # torch loads only when a snapshot is taken or read (cli: --help stays fast)
    import torch

    from covey.algorithms import Strategy, TrainState

FORMAT = 1
COUNTERS = ("sim_time", "compute_total", "wall_total", "tokens", "val_loss", "initial_val_loss")


class SnapshotError(ValueError):
    """No usable snapshot: missing, of another config, or inconsistent."""


@dataclass
class WorkerSnapshot:
    live: bool
    pending: bool  # a round result still to merge (overlap): it is the canonical state
    bytes_sent: int
    bytes_received: int
    local: dict[str, torch.Tensor] | None = field(default=None, repr=False)


@dataclass
class SimSnapshot:
    """The simulator after `state.round` rounds (see the module docstring)."""

    config_hash: str
    state: TrainState
    records: list[dict[str, Any]]
    workers: list[WorkerSnapshot]
    churn_rng: Any
    counters: dict[str, float]

    @property
    def round(self) -> int:
        return len(self.records)

    @classmethod
    def take(
        cls,
        config_hash: str,
        state: TrainState,
        records: list[dict[str, Any]],
        workers: list[Any],
        churn: random.Random,
        counters: tuple[float, ...],
    ) -> SimSnapshot:
        """Copy the simulator's state (`workers`: covey.sim.simulator.Worker)."""
        return cls(
            config_hash,
            state,
            list(records),
            [
                WorkerSnapshot(
                    w.strategy is not None,
                    w.pending is not None,
                    w.bytes_sent,
                    w.bytes_received,
                    None if w.strategy is None else w.strategy.local_state(copy=True),
                )
                for w in workers
            ],
            churn.getstate(),
            dict(zip(COUNTERS, counters, strict=True)),
        )

    def restore(
        self, workers: list[Any], churn: random.Random, new_strategy: Callable[[], Strategy]
    ) -> tuple[int, list[dict[str, Any]], tuple[float, ...]]:
        """Put `workers` and `churn` back as they were; returns (rounds done, records,
        counters in COUNTERS order). `new_strategy` must already load `self.state`.
        ValueError when the snapshot does not fit (another worker count or model)."""
        if len(workers) != len(self.workers):
            raise SnapshotError(
                f"snapshot has {len(self.workers)} workers, this run {len(workers)}"
            )
        for w, snap in zip(workers, self.workers, strict=True):
            w.bytes_sent, w.bytes_received = snap.bytes_sent, snap.bytes_received
            w.pending = self.state if snap.pending else None
            w.strategy = None
            if snap.live:
                assert snap.local is not None
                w.strategy = new_strategy()
                w.strategy.load_local_state(snap.local)
        churn.setstate(self.churn_rng)
        counters = tuple(self.counters[k] for k in COUNTERS)
        return self.round, list(self.records), counters


def _tuple(x: Any) -> Any:
    return tuple(_tuple(v) for v in x) if isinstance(x, list) else x


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_snapshot(directory: Path, snap: SimSnapshot) -> None:
    """Write `snap` into `directory` (created), replacing the previous one."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for section, d in (("params", snap.state.params), ("outer", snap.state.outer)):
        tensors.update({f"{section}/{k}": v for k, v in d.items()})
    for i, w in enumerate(snap.workers):
        tensors.update({f"worker{i}/{k}": v for k, v in (w.local or {}).items()})
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    meta = {
        "format": FORMAT,
        "round": snap.round,
        "config_hash": snap.config_hash,
        "state_round": snap.state.round,
        "state_digest": snap.state.digest(),
        "records": snap.records,
        "workers": [
            {k: getattr(w, k) for k in ("live", "pending", "bytes_sent", "bytes_received")}
            for w in snap.workers
        ],
        "churn_rng": snap.churn_rng,
        "counters": snap.counters,
    }
    meta_round = str(snap.round)
    _write_atomic(
        directory / "tensors.safetensors",
        lambda p: save_file(tensors, str(p), metadata={"round": meta_round}),
    )
    meta["tensors_sha256"] = sha256_file(directory / "tensors.safetensors")
    _write_atomic(directory / "sim.json", lambda p: p.write_text(json.dumps(meta) + "\n"))


def load_snapshot(directory: Path, config_hash: str | None = None) -> SimSnapshot:
    """The snapshot in `directory`; `SnapshotError` (saying what to do) when there is none,
    it is of another config than `config_hash`, or its two files disagree."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    from covey.algorithms import TrainState

    meta_path, tensor_path = directory / "sim.json", directory / "tensors.safetensors"
    if not meta_path.is_file() or not tensor_path.is_file():
        raise SnapshotError(
            f"no checkpoint in {directory} to resume from; run `covey sim` without --resume "
            "(it writes one after each round)"
        )
    fix = "delete the folder and start the run again (or pass --overwrite)"
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as e:
        raise SnapshotError(f"{meta_path} is damaged ({e}); {fix}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SnapshotError(f"{meta_path} has format {meta.get('format')}, not {FORMAT}")
    if config_hash is not None and meta["config_hash"] != config_hash:
        raise SnapshotError(
            f"the checkpoint in {directory} is of config {meta['config_hash']}, not "
            f"{config_hash}: resume with the same config and flags (or with none: the "
            "checkpoint's own config is used)"
        )
    try:
        check_sha256(tensor_path, meta.get("tensors_sha256"))
        with safe_open(str(tensor_path), "pt") as f:
            tensor_round = (f.metadata() or {}).get("round")
        if tensor_round != str(meta.get("round")):
            raise SnapshotError(
                f"{directory}: tensors of round {tensor_round}, metadata of round "
                f"{meta.get('round')} (killed while writing); {fix}"
            )
        tensors = load_file(str(tensor_path))
    except UserError as e:
        raise SnapshotError(f"{e}; {fix}") from None
    except SafetensorError as e:
        raise SnapshotError(f"{tensor_path} is damaged or truncated ({e}); {fix}") from None

    def section(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}

    state = TrainState(section("params/"), section("outer/"), meta["state_round"])
    if state.digest() != meta["state_digest"]:
        raise SnapshotError(f"{tensor_path}: the canonical state does not match its digest")
    workers = [
        WorkerSnapshot(**w, local=section(f"worker{i}/") if w["live"] else None)
        for i, w in enumerate(meta["workers"])
    ]
    return SimSnapshot(
        meta["config_hash"],
        state,
        meta["records"],
        workers,
        _tuple(meta["churn_rng"]),
        meta["counters"],
    )


def read_config(directory: Path) -> dict[str, Any] | None:
    """The config a run directory's summary or checkpoint records (None: neither)."""
    path = directory / "checkpoint" / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise SnapshotError(f"{path} is damaged ({e}); start the run again") from None


def write_config(directory: Path, config: dict[str, Any]) -> None:
    (directory / "checkpoint").mkdir(parents=True, exist_ok=True)
    _write_atomic(
        directory / "checkpoint" / "config.json",
        lambda p: p.write_text(json.dumps(config, indent=1) + "\n"),
    )
