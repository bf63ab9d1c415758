"""An inference worker (untrusted): joins the server, long-polls for requests, answers each
with the RL mode's seeded sampling (covey.rl.sampling.generate_batch, Gumbel-max with the
noise of the job's seed) and the inference proof of the generated tokens' hidden states
(covey.rl.proofs.build_proof). It may be checked on any answer (docs/serve.md). Dishonest
workers of tests and benches are covey.serve.cheater, which override `answer`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from covey.peer.client import CoordinatorLost, PeerRejected
from covey.rl.proofs import build_proof
from covey.rl.sampling import generate_batch
from covey.serve.model import sampler
from covey.serve.peer import ServePeer
from covey.serve.wire import Job

log = logging.getLogger("covey.serve.worker")


class ServeWorker(ServePeer):
    role = "worker"

    def answer(self, job: Job) -> tuple[list[int], bytes]:
        """The tokens for `job` and their proof."""
        lm = sampler(self.model, job.top_p, job.temperature)
        gen = generate_batch(
            lm, [list(job.prompt_ids)], job.max_tokens, job.temperature, [job.seed], job.eos_id
        )[0]
        return gen.tokens, build_proof(gen.hidden.cpu())

    def run_loop(self, max_answers: int | None = None) -> int:
        """Answer requests until stopped (or `max_answers` answered); returns how many."""
        self.join()
        wait = float(self.spec["pull_wait_s"]) + 10.0
        answered = 0
        try:
            while not self.stop.is_set() and (max_answers is None or answered < max_answers):
                try:
                    reply = self.client.post("/v1/serve/pull", self.body(), timeout_s=wait)
                    if reply.get("job") is None:
                        continue
                    job = Job.model_validate(reply["job"])
                    with torch.no_grad():
                        tokens, proof = self.answer(job)
                    self.client.post(
                        "/v1/serve/answer",
                        {
                            **self.body(),
                            "job_id": job.job_id,
                            "tokens": tokens,
                            "proof": proof.hex(),
                        },
                    )
                    answered += 1
                except PeerRejected as e:
                    self.refused(e)
                except CoordinatorLost:
                    log.warning("[%s] the server is gone: stopping", self.name)
                    break
        finally:
            self.leave()
        return answered

    def describe(self) -> dict[str, Any]:
        return {"peer_id": self.identity.peer_id, "name": self.name, "stopped": self.stopped}
