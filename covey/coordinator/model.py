"""The run's model as the coordinator's components need it: the strategy, the state's
names, shapes and dtypes, the loss, the sequence length, an evaluation copy, and the model
files on the blob plane. Built once by the facade (covey.coordinator.service) and handed to
verification and to the rounds mode.

Of the model's weights the coordinator holds one copy, the strategy's: the
template is shapes only, and the evaluation copy borrows the canonical state's tensors
while it evaluates (covey.memory.borrowed_weights). The strategy's model keeps the seeded
round-0 weights: nothing on the coordinator trains it (the referee trains a copy), and a
new run's round-0 state is taken from it (`Strategy.init_state`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from covey.algorithms import Strategy, TrainState, build_aggregator, build_strategy
from covey.blobs import BlobStore
from covey.config import RunConfig
from covey.data.corpus import Corpus
from covey.memory import bound_heap, shapes_only, weightless_copy
from covey.models.bundle import publish_model_files
from covey.models.source import build_run_model
from covey.models.warmstart import apply_init


@dataclass(frozen=True)
class RunModel:
    strategy: Strategy
    template: TrainState  # shapes only (meta tensors): a state is checked against it
    loss_fn: Callable[..., Any]
    seq_len: int
    parameters: int
    eval_model: torch.nn.Module  # parameters without bytes: run it in borrowed_weights
    model_files_cid: str | None
    name: str = ""  # for people (covey.models.naming), with `source`: the status page's
    source: str = ""


def payload_estimate(strategy: Strategy, state: TrainState) -> int:
    """Bytes of one contribution, for deadline planning: encode a zero update once."""
    numel = sum(
        state.params[n].numel() for n in strategy.fragment_names(strategy.round_fragment(0))
    )
    return len(strategy.codec.encode(torch.zeros(numel)))


def build_model(cfg: RunConfig, corpus: Corpus, blobs: BlobStore) -> RunModel:
    """The run's model from its spec (seeded: every peer builds the same); hf config and
    tokenizer files are put on `blobs` so workers need no model files. Raises what
    covey.models.source raises for a spec it cannot build."""
    bound_heap()  # the coordinator's freed states go back to the kernel (covey.memory)
    model, loss_fn, info, seq_len = build_run_model(
        cfg.model, cfg.seed, tokenizer_vocab=corpus.vocab_size, seq_len=cfg.data.seq_len
    )
    apply_init(model, cfg.model.init)  # a covey checkpoint warm start: the round-0 state
    model_files_cid = publish_model_files(blobs.put, cfg.model.spec, cfg.data.tokenizer)
    trust = cfg.trust
    aggregator = build_aggregator(trust.aggregation, trust.trim_fraction, trust.clip_factor)
    parameters = sum(p.numel() for p in model.parameters())
    strategy = build_strategy(cfg.algorithm, model, loss_fn, aggregator)
    return RunModel(
        strategy=strategy,
        template=shapes_only(strategy.init_state()),  # the copy made here is dropped at once
        loss_fn=loss_fn,
        seq_len=seq_len,
        parameters=parameters,
        eval_model=weightless_copy(model),
        model_files_cid=model_files_cid,
        name=info.name,
        source=info.source,
    )
