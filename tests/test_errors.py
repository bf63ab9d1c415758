"""Errors a person can act on: one line that says what is wrong and what to do, exit code 2,
no traceback (`covey --debug` shows it)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pydantic import ValidationError

from covey.config import RunConfig, SimConfig
from covey.errors import UserError, check_coordinator, check_url, describe_validation_error


def covey(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "covey.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    """The single error line of a refused command (fails the test otherwise)."""
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def describe(root: type, data: dict) -> str:
    with pytest.raises(ValidationError) as e:
        root.model_validate(data)
    return describe_validation_error(root, e.value)


# --- configuration (pure) ---------------------------------------------------------------


def test_misspelled_keys_get_the_closest_valid_one() -> None:
    assert "unknown key 'workrs': did you mean 'workers'?" in describe(SimConfig, {"workrs": 3})
    msg = describe(SimConfig, {"algorithm": {"inner_step": 5}})
    assert "unknown key 'inner_step' in [algorithm]: did you mean 'inner_steps'?" in msg
    # a tagged union member (streaming) is walked to its own fields
    msg = describe(SimConfig, {"algorithm": {"method": "streaming", "fragmnts": 2}})
    assert "did you mean 'fragments'?" in msg
    msg = describe(RunConfig, {"rounds": {"heartbeat": 3}})
    assert "in [rounds]: did you mean 'heartbeat_s'?" in msg
    # nothing close: the valid keys are listed instead
    assert "valid keys: " in describe(SimConfig, {"churn": {"zzz": 1}})


def test_out_of_range_values_name_the_key_and_the_value() -> None:
    msg = describe(SimConfig, {"network": {"uplink_mbps": -1}})
    assert msg.startswith("network.uplink_mbps: Input should be greater than 0 (got -1)")
    msg = describe(SimConfig, {"algorithm": {"method": "diloco", "outer_momentum": 1.5}})
    assert msg.startswith("algorithm.outer_momentum: ")
    # a check across keys has no location in pydantic: the key is found in the message
    msg = describe(SimConfig, {"steps": 3})
    assert msg.startswith("steps: steps (3) is fewer than one round"), msg
    msg = describe(RunConfig, {"rounds": {"heartbeat_s": 10, "dead_after_s": 5}})
    assert msg.startswith("rounds"), msg
    assert not msg.startswith(":") and "; :" not in msg


def test_url_without_a_scheme_is_refused_with_a_guess() -> None:
    with pytest.raises(UserError, match=re.escape("did you mean 'http://127.0.0.1:8470'")):
        check_url("127.0.0.1:8470")
    with pytest.raises(UserError, match="needs a scheme"):
        check_url("ftp://host/")
    assert check_url("http://h:1/") == "http://h:1"


# --- the command line -------------------------------------------------------------------


def test_toml_typo_and_range_errors_are_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text("workers = 0\n[algorithm]\ninner_stesp = 5\n")
    line = one_line_error(covey("sim", str(spec)))
    assert "did you mean 'inner_steps'?" in line and "workers: " in line and str(spec) in line


def test_missing_data_path_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(covey("sim", "--data", str(tmp_path / "nope.txt")))
    assert "nope.txt" in line and "does not exist" in line
    spec = tmp_path / "run.toml"
    spec.write_text(f'[data]\npaths = ["{tmp_path / "gone"}"]\n')
    assert "does not exist" in one_line_error(covey("coordinator", str(spec)))


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    r = covey("--debug", "sim", "--data", str(tmp_path / "nope.txt"))
    assert r.returncode == 2 and "Traceback" in r.stderr and "does not exist" in r.stderr


def test_version() -> None:
    from covey import __version__

    r = covey("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"covey {__version__}"


class _NotCovey(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/html/v1/run":  # a web server that answers 200 with a page
            body, status, kind = b"<html>hello</html>", 200, "text/html"
        else:
            body, status, kind = b"not found", 404, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def not_covey() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotCovey)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("command", ["worker", "validator"])
@pytest.mark.parametrize(("suffix", "expected"), [("", "HTTP 404"), ("/html", "not JSON")])
def test_a_server_that_is_not_a_coordinator_is_refused_at_once(
    not_covey: str, command: str, suffix: str, expected: str
) -> None:
    # the default --connect-timeout is 120 s: the command would time out if it retried
    line = one_line_error(covey(command, "--coordinator", not_covey + suffix, timeout=100))
    assert "is not a covey coordinator" in line and expected in line


def test_the_refusal_does_not_wait(not_covey: str) -> None:
    """Timed in-process (a loaded machine makes the command's torch import slow)."""
    start = time.monotonic()
    with pytest.raises(UserError, match="is not a covey coordinator"):
        check_coordinator(not_covey, wait_s=60)
    assert time.monotonic() - start < 5


def test_url_without_scheme_and_unreachable_coordinator() -> None:
    line = one_line_error(covey("worker", "--coordinator", "127.0.0.1:8470"))
    assert "needs a scheme" in line
    # a closed port is waited for (a coordinator may be starting) but only --connect-timeout
    line = one_line_error(
        covey("validator", "--coordinator", "http://127.0.0.1:9", "--connect-timeout", "1")
    )
    assert "unreachable for 1 s" in line
