"""The import graph of the covey package, read from its source with `ast` (nothing is
imported): which covey module each module imports, at module level, inside functions and
under `if TYPE_CHECKING:` alike. Shared by the structure tests (test_layers.py)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "covey"


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _module_of(name: str) -> str | None:
    """The module that importing `name` runs last: `name` itself, else its longest prefix
    that is a module (`covey.x.Thing` -> `covey.x`)."""
    known = modules()
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> dict[str, int]:
    """The covey modules `module` imports -> the line of the first such import."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            names = [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] != "covey":
                continue
            target = _module_of(name)
            if target is not None and target != module:
                found.setdefault(target, node.lineno)
    return found


@cache
def graph() -> dict[str, dict[str, int]]:
    """module -> {imported covey module: line}."""
    return {m: imports_of(m) for m in modules()}


def reachable(start: str) -> dict[str, list[str]]:
    """Every module `start` imports directly or through others -> one chain that leads
    there (start first)."""
    edges = graph()
    paths = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop()
        for n in edges[m]:
            if n not in paths:
                paths[n] = [*paths[m], n]
                todo.append(n)
    del paths[start]
    return paths


def cycles(edges: Mapping[str, Iterable[str]] | None = None) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan) of `edges`
    (default: the package's graph), each sorted."""
    edges = graph() if edges is None else edges
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)
