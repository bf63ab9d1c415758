"""Tiny Hugging Face model and tokenizer directories, built in a test's tmp_path (nothing
downloaded): a 2-layer Llama and a 2-layer GPT-2 of about 0.1-0.3M parameters."""

from __future__ import annotations

import json
from pathlib import Path

TEXTS = [
    f"Once upon a time there was a little model number {i} that learned to talk." for i in range(60)
]


def tiny_llama(directory: Path, vocab_size: int = 320, positions: int = 128) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": positions,
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def tiny_gpt2(directory: Path, vocab_size: int = 320, positions: int = 64) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": positions,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 2,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def tiny_tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE trained on TEXTS (covey's own trainer)."""
    from covey.data.tokenizer import train_tokenizer

    train_tokenizer(TEXTS, vocab_size, directory)
    return directory
