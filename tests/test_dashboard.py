"""The status page, rendered by real headless Chromium against a real HTTP server on 127.0.0.1.

The server is stdlib ``http.server`` serving the static directory at ``/`` and a canned
``/v1/status``; the assertions are on the DOM Chromium serializes after the page's polling
JavaScript ran. Without Chromium the tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import covey.dashboard
from tests.browser import find_chromium, render_dom, screenshot

pytestmark = pytest.mark.network

STATIC = Path(covey.dashboard.__file__).parent / "static"
CHROMIUM_MISSING = "chromium missing: run python3 scripts/dev.py test, which installs it"
EVIL = "<img src=x onerror=alert(1)>"


def canned_status(n_rounds: int = 25) -> dict[str, Any]:
    """A /v1/status answer: three peers (one with markup in its id), n_rounds rounds."""
    rounds = [
        {
            "round": r,
            "accepted": 3,
            "rejected": int(r % 4 == 0),
            "tokens": 12_288 * r,
            # Evals every other round, and no train loss for round 5: both must be skipped.
            "val_loss": None if r % 2 == 0 else 4.0 - 0.05 * r,
            "train_loss": None if r == 5 else 4.2 - 0.06 * r,
            "bytes": 40_000 + 1_000 * r,
            "duration_s": 9.5 + 0.1 * r,
            "utilization": None if r == 1 else 0.9,
            "weights_hash": f"{r:02x}" * 32,
        }
        for r in range(1, n_rounds + 1)
    ]
    peer = {
        "device": "cpu",
        "step_time_s": 0.05,
        "state": "training",
        "alive": True,
        "last_seen_s_ago": 0.4,
        "accepts_connections": True,
        "contributions": 5,
    }
    return {
        "run_id": "3f9a1c0e7b2d4a6f8e1c3b5d7f9a2c4e",
        "name": "nano <b>bold</b> run",
        "method": "diloco",
        "model": "nano",
        "parameters": 1_234_567,
        "round": n_rounds + 1,
        "phase": "open",
        "deadline_in_s": 30.0,
        "committed_rounds": n_rounds,
        "bytes_total": sum(r["bytes"] for r in rounds),
        "coordinator_key": None,
        "peers": [
            {**peer, "peer_id": "peer-alpha-0001"},
            {**peer, "peer_id": EVIL, "device": "<script>alert(2)</script>"},
            {
                **peer,
                "peer_id": "peer-gamma-0003",
                "state": "dead",
                "alive": False,
                "last_seen_s_ago": 31.0,
                "accepts_connections": False,
                "contributions": 0,
            },
        ],
        "rounds": rounds,
        "samples": {
            "round": 20,
            "temperature": 0.8,
            "seed": 0,
            "max_new_tokens": 40,
            "samples": [
                {"prompt": "def ", "text": "main():\n    return 0"},
                {"prompt": "The ", "text": EVIL},  # model output is text, never markup
            ],
        },
    }


# ---- a stdlib server: the static dir at /, a canned /v1/status ---------------------------


@dataclass
class StatusServer:
    url: str
    status: dict[str, Any] | None = None
    code: int = 200
    hits: list[str] = field(default_factory=list)


class _Handler(SimpleHTTPRequestHandler):
    server_state: StatusServer

    def do_GET(self) -> None:
        self.server_state.hits.append(self.path)
        if self.path.split("?")[0] != "/v1/status":
            super().do_GET()
            return
        state = self.server_state
        body = json.dumps(state.status).encode() if state.code == 200 else b"boom"
        self.send_response(state.code)
        self.send_header("Content-Type", "application/json" if state.code == 200 else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def chromium() -> str:
    path = find_chromium()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(CHROMIUM_MISSING)
        pytest.skip(CHROMIUM_MISSING)
    return path


@pytest.fixture
def server() -> Iterator[StatusServer]:
    state = StatusServer(url="")
    handler = type("Handler", (_Handler,), {"server_state": state})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(STATIC)))
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    thread = threading.Thread(target=httpd.serve_forever, name="status-server", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


# ---- a minimal DOM built from Chromium's serialization -------------------------------------

VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "track",
    "wbr",
}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    def iter(self, tag: str | None = None) -> Iterator[Node]:
        if tag is None or self.tag == tag:
            yield self
        for c in self.children:
            if isinstance(c, Node):
                yield from c.iter(tag)

    def find(self, tag: str, **attrs: str) -> list[Node]:
        return [n for n in self.iter(tag) if all(n.attrs.get(k) == v for k, v in attrs.items())]

    def by_id(self, id_: str) -> Node:
        (node,) = [n for n in self.iter() if n.attrs.get("id") == id_]
        return node


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(dom: str) -> Node:
    builder = _TreeBuilder()
    builder.feed(dom)
    builder.close()
    return builder.root


def path_points(d: str) -> int:
    return sum(d.count(cmd) for cmd in "ML")


# ---- tests ----------------------------------------------------------------------------------


def test_dashboard_renders_status(chromium: str, server: StatusServer) -> None:
    status = canned_status(n_rounds=25)
    server.status = status
    doc = parse(render_dom(server.url))

    assert server.hits.count("/v1/status") >= 1, server.hits
    assert doc.by_id("updated").text.startswith("updated "), doc.by_id("updated").text
    error = doc.by_id("error")
    assert "hidden" in error.attrs and error.text == ""

    # Header.
    assert doc.by_id("run-name").text == status["name"]
    assert doc.by_id("round").text == "26"
    assert doc.by_id("phase").text == "open"
    assert doc.by_id("method").text == "diloco"
    assert doc.by_id("committed").text == "25"
    assert doc.by_id("peers-alive").text == "2 / 3"
    assert doc.by_id("deadline").text.endswith(" s")

    # Peers: one row each, keyed by data-peer; markup in peer strings stays text.
    peers_body = doc.by_id("peers").find("tbody")[0]
    rows = {tr.attrs["data-peer"]: tr for tr in peers_body.find("tr")}
    assert set(rows) == {p["peer_id"] for p in status["peers"]}
    assert doc.find("img") == [] and doc.find("b") == []
    # the page's own, and the frame every mode's page shares (served by the host itself)
    assert [sc.attrs.get("src") for sc in doc.find("script")] == ["/frame.js", None]
    evil_cells = [td.text for td in rows[EVIL].find("td")]
    assert evil_cells[0] == EVIL and evil_cells[1] == "<script>alert(2)</script>"
    dead_cells = rows["peer-gamma-0003"].find("td")
    assert dead_cells[3].text == "dead" and dead_cells[4].attrs["class"] == "dead"
    assert dead_cells[4].text.strip() == "no"
    assert rows["peer-alpha-0001"].find("td")[4].attrs["class"] == "alive"

    # Loss chart: one point per non-null value, nulls skipped.
    chart = doc.by_id("loss-chart")
    (val,) = chart.find("path", **{"class": "val"})
    (train,) = chart.find("path", **{"class": "train"})
    n_val = sum(r["val_loss"] is not None for r in status["rounds"])
    n_train = sum(r["train_loss"] is not None for r in status["rounds"])
    assert path_points(val.attrs["d"]) == n_val == 13
    assert path_points(train.attrs["d"]) == n_train == 24
    labels = {t.attrs["class"]: t.text for t in chart.find("text")}
    assert labels["axis-label x-min"] == "round 1" and labels["axis-label x-max"] == "round 25"
    assert labels["axis-label y-max"] == "4.140"  # train loss of round 1
    assert labels["axis-label y-min"] == "2.700"  # train loss of round 25

    # Bytes chart: a bar per round.
    assert len(doc.by_id("bytes-chart").find("rect")) == 25

    # Recent rounds: the last 20, newest first.
    round_rows = doc.by_id("rounds").find("tbody")[0].find("tr")
    assert [tr.find("td")[0].text for tr in round_rows] == [str(r) for r in range(25, 5, -1)]
    newest = [td.text for td in round_rows[0].find("td")]
    assert newest[4] == "2.7500" and newest[5] == "2.7000"
    assert [td.text for td in round_rows[1].find("td")][4] == "—"  # round 24: no eval
    assert newest[9].startswith("19191919")

    # Samples: one row per prompt, the model's text as text (EVIL made no <img> above).
    sample_rows = doc.by_id("samples").find("tbody")[0].find("tr")
    assert [[td.text for td in tr.find("td")] for tr in sample_rows] == [
        ['"def "', "main():\n    return 0"],
        ['"The "', EVIL],
    ]
    assert doc.by_id("samples-line").text.startswith("after round 20 · 40 tokens")


def test_dashboard_shows_poll_errors(chromium: str, server: StatusServer) -> None:
    server.code = 500
    doc = parse(render_dom(server.url, wait_ms=2500))

    assert server.hits.count("/v1/status") >= 2, "the page must keep polling after a failure"
    error = doc.by_id("error")
    assert "hidden" not in error.attrs
    assert "HTTP 500" in error.text and "retrying" in error.text
    assert "stale" in doc.by_id("updated").attrs.get("class", "")


def test_dashboard_empty_run(chromium: str, server: StatusServer) -> None:
    status = canned_status(n_rounds=0)
    status["peers"] = []
    status["deadline_in_s"] = None
    server.status = status
    doc = parse(render_dom(server.url, wait_ms=2500))

    assert doc.by_id("round").text == "1"
    assert doc.by_id("deadline").text == "—"
    assert doc.by_id("loss-chart").find("path") == []
    assert doc.by_id("bytes-chart").find("rect") == []
    assert "no peers yet" in doc.by_id("peers").text
    assert "no rounds yet" in doc.by_id("rounds").text


def test_screenshot_writes_png(chromium: str, server: StatusServer, tmp_path: Path) -> None:
    server.status = canned_status()
    out = tmp_path / "dashboard.png"
    screenshot(server.url, out, wait_ms=2500, size=(1280, 1400))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1280, 1400)


@pytest.mark.slow
@pytest.mark.long  # a browser over a real coordinator; the screenshot test runs by default
def test_dashboard_served_by_a_real_coordinator(chromium: str, tmp_path: Path) -> None:
    """The page as the coordinator serves it, fed by its live /v1/status while 2 workers
    train: both peers listed, rounds in the table, a loss curve drawn."""
    from covey.local.cluster import LocalCluster

    spec = tmp_path / "run.toml"
    spec.write_text(
        'name = "dashboard"\n[model]\nsize = "nano"\n[data]\nbatch_size = 4\nseq_len = 64\n'
        "[algorithm]\ninner_steps = 4\n[rounds]\ndeadline_min_s = 4\neval_batches = 1\n"
    )
    with LocalCluster(spec, tmp_path) as cluster:
        cluster.start_coordinator()
        cluster.start_worker("w0")
        cluster.start_worker("w1")
        status = cluster.wait_for(
            lambda s: sum(r["val_loss"] is not None for r in s["rounds"]) >= 3,
            180,
            "3 evaluated rounds",
        )
        doc = parse(render_dom(cluster.url + "/"))
    rows = doc.by_id("peers").find("tbody")[0].find("tr")
    assert {tr.attrs["data-peer"] for tr in rows} == {cluster.ids["w0"], cluster.ids["w1"]}
    assert doc.by_id("run-name").text == "dashboard"
    round_rows = doc.by_id("rounds").find("tbody")[0].find("tr")
    assert len(round_rows) >= len(status["rounds"]) >= 3
    (val,) = doc.by_id("loss-chart").find("path", **{"class": "val"})
    assert path_points(val.attrs["d"]) >= 3
    assert len(doc.by_id("bytes-chart").find("rect")) >= 3
    assert len(doc.by_id("samples").find("tbody")[0].find("tr")) == 3  # the default prompts
