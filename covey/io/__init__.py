"""What anyone can do with a run from outside it: export its model to Hugging Face,
generate from it, and audit its ledger (covey.io.audit), with the command-line entries for
them (covey.io.cli, covey.io.ledger_cli)."""
