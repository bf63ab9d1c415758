"""Models and tokenizers in and out of covey: export to Hugging Face, generate, and the
command-line entries for them (covey.io.cli)."""
