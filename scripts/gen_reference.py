"""Writes the generated reference pages of the documentation site:

- docs/reference/config.md from the pydantic models of a run spec (covey.config.RunConfig
  and SimConfig, covey.swarm.config.SwarmConfig, and every table they hold): each field's
  TOML key, type, default, constraints and description;
- docs/reference/cli.md from the command line (the typer app behind the `covey` entry
  point, read through click: every command, its arguments and options, and their help).

    python scripts/gen_reference.py            # rewrite both pages
    python scripts/gen_reference.py --check    # exit 1 if a committed page is out of date

tests/test_docs.py fails when the committed pages differ from what this writes.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
CONFIG_PAGE = ROOT / "docs" / "reference" / "config.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
ENTRY_POINT = "covey.cli:main"  # pyproject.toml's [project.scripts] covey


# --- configuration ------------------------------------------------------------------------


_NOTE = r"(?:\.\./shared/DESIGN\.md|issues? \d+)"


def _plain(text: str) -> str:
    """`text` without the notes the code's help carries about where a thing was asked for
    (work items, design notes outside the repository): the reference says what things are."""
    text = re.sub(_NOTE + r"[^;()]*;\s*", "", text)
    return re.sub(r"\s*\(" + _NOTE + r"[^()]*\)", "", text)


def _cell(text: str) -> str:
    """`text` made safe for one cell of a Markdown table (and `<x>` outside code spans
    shown, not taken for HTML)."""
    parts = " ".join(_plain(text).split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def _resolve(annotation: Any, owner: type[BaseModel]) -> Any:
    """`annotation` with a forward reference (a model defined further down its module)
    looked up in the module of the model that holds the field."""
    if isinstance(annotation, typing.ForwardRef):
        return vars(sys.modules[owner.__module__])[annotation.__forward_arg__]
    return annotation


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names (through unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "none"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " or ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    return re.sub(r"\b(typing|collections\.abc)\.", "", str(annotation))


def _value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, BaseModel):
        return "its table's defaults"
    return repr(value)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return _value(field.default_factory())  # type: ignore[call-arg]
    return _value(field.default)


_BOUNDS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "length ≥",
           "max_length": "length ≤", "pattern": "matches"}  # fmt: skip


def _constraints(field: FieldInfo) -> str:
    out = []
    for meta in field.metadata:
        for name, symbol in _BOUNDS.items():
            value = getattr(meta, name, None)
            if value is not None:
                out.append(f"{symbol} `{value}`" if name == "pattern" else f"{symbol} {value}")
    return ", ".join(out)


def _doc(model: type[BaseModel]) -> str:
    doc = model.__doc__ or ""
    if (
        not doc
        or doc == BaseModel.__doc__
        or model.__doc__ is getattr(model.__base__, "__doc__", None)
    ):
        return ""
    return " ".join(_plain(doc).split())


def _table(model: type[BaseModel], key: str, out: list[str], seen: set[tuple[str, str]]) -> None:
    """`model`'s fields as the TOML table `key` (empty: the top level), then its sub-tables."""
    if (key, model.__name__) in seen:
        return
    seen.add((key, model.__name__))
    title = f"`[{key}]`" if key else "top level"
    method = model.model_fields.get("method")
    if key and method is not None and typing.get_origin(method.annotation) is typing.Literal:
        title += f' with `method = "{typing.get_args(method.annotation)[0]}"`'  # a union member
    out.append(f"### {title}: {model.__name__}\n")
    if doc := _doc(model):
        out.append(doc + "\n")
    rows, subs = [], []
    for name, field in model.model_fields.items():
        annotation = _resolve(field.annotation, model)
        models = _models_in(annotation)
        sub_key = f"{key}.{name}" if key else name
        if models:
            if len(models) == 1:
                subs.append((models[0], sub_key))
                kind = f"table `[{sub_key}]`"
            else:
                subs += [(m, sub_key) for m in models]
                kind = "table `[" + sub_key + "]`, one of " + ", ".join(m.__name__ for m in models)
            rows.append((name, kind, "", "", field.description or ""))
            continue
        rows.append((name, _type_name(annotation), _default(field), _constraints(field),
                     field.description or ""))  # fmt: skip
    out.append("| key | type | default | constraints | description |")
    out.append("|---|---|---|---|---|")
    for name, kind, default, limits, text in rows:
        out.append(
            f"| `{name}` | {_cell(kind)} | {_cell(default)} | {_cell(limits)} | {_cell(text)} |"
        )
    out.append("")
    for sub, sub_key in subs:
        _table(sub, sub_key, out, seen)


