"""Errors a person can act on: each becomes one line that says what is wrong and what to do.

The command line turns a `UserError` into `error: <message>` and exit code 2, with no
traceback (``covey --debug`` shows it). This module holds the checks the entrypoints share
and imports neither torch nor the network stack at module level, so ``--help`` stays instant:

- `describe_validation_error`: a pydantic error on a run spec, one line, every key named by
  its dotted path (never an empty location) and a misspelled key answered with the closest
  valid one (difflib);
- `check_data_paths`: every ``--data`` / ``data.paths`` entry exists;
- `check_coordinator`: a coordinator URL has a scheme and answers like a covey coordinator;
  a server that answers something else is refused at once, not retried until a timeout,
  and one that cannot be reached is reported while it is waited for;
- `user_message`: the one line for an input error no command caught (a missing file, a
  damaged checkpoint or database), which `covey.cli.main` prints instead of a traceback.
"""

from __future__ import annotations

import difflib
import re
import time
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError


class UserError(Exception):
    """Wrong input a person can fix; its message says what is wrong and what to do."""


# --- configuration ----------------------------------------------------------------------


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field can hold (one, or the members of a tagged union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out.extend(_submodels(arg))
    return out


def _tag_of(model: type[BaseModel]) -> str | None:
    """The literal a union member is chosen by (`method = "diloco"`), if it has one."""
    field = model.model_fields.get("method")
    return field.default if field is not None and isinstance(field.default, str) else None


def _resolve(root: type[BaseModel], loc: Sequence[Any]) -> tuple[list[str], type[BaseModel]]:
    """Walk an error location: the clean dotted path (union tags dropped) and the model
    that holds the last key. Stops at the first element that is not a field."""
    path: list[str] = []
    model = root
    i = 0
    while i < len(loc):
        key = loc[i]
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            break
        path.append(key)
        i += 1
        members = _submodels(field.annotation)
        if len(members) == 1:
            model = members[0]
        elif members and i < len(loc):
            chosen = [m for m in members if _tag_of(m) == loc[i]]
            if not chosen:
                break
            model, i = chosen[0], i + 1
        else:
            break
    return path, model


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key a spec can set (for naming keys in model-level messages)."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        out.append(dotted)
        for sub in _submodels(field.annotation):
            out.extend(p for p in _field_paths(sub, dotted + ".") if p not in out)
    return out


def _key_in_message(root: type[BaseModel], message: str) -> str | None:
    """The first spec key a model-level message mentions ("steps (3) is fewer than ...")."""
    known = set(_field_paths(root))
    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*", message):
        if word in known:
            return word
    return None


def describe_validation_error(root: type[BaseModel], error: ValidationError) -> str:
    """One line naming every problem of a spec by its dotted key, with a fix where one is
    known: the closest valid key for a misspelled one, the allowed range for a value."""
    problems: list[str] = []
    for err in error.errors():
        loc = err["loc"]
        msg = str(err["msg"]).removeprefix("Value error, ")
        path, holder = _resolve(root, loc)
        if err["type"] == "extra_forbidden":
            bad = str(loc[-1])
            where = ".".join(path)
            valid = sorted(holder.model_fields)
            close = difflib.get_close_matches(bad, valid, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}"
            table = f" in [{where}]" if where else ""
            problems.append(f"unknown key {bad!r}{table}: {hint}")
            continue
        key = ".".join(path) or _key_in_message(root, msg) or "spec"
        got = f" (got {err['input']!r})" if path and not isinstance(err.get("input"), dict) else ""
        problems.append(f"{key}: {msg}{got}")
    return "; ".join(problems) + " -- fix the TOML file or the flag"


# --- data -------------------------------------------------------------------------------


def check_data_paths(paths: Iterable[str]) -> None:
    """Raise `UserError` naming the first data path that does not exist."""
    for p in paths:
        if not Path(p).expanduser().exists():
            raise UserError(
                f"--data path {p!r} does not exist (resolved: {Path(p).expanduser().resolve()}); "
                "pass an existing text/JSONL file or a directory of them"
            )


# --- the coordinator --------------------------------------------------------------------

# what GET /v1/run answers in every mode (covey.coordinator.host_app); "mode" is absent
# from a rounds coordinator of an older covey, and a rounds one also names its data
RUN_KEYS = ("run_id", "coordinator_key", "spec")
MODE_KEYS = {"rounds": ("corpus_fingerprint",), "rl": (), "swarm": ()}
MODE_COMMANDS = {"rounds": "covey worker", "rl": "covey rl worker", "swarm": "covey swarm server"}


def check_url(url: str) -> str:
    """The URL without a trailing slash, or `UserError` when it has no http(s) scheme/host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        guess = url if "://" in url else f"http://{url}"
        raise UserError(
            f"coordinator URL {url!r} needs a scheme and a host; did you mean {guess!r}?"
        )
    return url.rstrip("/")


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def check_coordinator(
    url: str,
    wait_s: float,
    poll_s: float = 0.5,
    say: Callable[[str], None] | None = _stderr,
    say_every_s: float = 10.0,
    say_after_s: float = 2.0,
    modes: tuple[str, ...] = ("rounds",),
) -> dict[str, Any]:
    """GET <url>/v1/run and return the run description, of a coordinator in one of `modes`
    (rounds, rl, swarm); one in another mode is refused at once, naming it.

    A server that cannot be reached yet (connection refused, timeout, 5xx: a coordinator
    still starting) is retried until `wait_s` has passed, then `UserError`. Meanwhile `say`
    is told, once it has failed for `say_after_s` (a coordinator just starting gets that
    grace), the URL and the error, and every `say_every_s` after that how long it has
    waited: a peer pointed at the wrong port does not sit silent. A server that answers
    but not as a covey coordinator (404, another status, non-JSON, JSON without a run id)
    is refused at once: waiting would not change its answer."""
    import httpx

    base = check_url(url)
    start = time.monotonic()
    deadline = start + wait_s
    next_say, said = start + say_after_s, False
    why = ""
    with httpx.Client(timeout=min(5.0, max(wait_s, 1.0))) as http:
        while True:
            try:
                resp = http.get(f"{base}/v1/run")
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code < 500:
                    return _as_run(base, resp, modes)
                why = f"HTTP {resp.status_code}"
            now = time.monotonic()
            if say is not None and now >= next_say and now + poll_s <= deadline:
                waited = now - start
                if not said:
                    said = True
                    say(f"cannot reach the coordinator at {base} ({why}); retrying for up to "
                        f"{wait_s:.0f} s (--connect-timeout)")  # fmt: skip
                else:
                    say(f"still cannot reach {base} after {waited:.0f} s of {wait_s:.0f} ({why})")
                next_say = start + say_every_s * (waited // say_every_s + 1)  # at 10, 20 s...
            if now + poll_s > deadline:
                raise UserError(
                    f"coordinator {base} unreachable for {wait_s:.0f} s ({why}); check that "
                    "`covey coordinator` runs there, or raise --connect-timeout"
                )
            time.sleep(poll_s)  # bounded by the deadline above


def _as_run(base: str, resp: Any, modes: tuple[str, ...]) -> dict[str, Any]:
    not_covey = f"{base} is not a covey coordinator"
    fix = "check the host and port (the coordinator prints its URL when it starts)"
    if resp.status_code != 200:
        raise UserError(f"{not_covey}: GET /v1/run answered HTTP {resp.status_code}; {fix}")
    try:
        body = resp.json()
    except ValueError:
        kind = resp.headers.get("content-type", "?")
        raise UserError(f"{not_covey}: GET /v1/run answered {kind}, not JSON; {fix}") from None
    mode = body.get("mode", "rounds") if isinstance(body, dict) else None
    keys = (*RUN_KEYS, *MODE_KEYS.get(str(mode), ()))
    if not isinstance(body, dict) or mode not in MODE_KEYS or not all(k in body for k in keys):
        raise UserError(f"{not_covey}: GET /v1/run lacks {', '.join(keys)}; {fix}")
    if mode not in modes:
        raise UserError(
            f"{base} is a covey coordinator in {mode} mode, not {' or '.join(modes)}: "
            f"for that run use `{MODE_COMMANDS[mode]}`"
        )
    return body


# --- the last line of defence -------------------------------------------------------------


def user_message(exc: BaseException) -> str | None:
    """One line for an error that comes from the input (a missing or unreadable file, a
    damaged checkpoint or database) and reaches the command line unhandled; None for any
    other exception (a bug: its traceback is shown)."""
    import sqlite3

    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None and exc.errno is not None:
        return f"{exc.filename}: {exc.strerror}; check the path"
    if isinstance(exc, sqlite3.DatabaseError):
        return f"a database could not be read ({exc}); the file is damaged or not covey's"
    if type(exc).__name__ == "SafetensorError":  # safetensors: without importing it here
        return f"a checkpoint could not be read ({exc}); the file is damaged or truncated"
    if type(exc).__name__ in ("CheckpointError", "SnapshotError"):
        return str(exc)
    return None
