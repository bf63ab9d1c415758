"""Trust: identities and signatures, verification of contributed work (re-execution,
dispute bisection), robust aggregation's configuration, the ledger and incentives.
See docs/trust.md and docs/architecture.md, "Where trust sits"."""
