"""The package's layers, top first: a module imports only from its own layer or the
layers below it, and no two modules import each other, directly or through others
(tests/test_layers.py checks both on every module, function-level imports included).

A layer is a tuple of covey's top-level modules and packages ("__init__" is
covey/__init__.py); those that share a layer do not depend on each other by design.
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__", "cli"),  # typer commands: parse first, import torch late
    ("dashboard",),  # static page over the services' JSON
    ("bench",),  # measurements that drive everything below
    ("local",),  # a demo and a cluster of real processes on one machine
    ("serve",),  # the serving mode: verified inference on the host, reusing rl's sampling
    ("rl", "swarm"),  # the RL and SWARM modes and their peers, on the coordinator's host
    ("coordinator",),  # the host (identity, database, ledger, membership...) + data rounds
    ("peer",),  # worker / validator loops, blob plane client, local state
    ("io",),  # anyone's tools: export, generate, audit a ledger
    ("blobs",),  # content-addressed store, server and client
    ("trust",),  # identities, verification, ledger, incentives, robust checks
    ("protocol", "sim"),  # wire schemas, round state machine; in-process simulator
    ("memory",),  # process memory: bounded heap, shapes-only copies
    ("algorithms",),  # pure tensor math: strategies, codecs, aggregation
    ("models", "data"),  # model sources; data sources, tokenizers, shards
    ("spec", "guards"),  # reading a run spec with --set; run-directory locks, hashed files
    ("config", "devices", "errors", "logs", "tracking", "layers", "__init__"),
)
