"""SWARM pipeline training (arXiv 2301.11913).

This package's pure core: `plan` cuts a model into stages, `stage` runs one stage's
forward and recomputing backward, `codecs` compresses what travels between stages,
`routing` picks a server per stage, `rebalance` moves servers between stages. Nothing here
opens a socket; the HTTP layer passes bytes and clocks in.
"""
