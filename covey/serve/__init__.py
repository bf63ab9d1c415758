"""The serving mode: an OpenAI-compatible API on the coordinator's host, answered by
untrusted inference workers with seeded sampling and inference proofs (covey.rl.sampling,
covey.rl.proofs), re-checked by validators. See docs/serve.md."""
