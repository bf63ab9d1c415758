"""The one way a command reads a run spec: a TOML file, flag overrides and ``--set a.b=v``
pairs, validated by the spec's pydantic model, every problem in one line (`UserError`).

``--set`` takes a dotted key into the spec (``rounds.max_rounds=5``, ``algorithm.codec=int4``)
and a value read as JSON when it parses (numbers, true/false, lists, quoted strings) and as
a plain string otherwise (``model.size=nano``). Keys are checked like the TOML's: an unknown
one is named with the closest valid key. Imports no torch (``--help`` stays instant), but
to fix a run spec's "auto" verify device (`fix_run_compute`).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from covey.config import merge
from covey.errors import UserError, describe_validation_error

SET_HELP = "a spec field, KEY=VALUE with a dotted KEY (rounds.max_rounds=5); repeat"


def parse_sets(pairs: Iterable[str]) -> dict[str, Any]:
    """``a.b=value`` pairs as a nested dict; `UserError` for a pair without ``=`` or key."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        parts = key.strip().split(".")
        if not eq or not all(p.strip() for p in parts):
            raise UserError(f"--set {pair!r}: expected KEY=VALUE with a dotted KEY (a.b=1)")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        for p in parts[:-1]:
            child = node.setdefault(p.strip(), {})
            if not isinstance(child, dict):
                raise UserError(f"--set {pair!r}: {p} is set to a value and used as a table")
            node = child
        node[parts[-1].strip()] = value
    return out


def fix_run_compute(spec: Any, cuda: bool | None = None) -> Any:
    """A run spec (covey.config.RunConfig) whose `[peer] verify_device` is "auto" with it
    fixed for this machine: cuda with a GPU (`cuda` None: ask torch, imported only then),
    else cpu (covey.devices.plan_run_compute). The class is then the spec's, hashed into
    the run id and served to every peer, so all of them read the same one. Any other spec
    is returned as it is."""
    from covey.config import RunConfig

    if not isinstance(spec, RunConfig) or spec.peer.verify_device != "auto":
        return spec
    from covey.devices import run_verify_class

    peer = spec.peer.model_copy(update={"verify_device": run_verify_class("auto", cuda)})
    return spec.model_copy(update={"peer": peer})


def load_spec(
    loader: Callable[..., Any] | type[BaseModel],
    path: Path | None = None,
    overrides: dict[str, Any] | None = None,
    sets: Iterable[str] = (),
) -> Any:
    """The validated spec, with the ``--set`` pairs laid over the flag `overrides`:
    `loader(path, **values)` for a covey.config loader (which reads the TOML at `path`), or
    `loader.model_validate(values)` for a pydantic model (`path`, whose TOML the caller
    read into `overrides`, then only names the file in messages). `UserError` naming every
    problem by its dotted key."""
    values = merge(overrides or {}, parse_sets(sets))
    is_model = isinstance(loader, type) and issubclass(loader, BaseModel)
    root = loader if is_model else typing.get_type_hints(loader).get("return")
    where = f" in {path}" if path else ""
    try:
        if is_model:
            return fix_run_compute(loader.model_validate(values))
        return fix_run_compute(loader(path, **values))
    except ValidationError as e:
        if isinstance(root, type) and issubclass(root, BaseModel):
            message = describe_validation_error(root, e)
            raise UserError(f"invalid configuration{where}: {message}") from None
        lines = [f"{'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}" for err in e.errors()]
        raise UserError(f"invalid configuration{where}: " + "; ".join(lines)) from None
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    except ValueError as e:  # a TOML file that does not parse
        raise UserError(f"{path}: {e}" if path and str(path) not in str(e) else str(e)) from None
