"""A house inference worker: the run owner's own serving worker, whose answers to the
owner's own house requests are the serving mode's canaries (covey.serve.canaries;
`covey serve worker --house-of COORDINATOR_KEY --house-index N`).

It is the honest worker for every request but those the draw picks: a house request
(its id made with the coordinator's key, covey.trust.house.is_house_request) whose draw,
the coordinator's signature over (run, request id, house key), falls below the run's
`canary_rate` (covey.trust.house.house_canary_draw, which the server computes too). To
those it answers with a bad answer that reads like any (`canary_answer`): a first token the
seeded draw ranks just below the honest one, the rest generated from there, and an
inference proof honestly made for those tokens. A user's request is never a house request,
so no user gets a canary answer. Its key is house key N of the run
(covey.trust.house.house_identity, derived from the coordinator's key, so it needs that key
file: only the run owner runs house workers). Once a canary is revealed the key is banned,
and the worker goes on under the next house key (a new join); after the last one
(covey.trust.house.HOUSE_KEYS) it stops.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch

from covey.peer.client import PeerRejected
from covey.rl.proofs import build_proof
from covey.rl.sampling import generate_batch, gumbel_noise, prefill
from covey.serve.checks import segment_seed
from covey.serve.model import sampler
from covey.serve.wire import Job
from covey.serve.worker import ServeWorker
from covey.trust.house import HOUSE_KEYS, house_canary_draw, house_identity
from covey.trust.identity import Identity

log = logging.getLogger("covey.serve.worker")
MIN_GAP = 0.05  # a canary's first token scores at least this far below the seeded draw's


@torch.no_grad()
def canary_answer(model: torch.nn.Module, job: Job) -> tuple[list[int], bytes]:
    """A bad answer to `job` that reads like an honest one: its first token is the one the
    seeded draw ranks next after the honest one (the most likely other token, by a gap of
    at least MIN_GAP, so the sampling check fails at position 0), the rest generated from
    it as an honest worker would (with other noise), and the proof of the hidden states of
    exactly these tokens (so the proof itself is sound). Streamed jobs get no progress: the
    answer carries all."""
    lm = sampler(model, job.top_p, job.temperature)
    prompt = list(job.prompt_ids)
    logits, _ = prefill(lm, [prompt])[0]
    scores = logits[-1].float() / job.temperature
    scores = scores + gumbel_noise(job.seed, 0, scores.shape[-1]).to(scores.device)
    order = [int(t) for t in torch.argsort(scores, descending=True)]
    best = float(scores[order[0]])
    others = [t for t in order[1:] if t != job.eos_id]
    first = next((t for t in others if best - float(scores[t]) >= MIN_GAP), others[-1])
    bad = [first]
    if job.max_tokens > 1 and first != job.eos_id:
        seed = segment_seed(job.seed, 1 << 20)  # noise of its own, for the positions after
        gen = generate_batch(lm, [prompt + bad], job.max_tokens - 1, job.temperature, [seed],
                             job.eos_id)[0]  # fmt: skip
        bad += gen.tokens
    _, hidden = prefill(lm, [prompt + bad])[0]
    return bad, build_proof(hidden[len(prompt) :])


class HouseServeWorker(ServeWorker):
    """The honest serving worker under house key `index`, answering canaries where its
    draw says so (see the module)."""

    def __init__(
        self, url: str, coordinator_key: Path, model_dir: str | Path, index: int = 0, **kw: Any
    ) -> None:
        """`kw`: ServeWorker's. ValueError for a missing key file, a key that is not this
        run's coordinator's, or an index out of 0..HOUSE_KEYS-1."""
        if not Path(coordinator_key).is_file():
            raise ValueError(f"no coordinator key file at {coordinator_key}")
        owner = Identity.load_or_create(coordinator_key)
        super().__init__(url, Identity.generate(), model_dir, **kw)
        if owner.public_key != self.spec["coordinator_key"]:
            raise ValueError(f"{coordinator_key} is not the key of this run's server")
        self.owner, self.index = owner, index
        self._use(house_identity(owner, self.run_id, index))  # ValueError out of range
        self.rate = float(self.spec["spec"]["trust"]["canary_rate"])
        self.canaries: list[str] = []  # the requests it answered with a canary
        self._switch = threading.Lock()

    def _use(self, identity: Identity) -> None:
        self.identity = self.client.identity = identity

    def register(self) -> None:
        """The run's owner funds the house key's stake before it joins (a key bonds only
        credits it holds, covey.trust.treasury): a deposit signed with the coordinator's
        key, which only the owner holds; nothing when the key holds or bonds it already.
        covey.io.deposit.DepositRefused when the server refuses it."""
        from covey.io.deposit import top_up

        top_up(self.client.base_url, self.owner, self.identity, self.stake, self.run_id,
               lambda: self.client.get("/v1/ledger/balances"))  # fmt: skip
        super().register()

    def answer(self, job: Job) -> tuple[list[int], bytes]:
        me = self.identity.peer_id
        if house_canary_draw(self.owner, self.run_id, job.job_id, me, self.rate) is None:
            return super().answer(job)
        log.info("[%s] request %s: a canary", self.name, job.job_id[:8])
        self.canaries.append(job.job_id)
        return canary_answer(self.model, job)

    def refused(self, e: PeerRejected) -> None:
        """Its key was burned by a reveal (403 naming it): go on under the next house key."""
        if e.status != 403 or "excluded" not in e.message:
            return super().refused(e)
        with self._switch:
            if self.identity.peer_id[:12] not in e.message:  # another slot moved on already
                return None
            if self.index + 1 >= HOUSE_KEYS:
                log.warning("[%s] the last house key was burned: stopping", self.name)
                return super().refused(e)
            self.index += 1
            self._use(house_identity(self.owner, self.run_id, self.index))
            log.info("[%s] its house key was burned: now house key %d", self.name, self.index)
            try:
                self.register()
            except PeerRejected as again:
                return super().refused(again)
        return None
