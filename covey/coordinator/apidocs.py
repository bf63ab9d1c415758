"""/docs with no internet: the app's OpenAPI document as one HTML page, rendered on the server.

FastAPI's own /docs and /redoc pages load Swagger UI and ReDoc from a CDN, so a coordinator
on an offline network (or a browser that cannot reach the CDN) shows a blank page. `install`
replaces them, on any of covey's apps (the rounds coordinator, the RL trainer's service and
the swarm coordinator), with a page built from the same document the app serves at
/openapi.json: every operation (method, path, summary, parameters, request body and each
response with its schema), then every schema with its fields. It has inline CSS only: no
script, no font, no stylesheet or image fetched from anywhere.
"""

from __future__ import annotations

import html
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

DOCS_PATH = "/docs"
METHODS = ("get", "head", "post", "put", "patch", "delete", "options")
STYLE = """body{font:14px system-ui,sans-serif;margin:2em auto;max-width:70em;color:#222}
h1 small{color:#666;font-weight:normal}h2{border-bottom:1px solid #ccc;margin-top:2em}
section{border:1px solid #ddd;border-radius:4px;padding:.2em 1em .6em;margin:.8em 0}
h3{font-size:15px}h3 code{font-size:15px}.m{display:inline-block;min-width:4.5em;color:#fff;
padding:1px 6px;border-radius:3px;text-transform:uppercase;font-size:12px;text-align:center}
.get,.head{background:#2f6fb0}.post{background:#2d8a4e}.put,.patch{background:#b07b16}
.delete{background:#b03030}.options{background:#666}table{border-collapse:collapse;margin:.3em 0}
td,th{border:1px solid #ddd;padding:2px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}.d{white-space:pre-line;color:#444}code{font-size:13px}"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def schema_text(schema: dict[str, Any] | None) -> str:
    """A schema in a few words of HTML: a component's name (linked to its section), or its
    type with what constrains it (`array of X`, `integer ≥ 0`, `one of a | b`)."""
    if not schema:
        return "any"
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f'<a href="#schema-{_e(name)}">{_e(name)}</a>'
    for key, joiner in (("anyOf", " | "), ("oneOf", " | "), ("allOf", " &amp; ")):
        if key in schema:
            return joiner.join(schema_text(s) for s in schema[key])
    kind = schema.get("type", "object" if "properties" in schema else "any")
    if isinstance(kind, list):
        kind = " | ".join(str(k) for k in kind)
    if kind == "array":
        text = f"array of {schema_text(schema.get('items'))}"
    else:
        text = _e(kind)
        if "format" in schema:
            text += f" ({_e(schema['format'])})"
    if "enum" in schema:
        text += " one of " + ", ".join(f"<code>{_e(v)}</code>" for v in schema["enum"])
    if "const" in schema:
        text += f" = <code>{_e(schema['const'])}</code>"
    bounds = (
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
    )
    for key, sign in bounds:
        if key in schema and not isinstance(schema[key], bool):
            text += f", {sign} {_e(schema[key])}"
    if "pattern" in schema:
        text += f", matching <code>{_e(schema['pattern'])}</code>"
    return text


def _bodies(content: dict[str, Any]) -> str:
    if not content:
        return "none"
    return "; ".join(
        f"<code>{_e(media)}</code>: {schema_text(body.get('schema'))}"
        for media, body in content.items()
    )


def _operation(method: str, path: str, op: dict[str, Any]) -> str:
    out = [
        f'<section id="op-{_e(method)}-{_e(path)}"><h3><span class="m {_e(method)}">'
        f"{_e(method)}</span> <code>{_e(path)}</code></h3>"
    ]
    if op.get("summary"):
        out.append(f"<p><b>{_e(op['summary'])}</b></p>")
    if op.get("description"):
        out.append(f'<p class="d">{_e(op["description"])}</p>')
    params = op.get("parameters", [])
    if params:
        out.append("<table><tr><th>parameter</th><th>in</th><th>required</th><th>type</th>"
                   "<th>what</th></tr>")  # fmt: skip
        for p in params:
            out.append(
                f"<tr><td><code>{_e(p.get('name'))}</code></td><td>{_e(p.get('in'))}</td>"
                f"<td>{'yes' if p.get('required') else 'no'}</td>"
                f"<td>{schema_text(p.get('schema'))}</td><td>{_e(p.get('description', ''))}</td>"
                "</tr>"
            )
        out.append("</table>")
    body = op.get("requestBody")
    if body:
        out.append(f"<p>Request body: {_bodies(body.get('content', {}))}</p>")
    responses = op.get("responses", {})
    if responses:
        out.append("<table><tr><th>status</th><th>meaning</th><th>body</th></tr>")
        for code in sorted(responses, key=str):
            reply = responses[code]
            out.append(
                f"<tr><td>{_e(code)}</td><td>{_e(reply.get('description', ''))}</td>"
                f"<td>{_bodies(reply.get('content', {}))}</td></tr>"
            )
        out.append("</table>")
    out.append("</section>")
    return "".join(out)


def _schema(name: str, schema: dict[str, Any]) -> str:
    out = [f'<section id="schema-{_e(name)}"><h3><code>{_e(name)}</code></h3>']
    if schema.get("description"):
        out.append(f'<p class="d">{_e(schema["description"])}</p>')
    properties = schema.get("properties", {})
    if properties:
        required = set(schema.get("required", []))
        out.append("<table><tr><th>field</th><th>type</th><th>required</th><th>what</th></tr>")
        for field, sub in properties.items():
            out.append(
                f"<tr><td><code>{_e(field)}</code></td><td>{schema_text(sub)}</td>"
                f"<td>{'yes' if field in required else 'no'}</td>"
                f"<td>{_e(sub.get('description', ''))}</td></tr>"
            )
        out.append("</table>")
    else:
        out.append(f"<p>{schema_text(schema)}</p>")
    out.append("</section>")
    return "".join(out)


def render(doc: dict[str, Any], openapi_url: str) -> str:
    """The whole page for OpenAPI document `doc`, which the app serves at `openapi_url`."""
    info = doc.get("info", {})
    title = info.get("title", "API")
    parts = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)} API'
        f"</title><style>{STYLE}</style></head><body>"
        f"<h1>{_e(title)} <small>version {_e(info.get('version', ''))}, OpenAPI "
        f"{_e(doc.get('openapi', ''))}</small></h1>"
    ]
    if info.get("description"):
        parts.append(f'<p class="d">{_e(info["description"])}</p>')
    parts.append(
        f'<p>The machine-readable document: <a href="{_e(openapi_url)}">{_e(openapi_url)}</a>'
        " (this page is made from it on the server).</p><h2>Operations</h2><ul>"
    )
    operations = [
        (method, path, item[method])
        for path, item in doc.get("paths", {}).items()
        for method in METHODS
        if method in item
    ]
    for method, path, op in operations:
        summary = f" — {_e(op['summary'])}" if op.get("summary") else ""
        parts.append(
            f'<li><a href="#op-{_e(method)}-{_e(path)}">{_e(method.upper())} '
            f"<code>{_e(path)}</code></a>{summary}</li>"
        )
    parts.append("</ul>")
    parts.extend(_operation(method, path, op) for method, path, op in operations)
    schemas = doc.get("components", {}).get("schemas", {})
    if schemas:
        parts.append("<h2>Schemas</h2>")
        parts.extend(_schema(name, schemas[name]) for name in sorted(schemas))
    parts.append("</body></html>")
    return "".join(parts)


def install(app: FastAPI) -> None:
    """Serve `render`ed docs at /docs of `app` instead of FastAPI's CDN-backed Swagger UI
    (and drop its /redoc and OAuth2 redirect pages, which need the CDN too). The page is
    built on the first request, from `app.openapi()` (so from a document an app completes
    itself, as covey.coordinator.openapi does), and kept."""
    dropped = {app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url} - {None}
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in dropped]
    app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url = DOCS_PATH, None, None
    page: list[str] = []

    @app.get(DOCS_PATH, include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        if not page:
            openapi_url = request.scope.get("root_path", "") + (app.openapi_url or "")
            page.append(render(app.openapi(), openapi_url))
        return HTMLResponse(page[0])
