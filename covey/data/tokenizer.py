"""Tokenizers: covey's bytes, a local `tokenizer.json` directory, and training a new one.

Sources: `bytes` (the identity on UTF-8 bytes, vocabulary 256, NUL between documents) and
`hf:<dir>` (a directory with `tokenizer.json`, and optionally `tokenizer_config.json` for
special tokens and a chat template), loaded with transformers' PreTrainedTokenizerFast:
JSON only, no code. `train_tokenizer` fits a byte-level BPE with the `tokenizers` library
and writes a directory transformers loads. Heavy libraries are imported inside functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

EOS_TOKEN = "<|endoftext|>"  # what train_tokenizer adds, GPT-2's spelling


class Tokenizer(Protocol):
    source: str
    vocab_size: int  # ids are in [0, vocab_size)
    eos_id: int  # separates documents in a packed stream

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def render_chat(self, messages: list[dict[str, Any]]) -> str: ...
    def save(self, directory: Path) -> None: ...


def plain_chat(messages: list[dict[str, Any]]) -> str:
    """Chat rows for a tokenizer without a template: one 'role: content' line per turn."""
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages)


class ByteTokenizer:
    """The identity on UTF-8 bytes: what every covey run used before tokenizers existed."""

    source = "bytes"
    vocab_size = 256
    eos_id = 0  # NUL: documents were always joined with a NUL byte

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return plain_chat(messages)

    def save(self, directory: Path) -> None:
        """A tokenizer.json that maps every byte to its own value as id (byte-level BPE
        without merges), so transformers encodes exactly as covey did."""
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        alphabet = _bytes_to_unicode()
        vocab = {alphabet[b]: b for b in range(256)}
        raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()
        directory.mkdir(parents=True, exist_ok=True)
        PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(str(directory))


class HFTokenizer:
    """A transformers fast tokenizer from a local directory (tokenizer.json)."""

    def __init__(self, directory: str | Path, source: str | None = None) -> None:
        path = Path(directory).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer directory {directory} has no tokenizer.json")
        from transformers import PreTrainedTokenizerFast

        try:
            self.tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        except (ValueError, OSError) as e:
            raise ValueError(f"tokenizer {directory}: {e}") from None
        self.source = source or f"hf:{directory}"
        self.directory = path
        self.vocab_size = len(self.tok)
        eos = self.tok.eos_token_id
        if eos is None:  # tokenizer.json alone carries no eos role: look for a usual name
            for name in (EOS_TOKEN, "</s>", "<eos>", "<|im_end|>", "<|end_of_text|>"):
                tid = self.tok.convert_tokens_to_ids(name)
                if isinstance(tid, int) and tid != self.tok.unk_token_id and tid >= 0:
                    eos = tid
                    break
        if eos is None:  # an exported covey model names it in its model config
            eos = _config_eos(path)
        if eos is None:
            raise ValueError(
                f"tokenizer {directory} has no end-of-sequence token (set eos_token in "
                f"tokenizer_config.json or add {EOS_TOKEN!r}); packing needs one"
            )
        self.eos_id = int(eos)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.tok.backend_tokenizer.encode_batch(texts, False)]

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if getattr(self.tok, "chat_template", None):
            return str(self.tok.apply_chat_template(messages, tokenize=False))
        return plain_chat(messages)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.tok.save_pretrained(str(directory))


def _config_eos(directory: Path) -> int | None:
    for name in ("generation_config.json", "config.json"):
        p = directory / name
        if p.is_file():
            value = json.loads(p.read_text()).get("eos_token_id")
            if isinstance(value, int):
                return value
    return None


def load_tokenizer(source: str) -> ByteTokenizer | HFTokenizer:
    """`bytes` or `hf:<dir>`; ValueError naming the source otherwise."""
    if source == "bytes":
        return ByteTokenizer()
    if source.startswith("hf:") and len(source) > 3:
        return HFTokenizer(source[3:], source)
    raise ValueError(f"tokenizer {source!r}: expected 'bytes' or 'hf:<dir>'")


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: Path) -> HFTokenizer:
    """Fit a byte-level BPE of `vocab_size` tokens (including the 256 bytes and EOS) on
    `texts` and write a transformers-loadable directory to `out`. ValueError if the
    vocabulary cannot even hold the byte alphabet."""
    if vocab_size < 257:
        raise ValueError(f"vocab ({vocab_size}) must exceed the 256 byte tokens plus EOS")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)
    fast.save_pretrained(str(out))
    return HFTokenizer(out, f"hf:{out}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))
