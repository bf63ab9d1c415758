"""The rounds mode's evaluator: a thread beside the round driver that computes the
held-out loss of each committed canonical state (stored with the round that made it) and,
every `rounds.samples_every` rounds, the status page's samples of that state
(covey.coordinator.samples). It runs beside the rounds, never between a commit and the
next open, on the state's own tensors (no copy).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from covey.algorithms import TrainState
from covey.algorithms.evaluate import held_out_loss
from covey.config import RunConfig
from covey.data.batches import validation_batches
from covey.data.corpus import Corpus
from covey.memory import borrowed_weights

from .db import Database
from .model import RunModel
from .samples import draw_samples

log = logging.getLogger("covey.coordinator")


class Evaluator:
    """Evaluates the canonical states handed to `submit`, one at a time, in its thread."""

    def __init__(self, cfg: RunConfig, db: Database, model: RunModel, corpus: Corpus) -> None:
        self.cfg = cfg
        self.db = db
        self._eval_model = model.eval_model
        self.loss_fn = model.loss_fn
        self.seq_len = model.seq_len
        self._val = validation_batches(
            corpus, n_batches=cfg.rounds.eval_batches, batch_size=16, seq_len=self.seq_len
        )
        self._evals: queue.Queue[TrainState | None] = queue.Queue()
        self.samples: dict[str, Any] | None = None  # the status page's
        self._tokenizer: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._evaluate, name="evaluator", daemon=True)
        self._thread.start()

    def submit(self, state: TrainState) -> None:
        """Queue `state` (its own dict of the weights: the next close empties the state's)."""
        self._evals.put(state)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._evals.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _evaluate(self) -> None:
        """Held-out loss of each queued canonical state, stored with the round that made it;
        every `rounds.samples_every` rounds (and the first time) also the status page's
        samples of that state, kept in memory."""
        while (state := self._evals.get()) is not None:
            made_by = state.round - 1
            try:
                # the evaluation model runs on the state's own tensors: no copy
                with borrowed_weights(self._eval_model, state.params) as model:
                    loss = held_out_loss(model, self._val, self.loss_fn)
                    self._refresh_samples(state.round)  # on the same weights
                with self.db.transaction() as c:
                    c.execute("UPDATE rounds SET val_loss = ? WHERE round = ?", (loss, made_by))
            except Exception:
                log.exception("evaluation of round %d failed", made_by)
            del state  # not held while waiting: the next close frees these weights

    def _refresh_samples(self, round: int) -> None:
        every = self.cfg.rounds.samples_every
        last = self.samples["round"] if self.samples else None
        if not every or (last is not None and round // every <= last // every):
            return
        from covey.data.tokenizer import load_tokenizer
        from covey.models.source import parse_source

        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg.data.tokenizer)
        self.samples = draw_samples(
            self._eval_model,
            self._tokenizer,
            self.cfg.rounds.sample_prompts,
            round=round,
            window=self.seq_len,
            max_new_tokens=self.cfg.rounds.sample_tokens,
            hf=parse_source(self.cfg.model.spec)[0] == "hf",
        )
