"""What every peer (worker or validator) does first: fetch the run spec from the
coordinator and check it, load the corpus and check its fingerprint, and build the model
and strategy the run describes, exactly as the coordinator did. Also the one batch
function of an assignment, shared by workers, validators and the referee.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from covey.algorithms import Strategy, TrainState, build_aggregator, build_strategy
from covey.blobs import BlobClient, BlobStore
from covey.config import RunConfig, run_id_of
from covey.data.corpus import Corpus, load_corpus
from covey.devices import (
    DeviceError,
    RunCompute,
    device_name,
    plan_run_compute,
    resolve_device,
    resolve_precision,
)
from covey.models.bundle import local_sources
from covey.models.source import build_run_model
from covey.peer.client import CoordinatorClient
from covey.protocol.checkpoint import max_state_bytes, state_from_file


@dataclass
class RunSetup:
    cfg: RunConfig
    info: dict[str, Any]  # GET /v1/run: run id, coordinator key, corpus fingerprint, ...
    corpus: Corpus
    seq_len: int
    strategy: Strategy
    template: TrainState  # the round-0 state: names, shapes and dtypes of every state
    blobs: BlobClient
    run_id: str  # covey.config.run_id_of(spec, data fingerprint), recomputed here
    device: str = "cpu"  # covey.devices.device_name of where the strategy trains
    precision: str = "fp32"  # of its inner steps: the run's (covey.devices.run_precision)
    compute: RunCompute | None = None  # what the run fixes: verify class, precision, compile

    @property
    def coordinator_key(self) -> str:
        """The key certificates and ledger entries must be signed with: the spec's."""
        assert self.cfg.coordinator_key is not None  # set_up_run refuses a spec without
        return self.cfg.coordinator_key


def set_up_run(
    client: CoordinatorClient,
    threads: int | None,
    run_id: str | None = None,
    device: str | None = None,
    validating: bool = False,
) -> RunSetup:
    """Fetch and check the run, adopt its limits, and build its strategy (with the run's
    aggregation rule, so that every peer reaches the certificate's hash). The run id is
    recomputed from the spec received, which names the coordinator's key: with `run_id`
    (what the run's owner handed out) a coordinator serving any other run or holding any
    other key is refused; the id covers the data fingerprint too (covey.config.run_id_of).
    RuntimeError when spec and fingerprint do not hash to `run_id` or to the
    coordinator's own run id (another covey version), names no coordinator key or another
    one than the coordinator presents, or this machine's corpus differs from the run's."""
    info = client.get("/v1/run")
    cfg = RunConfig.model_validate(info["spec"])
    # the id covers spec and data: checked before any work, then the data itself below
    served = run_id_of(cfg, str(info["corpus_fingerprint"]))
    if run_id is not None and served != run_id:
        raise RuntimeError(
            f"refusing coordinator {client.base_url}: it serves run {served} "
            f"(coordinator key {str(cfg.coordinator_key)[:16]}..., data fingerprint "
            f"{str(info['corpus_fingerprint'])[:12]}), not --run-id {run_id}: "
            f"the wrong address, other data, or a coordinator that is not the run owner's"
        )
    if served != info["run_id"]:
        raise RuntimeError(
            f"run spec and data fingerprint hash to {served}, coordinator says "
            f"{info['run_id']}: different covey versions?"
        )
    if cfg.coordinator_key is None or cfg.coordinator_key != info.get("coordinator_key"):
        raise RuntimeError(
            f"the run spec names coordinator key {cfg.coordinator_key}, the coordinator "
            f"presents {info.get('coordinator_key')}: refusing to trust either"
        )
    limits = cfg.limits
    client.configure(limits.request_timeout_s, limits.coordinator_lost_s)
    if threads:
        torch.set_num_threads(threads)
    d = cfg.data
    # the coordinator may redirect a GET to its object store (covey.blobs.s3)
    trusted = (client.base_url,)
    fetcher = BlobClient(
        timeout_s=limits.request_timeout_s,
        retries=limits.retries,
        max_bytes=limits.max_blob_bytes,
        redirects_from=trusted,
    )
    model_cfg, tokenizer = local_sources(  # hf: files this machine lacks: from the blob plane
        cfg.model, d.tokenizer, info.get("model_files_cid"),
        lambda cid: fetcher.fetch(cid, [client.base_url]),
    )  # fmt: skip
    corpus = load_corpus(list(d.paths), d.val_fraction, tokenizer, d.text_column)
    if corpus.fingerprint != info["corpus_fingerprint"]:
        raise RuntimeError(
            f"this machine's corpus ({corpus.describe()}) differs from the run's "
            f"(fingerprint {info['corpus_fingerprint'][:12]} vs "
            f"{corpus.fingerprint[:12]}): same Python version and --data needed"
        )
    model, loss_fn, _, seq_len = build_run_model(
        model_cfg, cfg.seed, tokenizer_vocab=corpus.vocab_size, seq_len=d.seq_len
    )
    trust = cfg.trust
    aggregator = build_aggregator(trust.aggregation, trust.trim_fraction, trust.clip_factor)
    # the canonical template stays on the host (state hashes, checkpoints); the
    # strategy trains on `device`, default the run's [peer] device, in the run's precision.
    # "auto" means the run's verify_device class: an honest peer must train on the class
    # its contributions are re-executed on, or rounding alone could start a dispute
    template = TrainState({n: p.detach().clone() for n, p in model.named_parameters()})
    peer = cfg.peer
    try:
        compute = plan_run_compute(peer.verify_device, peer.precision, peer.compile)
        chosen = device or ("auto" if validating else peer.device)
        where = resolve_device(compute.verify_class if chosen == "auto" else chosen)
        precision = resolve_precision(compute.precision, where)
    except DeviceError as e:
        raise RuntimeError(f"this machine cannot train as the run asks: {e}") from None
    strategy = build_strategy(cfg.algorithm, model.to(where), loss_fn, aggregator)
    strategy.set_compute(precision, compute.compile)
    blobs = BlobClient(
        timeout_s=limits.request_timeout_s,
        retries=limits.retries,
        chunk_bytes=limits.chunk_bytes,
        max_bytes=limits.max_blob_bytes,
        redirects_from=trusted,
    )
    return RunSetup(
        cfg, info, corpus, seq_len, strategy, template, blobs, served, device_name(where),
        precision, compute,
    )  # fmt: skip


def fetch_state(
    blobs: BlobClient,
    cid: str,
    providers: list[str],
    size: int,
    template: TrainState,
    outer_on_disk: bool = False,
) -> TrainState:
    """A canonical state fetched by content id into a scratch directory (streamed to disk,
    hashed on arrival, bounded by what the run's model implies, never by the blob cap),
    parsed and checked against `template`, and the file removed. `outer_on_disk`: the
    outer tensors stay in the removed file, read from its open descriptor when asked
    for (`state_from_file`). BlobError if no provider delivers it; CheckpointError if the
    bytes are no state of this run."""
    with tempfile.TemporaryDirectory(prefix="covey-state-") as scratch:
        store = BlobStore(Path(scratch))
        path = blobs.fetch_into(store, cid, providers, size, max_bytes=max_state_bytes(template))
        return state_from_file(path, template, outer_on_disk)
