"""An inference worker (untrusted): joins the server, long-polls for requests from each of
its slots (threads, at most the run's worker_slots), answers each with the RL mode's seeded
sampling (covey.rl.sampling.generate_batch, Gumbel-max with the
noise of the job's seed) and the inference proof of the generated tokens' hidden states
(covey.rl.proofs.build_proof). It may be checked on any answer (docs/serve.md). Dishonest
workers of tests and benches are covey.serve.cheater, which override `answer`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from covey.peer.client import CoordinatorLost, PeerRejected
from covey.rl.proofs import build_proof
from covey.rl.sampling import generate_batch
from covey.serve.checks import segment_seed, segments
from covey.serve.model import sampler
from covey.serve.peer import ServePeer
from covey.serve.wire import Job

log = logging.getLogger("covey.serve.worker")


class ServeWorker(ServePeer):
    role = "worker"

    def answer(self, job: Job) -> tuple[list[int], bytes]:
        """The tokens for `job` and their proof. A streamed job is generated a segment at a
        time, each segment's tokens posted at once (`progress`)."""
        lm = sampler(self.model, job.top_p, job.temperature)
        tokens: list[int] = []
        hidden: list[torch.Tensor] = []
        for index, (a, b) in enumerate(segments(job.max_tokens, job.segment)):
            gen = generate_batch(
                lm,
                [list(job.prompt_ids) + tokens],
                b - a,
                job.temperature,
                [segment_seed(job.seed, index)],
                job.eos_id,
            )[0]
            tokens += gen.tokens
            hidden.append(gen.hidden.cpu())
            if len(gen.tokens) < b - a or gen.tokens[-1:] == [job.eos_id]:
                break
            if job.segment and b < job.max_tokens:
                self.progress(job, tokens)
        return tokens, build_proof(torch.cat(hidden))

    def progress(self, job: Job, tokens: list[int]) -> None:
        """Post the tokens so far of a streamed job (best effort: the answer carries all)."""
        try:
            body = {**self.body(), "job_id": job.job_id, "tokens": tokens}
            self.client.post_once("/v1/serve/progress", body, timeout_s=5.0)
        except Exception as e:  # the answer still goes; the user sees it later
            log.debug("[%s] progress of %s not taken: %s", self.name, job.job_id[:8], e)

    def run_loop(self, max_answers: int | None = None, slots: int | None = None) -> int:
        """Answer requests until stopped (or about `max_answers` answered: slots busy when
        the count is reached finish their request); returns how many. `slots`: requests
        answered at a time (default and at most the run's worker_slots), each on its own
        thread and seeded by its own request, so an answer does not depend on the others."""
        most = int(self.spec["spec"].get("worker_slots", 1))
        n = most if slots is None else max(1, min(slots, most))
        self.join()
        self._answered = 0
        self._count = threading.Lock()

        def more() -> bool:
            with self._count:
                return not self.stop.is_set() and (
                    max_answers is None or self._answered < max_answers
                )

        threads = [
            threading.Thread(target=self._slot, args=(i, more), name=f"slot-{i}", daemon=True)
            for i in range(n)
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            self.stop.set()
            for t in threads:
                t.join(timeout=5.0)
            self.leave()
        return self._answered

    def _slot(self, slot: int, more: Callable[[], bool]) -> None:
        """One slot: pull a request, answer it, again; the server lost: stop every slot."""
        wait = float(self.spec["pull_wait_s"]) + 10.0
        while more():
            try:
                reply = self.client.post(
                    "/v1/serve/pull", {**self.body(), "slot": slot}, timeout_s=wait
                )
                if reply.get("job") is None:
                    continue
                job = Job.model_validate(reply["job"])
                with torch.no_grad():
                    tokens, proof = self.answer(job)
                self.client.post(
                    "/v1/serve/answer",
                    {**self.body(), "job_id": job.job_id, "tokens": tokens, "proof": proof.hex()},
                )
                with self._count:
                    self._answered += 1
            except PeerRejected as e:
                self.refused(e)
            except CoordinatorLost:
                log.warning("[%s] the server is gone: stopping", self.name)
                self.stop.set()

    def describe(self) -> dict[str, Any]:
        return {"peer_id": self.identity.peer_id, "name": self.name, "stopped": self.stopped}
