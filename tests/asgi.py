"""One request through an ASGI app in-process (no socket): the coordinator's app driven
directly, for tests that compare its layers or hold long-polls on one event loop."""

from __future__ import annotations

import asyncio
import json
from typing import Any


async def acall(
    app: Any,
    method: str,
    path: str,
    query: bytes = b"",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    client: str = "127.0.0.1",
    disconnect_at_once: bool = False,
) -> tuple[int, Any]:
    hdrs = [
        (b"host", b"x"),
        (b"content-length", str(len(body)).encode()),
        (b"content-type", b"application/json"),
    ]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": hdrs,
        "client": (client, 5000),
        "server": ("127.0.0.1", 80),
    }
    pending = (
        [] if disconnect_at_once else [{"type": "http.request", "body": body, "more_body": False}]
    )
    """(status, decoded JSON body or text) of one request; `disconnect_at_once`: the client
    goes away before it is answered (else it stays connected until it is)."""
    out: dict[str, Any] = {"body": b"", "status": None}

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        if disconnect_at_once:  # the client went away before anything was answered
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)  # a client that stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    try:
        return out["status"], json.loads(out["body"])
    except ValueError:
        return out["status"], out["body"].decode()


def call(app: Any, method: str, path: str, body: bytes = b"", query: bytes = b"") -> tuple:
    """acall on a fresh event loop: (status, decoded JSON body or text)."""
    return asyncio.run(acall(app, method, path, query=query, body=body))
