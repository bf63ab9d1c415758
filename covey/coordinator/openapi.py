"""The coordinator's OpenAPI document says every status code an endpoint can answer.

FastAPI documents what a route declares (its 200 and, with parameters, a 422 in FastAPI's
own error shape). The coordinator also answers from layers that no route declares: the
middleware (408 slow body, 413 body too large, 429 rate limit), the server (503 over its
connection limit), FastAPI itself (400 unparsable JSON, 422 invalid request) and, for
every signed request, the authentication and run checks (401 bad signature or nonce, 403
banned or not a member, 404 unknown peer, 409 another run or a conflicting state, 410 a
halted run). `document` adds those to every operation of the served document, each with
the `ErrorReply` body that every refusal carries; a route declares only what is its own,
with `errors(...)` (e.g. 404 and 416 of a blob read).

tests/test_openapi.py runs schemathesis against the served document of a real
coordinator: an undocumented status code, content type or body shape fails it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from covey.protocol import schemas

ERROR_REF = "#/components/schemas/ErrorReply"
CID_PATTERN = r"^[0-9a-f]{64}$"  # sha256 hex (covey.protocol.content)
WHY: dict[int, str] = {
    400: "Malformed: unparsable JSON, or a value that contradicts another (path and body)",
    401: "Not authenticated: missing or wrong signature, stale or replayed nonce",
    403: "Not allowed: not a member in this role, banned for fraud, stake below the minimum",
    404: "Not found (or not yet: poll again)",
    408: "The request body arrived too slowly",
    409: "Conflicts with the run's state: another run, a closed round, a duplicate",
    410: "The run was halted by its owner: nobody joins, beats or contributes again",
    411: "A blob upload needs a Content-Length",
    413: "The body, or the size it declares, is over this run's limit",
    416: "The range is outside the blob",
    422: "Invalid request: a field is missing, out of bounds or of the wrong form",
    429: "Too many requests from this peer or address: retry after Retry-After seconds",
    503: "Busy: over the server's connection limit (uvicorn's text/plain), or for /v1/halt"
    " accepted but not written yet (JSON): ask again",
}
# answered by the middleware to any request (covey.coordinator.app, .limits)
EVERY_REQUEST = (408, 413, 429)
# a signed body passes authentication, the run id, membership and halt checks (auth,
# membership, halt)
SIGNED = (400, 401, 403, 404, 409, 410, 422)
# uvicorn answers past `limits.max_connections` before the app sees the request
BUSY = {
    "description": WHY[503],
    "content": {
        "text/plain": {"schema": {"type": "string"}},
        "application/json": {"schema": {"$ref": ERROR_REF}},
    },
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "string"}}}
_BYTES = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
# GET/HEAD /v1/blobs/{cid}: the bytes, whole or a single range
BLOB_BODY: dict[int | str, dict[str, Any]] = {
    200: {"description": "The blob's bytes", "content": _BYTES},
    307: {
        "description": "With blobs in an object store (--blobs s3://...): GET the blob there",
        "headers": {
            "Location": {"description": "a presigned URL of the blob", "schema": {"type": "string"}}
        },
    },
    206: {
        "description": "The bytes of the requested range (`Range: bytes=a-b`)",
        "content": _BYTES,
        "headers": {
            "Content-Range": {"description": "bytes a-b/size", "schema": {"type": "string"}}
        },
    },
}


def _header(name: str, pattern: str, what: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "header",
        "required": True,
        "description": what,
        "schema": {"type": "string", "pattern": pattern},
    }


# PUT /v1/blobs/{cid}: raw bytes, signed in headers (covey.blobs.store.upload_message);
# the handler reads the stream itself, so FastAPI cannot describe the body on its own
BLOB_UPLOAD: dict[str, Any] = {
    "requestBody": {"required": True, "content": _BYTES},
    "parameters": [
        _header("X-Covey-Peer", schemas.PEER_ID_PATTERN, "the uploading member's peer id"),
        _header("X-Covey-Nonce", r"^[0-9]{13}-[0-9a-f]{16}$", "a fresh nonce"),
        _header(
            "X-Covey-Signature",
            r"^[0-9a-f]{128}$",
            "Ed25519 over (purpose, run, peer, cid, size, nonce)",
        ),
    ],
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route's own refusals: each code with the ErrorReply body."""
    return {code: {"model": schemas.ErrorReply, "description": WHY[code]} for code in codes}


def _error(code: int) -> dict[str, Any]:
    reply: dict[str, Any] = {
        "description": WHY.get(code, "Refused"),
        "content": {"application/json": {"schema": {"$ref": ERROR_REF}}},
    }
    if code == 429:
        reply["headers"] = RETRY_AFTER
    return reply


def _signed(operation: dict[str, Any]) -> bool:
    """Whether the JSON request body is a signed request (a `schemas.Signed` model)."""
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    ref = body.get("schema", {}).get("$ref", "")
    model = getattr(schemas, ref.rsplit("/", 1)[-1], None) if ref else None
    return isinstance(model, type) and issubclass(model, schemas.Signed)


def complete(doc: dict[str, Any], run_id: str) -> dict[str, Any]:
    """Add to each operation of `doc` the refusals it can meet outside its route, give
    every 4xx the ErrorReply body (replacing FastAPI's own 422 shape, which the
    coordinator never sends), and say what the handlers check beyond the models: a
    request's `run_id` is this run's (else 409), a `cid` in a path is a content id (else
    400 or 404). Returns `doc`, changed in place."""
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorReply"] = schemas.ErrorReply.model_json_schema(
        ref_template="#/components/schemas/{model}"
    )
    for name, schema in components.items():
        model = getattr(schemas, name, None)
        run = schema.get("properties", {}).get("run_id")
        if run is not None and isinstance(model, type) and issubclass(model, schemas.Request):
            run["enum"] = [run_id]
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            for parameter in operation.get("parameters", []):
                if parameter.get("in") == "path" and parameter.get("name") == "cid":
                    parameter["schema"]["pattern"] = CID_PATTERN
            codes = set(EVERY_REQUEST)
            body = operation.get("requestBody", {}).get("content", {})
            if operation.get("parameters") or body:
                codes.add(422)
            if "application/json" in body:
                codes.add(400)  # FastAPI: "There was an error parsing the body"
            if _signed(operation):
                codes.update(SIGNED)
            for code in codes:
                responses.setdefault(str(code), {})
            responses["503"] = BUSY
            for key in list(responses):
                if key.isdigit() and 400 <= int(key) < 500:
                    kept = {k: v for k, v in responses[key].items() if k == "headers"}
                    responses[key] = {**_error(int(key)), **kept}
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return doc


def document(app: FastAPI, run_id: str) -> None:
    """Serve `complete`d documents at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = complete(
                get_openapi(
                    title=app.title,
                    version=app.version,
                    description=app.description,
                    routes=app.routes,
                ),
                run_id,
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
