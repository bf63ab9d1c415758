"""OpenAI's response shapes for covey's answers: the text of an answer's tokens with the
end-of-sequence token and the first stop string cut off, the usage counts, and the chunks
of a streamed answer (server-sent events, "data: {...}" lines, then "data: [DONE]")."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Finished:
    text: str
    completion_tokens: int  # tokens up to the one that completed a stop string (or all)
    finish_reason: str  # "stop" (end-of-sequence or a stop string) or "length"
    pieces: list[str]  # the text, token by token, for streaming


def finish(
    tokens: list[int],
    decode: Callable[[list[int]], str],
    eos_id: int | None,
    stops: list[str],
    partial: bool = False,
) -> Finished:
    """The answer as the user sees it. `partial`: the tokens so far of a streamed answer,
    whose text holds back a trailing partial UTF-8 character and any ending that could be
    the start of a stop string (it is shown once the next tokens rule the stop out)."""
    ended = eos_id is not None and bool(tokens) and tokens[-1] == eos_id
    body = tokens[:-1] if ended else tokens
    pieces, shown, used = [], "", len(tokens)
    reason = "stop" if ended else "length"
    for i in range(1, len(body) + 1):
        text = decode(body[:i])
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            text, used, reason = text[:cut], i, "stop"
        if not text.endswith("\ufffd") or cut >= 0:  # a partial UTF-8 character waits
            pieces.append(text[len(shown) :])
            shown = text
        if cut >= 0:
            break
    if reason != "stop" and not partial and len(shown) < len(full := decode(body)):
        pieces.append(full[len(shown) :])
        shown = full
    if partial and reason != "stop":
        held = max((k for s in stops for k in range(1, len(s)) if shown.endswith(s[:k])), default=0)
        shown = shown[: len(shown) - held]
    return Finished(shown, used, reason, [p for p in pieces if p])


def usage(prompt_tokens: int, done: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": prompt_tokens + done.completion_tokens,
    }


def completion(rid: str, model: str, prompt_tokens: int, done: Finished) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"text": done.text, "index": 0, "logprobs": None, "finish_reason": done.finish_reason}
        ],
        "usage": usage(prompt_tokens, done),
    }


def chat(rid: str, model: str, prompt_tokens: int, done: Finished) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": None,
                "finish_reason": done.finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, done),
    }


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def chunk(
    rid: str,
    model: str,
    piece: str | None,
    reason: str | None,
    is_chat: bool,
    first: bool = False,
) -> dict[str, Any]:
    """One event of a streamed answer: a piece of text, or the finish (`reason`)."""
    kind = "chat.completion.chunk" if is_chat else "text_completion"
    if is_chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if piece is not None:
            delta["content"] = piece
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": reason,
        }
    else:
        choice = {"text": piece or "", "index": 0, "logprobs": None, "finish_reason": reason}
    created = int(time.time())
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}


def usage_chunk(
    rid: str, model: str, prompt_tokens: int, done: Finished, is_chat: bool
) -> dict[str, Any]:
    """The last event before [DONE] when the client asked for stream_options.include_usage."""
    kind = "chat.completion.chunk" if is_chat else "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, done),
    }


def error_event(message: str, status: int) -> bytes:
    return sse({"error": {"message": message, "type": "server_error", "code": status}})
