"""/docs works with no internet on each of covey's three apps (the rounds coordinator, the RL
trainer's service, the swarm coordinator): one HTML page rendered on the server from the
app's own OpenAPI document, listing every operation, with no script and no asset from any
other host (covey.coordinator.apidocs)."""

from __future__ import annotations

from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from covey.coordinator.apidocs import METHODS, render

SPEC = """
name = "apidocs"
[model]
size = "nano"
[data]
batch_size = 4
seq_len = 64
"""


class Links(HTMLParser):
    """Every tag and every URL-valued attribute of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.urls: list[str] = []
        self.anchors: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        for name, value in attrs:
            if name in ("src", "href", "action", "srcset", "data", "poster") and value:
                self.urls.append(value)
            if name == "id" and value:
                self.anchors.add(value)


def _coordinator_app(tmp: Path) -> Iterator[FastAPI]:
    from covey.config import load_run_config
    from covey.coordinator.app import create_app
    from covey.coordinator.service import Coordinator

    spec = tmp / "run.toml"
    spec.write_text(SPEC)
    coord = Coordinator(load_run_config(spec), tmp / "data")
    try:
        yield create_app(coord)
    finally:
        coord.stop()


def _rl_app(tmp: Path) -> Iterator[FastAPI]:
    from covey.rl.runspec import RLSpec
    from covey.rl.service import create_app
    from covey.rl.trainer import Trainer

    t = Trainer(tmp / "run", spec=RLSpec(), policy_dir="covey:nano")
    try:
        yield create_app(t)
    finally:
        t.stop()


def _swarm_app(tmp: Path) -> Iterator[FastAPI]:
    from covey.swarm.app import create_app
    from covey.swarm.config import SwarmConfig
    from covey.swarm.service import SwarmCoordinator

    coord = SwarmCoordinator(SwarmConfig(n_layer=2, n_embd=16, n_head=2, seq_len=8), tmp)
    yield create_app(coord)


APPS = {"rounds": _coordinator_app, "rl": _rl_app, "swarm": _swarm_app}
# a route each app must list: the page is made from the real document, not a fixed one
KNOWN = {"rounds": "/v1/join", "rl": "/v1/rl/policy", "swarm": "/v1/swarm/join"}


@pytest.fixture(params=sorted(APPS))
def app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, FastAPI]]:
    for built in APPS[request.param](tmp_path):
        yield request.param, built


def test_docs_page_lists_every_operation_and_loads_nothing_from_elsewhere(
    app: tuple[str, FastAPI],
) -> None:
    kind, built = app
    with TestClient(built) as http:
        r = http.get("/docs")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/html")
        page = r.text
        doc = http.get("/openapi.json").json()
        assert http.get("/redoc").status_code == 404  # ReDoc needs its CDN script
        assert http.get("/docs/oauth2-redirect").status_code in (404, 405)
    links = Links()
    links.feed(page)
    assert not links.tags & {"script", "link", "img", "iframe", "object", "embed", "base"}
    assert "@import" not in page and "url(" not in page
    # the only URLs: anchors on the page and the document itself
    assert set(links.urls) - {"/openapi.json"} <= {f"#{a}" for a in links.anchors}, links.urls
    assert "/openapi.json" in links.urls
    assert "http://" not in page and "https://" not in page
    operations = [(m, p) for p, item in doc["paths"].items() for m in METHODS if m in item]
    assert len(operations) >= 5 and any(p == KNOWN[kind] for _, p in operations)
    for method, path in operations:
        assert f"op-{method}-{path}" in links.anchors, (method, path)
        summary = doc["paths"][path][method].get("summary")
        if summary:
            assert summary in page
    for name in doc.get("components", {}).get("schemas", {}):
        assert f"schema-{name}" in links.anchors, name


def test_the_coordinator_page_shows_schemas_and_refusals(tmp_path: Path) -> None:
    for built in _coordinator_app(tmp_path):
        with TestClient(built) as http:
            page = http.get("/docs").text
    join = page[page.index('<section id="op-post-/v1/join">') :]
    join = join[: join.index("</section>")]
    assert 'Request body: <code>application/json</code>: <a href="#schema-JoinRequest">' in join
    reply = '<code>application/json</code>: <a href="#schema-JoinReply">'
    assert f"<tr><td>200</td><td>Successful Response</td><td>{reply}" in join
    # the completed document (covey.coordinator.openapi): every refusal, with ErrorReply
    for code in (401, 403, 409, 410, 429, 503):
        assert f"<tr><td>{code}</td>" in join, code
    assert '<a href="#schema-ErrorReply">ErrorReply</a>' in join
    assert '<section id="schema-JoinRequest">' in page


def test_text_from_the_document_is_escaped() -> None:
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "<script>alert(1)</script>", "version": "1"},
        "paths": {
            "/x/{id}": {
                "post": {
                    "summary": '"><img src=x onerror=alert(1)>',
                    "parameters": [{"name": "id", "in": "path", "schema": {"pattern": "<b>"}}],
                    "responses": {"200": {"description": "<iframe>"}},
                }
            }
        },
        "components": {"schemas": {"A<b>": {"type": "object", "properties": {}}}},
    }
    page = render(doc, "/openapi.json")
    links = Links()
    links.feed(page)
    assert links.tags <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3",
                          "small", "p", "a", "ul", "li", "code", "section", "span", "b",
                          "table", "tr", "th", "td"}, links.tags  # fmt: skip
    assert "&lt;script&gt;" in page and "&lt;img src=x" in page
