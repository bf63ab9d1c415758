"""What the swarm coordinator (covey.swarm.service) knows of each stage server: its
address, stage, state, load and pay, updated by its joins, heartbeats and reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerInfo:
    peer_id: str
    name: str
    stage: int
    url: str
    blob_url: str
    last_seen: float
    step: int = -1  # -1: no state loaded yet
    state: str | None = None
    pending: int = 0
    throughput: float = 0.0  # samples/s while busy, measured by the server
    queue: int = 0
    moving: bool = False  # told to move; busy until it reports the new stage
    served: int = 0
    public_key: str = ""  # its join's key (registered): trainers verify its replies with it
