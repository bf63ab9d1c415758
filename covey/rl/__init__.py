"""Decentralized RL post-training (docs/rl.md): the pure core.

Seeded sampling (`sampling`), TOPLOC-style proofs of inference (`proofs`), the GRPO-family
loss (`loss`), tasks with verifiable rewards (`tasks`) and the rollout batch with its
checks (`batch`). Nothing here opens a socket: the trainer, rollout worker and validator
roles call these functions and carry their inputs and outputs over the network.
"""