def config_reference() -> str:
    from covey.config import RunConfig, SimConfig
    from covey.swarm.config import SwarmConfig

    out = [
        "# Configuration reference\n",
        "Generated by `python scripts/gen_reference.py` from the pydantic models in "
        "`covey/config/` and `covey/swarm/config.py`; do not edit by hand. Every table is "
        "checked when a spec is loaded: unknown keys are refused, and every value is checked "
        "against its type and constraints. A key left out takes its default. The "
        "[configuration page](../configuration.md) explains how specs are used.\n",
    ]
    specs = [
        (RunConfig, "Run spec: `covey coordinator run.toml`",
         "A networked training run. Its hash, with the data's fingerprint, is the run id."),
        (SimConfig, "Simulation spec: `covey sim spec.toml`",
         "An in-process simulation; flags of `covey sim` override the file."),
        (SwarmConfig, "SWARM spec: `covey swarm coordinator --set KEY=VALUE`",
         "A SWARM pipeline run; each `--set` sets one field, and its hash is the run id."),
    ]  # fmt: skip
    for model, title, text in specs:
        out.append(f"## {title}\n")
        out.append(text + "\n")
        _table(model, "", out, set())
    return "\n".join(out).rstrip() + "\n"


# --- command line -------------------------------------------------------------------------


def typer_app() -> Any:
    """The typer app behind the `covey` entry point: the one the module of `main` holds
    (covey.cli as one module, or the package module that defines `main`), else the first
    the entry point's own module holds."""
    import typer

    module_name, func_name = ENTRY_POINT.split(":")
    module = importlib.import_module(module_name)
    main = getattr(module, func_name)
    for namespace in (getattr(main, "__globals__", {}), vars(module)):
        if isinstance(namespace.get("app"), typer.Typer):
            return namespace["app"]
        apps = [v for v in namespace.values() if isinstance(v, typer.Typer)]
        if apps:
            return apps[0]
    raise SystemExit(f"no typer app next to {ENTRY_POINT}")


def _help(text: str | None) -> str:
    """A command's help as Markdown paragraphs (`<x>` outside code spans shown as text)."""
    lines = _plain((text or "").strip().replace("\b\n", "")).split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(lines))


def _context(command: Any, name: str, parent: Any = None) -> Any:
    """A click context for `command`, from the click the command is built on (typer may
    carry its own copy of click, so the classes are never imported here: duck typing)."""
    return type(command).context_class(command, info_name=name, parent=parent)


def _param_rows(command: Any, ctx: Any) -> list[tuple[str, str]]:
    rows = []
    for param in command.get_params(ctx):
        if param.param_type_name not in ("argument", "option") or getattr(param, "hidden", False):
            continue
        if param.name in ("help", "install_completion", "show_completion"):
            continue
        record = param.get_help_record(ctx)
        if record is None:
            continue
        required = " (required)" if param.required else ""
        rows.append((f"`{record[0]}`{required}", record[1]))
    return rows


def _command(command: Any, path: list[str], out: list[str], parent: Any = None) -> None:
    ctx = _context(command, path[-1], parent)
    depth = min(len(path) + 1, 4)
    out.append(f"{'#' * depth} `{' '.join(path)}`\n")
    if text := _help(command.help):
        out.append(text + "\n")
    usage = " ".join(command.collect_usage_pieces(ctx))
    out.append(f"```\n{' '.join(path)} {usage}\n```\n")
    if rows := _param_rows(command, ctx):
        out.append("| argument or option | help |")
        out.append("|---|---|")
        out += [f"| {_cell(name)} | {_cell(text)} |" for name, text in rows]
        out.append("")
    if hasattr(command, "list_commands"):
        for name in sorted(command.list_commands(ctx)):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                _command(sub, [*path, name], out, ctx)


def cli_reference() -> str:
    import typer.main

    command = typer.main.get_command(typer_app())
    out = [
        "# CLI reference\n",
        "Generated by `python scripts/gen_reference.py` from the `covey` command line; do not "
        "edit by hand. `covey COMMAND --help` prints the same.\n",
    ]
    _command(command, ["covey"], out)
    return "\n".join(out).rstrip() + "\n"


def pages() -> dict[Path, str]:
    return {CONFIG_PAGE: config_reference(), CLI_PAGE: cli_reference()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args()
    stale = []
    for path, text in pages().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.relative_to(ROOT))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(map(str, stale))}; run `python scripts/gen_reference.py`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
