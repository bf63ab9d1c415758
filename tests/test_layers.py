"""The package's structure: no import cycles, imports that point down covey.layers.LAYERS,
honest peers that import no adversary code, and modules of at most 500 lines. The import
graph is read from the source (tests/import_graph.py): function-level imports and those
under `if TYPE_CHECKING:` count like any other."""

from __future__ import annotations

from pathlib import Path

import pytest

from covey.layers import LAYERS
from tests.import_graph import ROOT, cycles, graph, modules, reachable

MAX_LINES = 500
# the code of cheating peers (tests and demos), and the modules that start cheaters: the
# command lines, the demos and the benches that measure what cheats can do
ADVERSARY = {
    "covey.peer.adversary",
    "covey.peer.cheater",
    "covey.peer.cheater_aggregator",
    "covey.peer.house",
    "covey.rl.cheats",
    "covey.rl.cheater",
    "covey.rl.sampling_cheats",
    "covey.serve.cheater",
    "covey.serve.house",
}
STARTERS = (
    "covey.__main__",
    "covey.cli",
    "covey.bench.",
    "covey.rl.cli",
    "covey.rl.demo",
    "covey.serve.cli",
)
HONEST_PEERS = (
    "covey.peer.worker",
    "covey.peer.worker_publish",
    "covey.peer.worker_state",
    "covey.peer.worker_overlap",
    "covey.peer.validator",
    "covey.rl.worker",
    "covey.rl.validator",
    "covey.rl.trainer",
    "covey.serve.worker",
    "covey.serve.validator",
    "covey.serve.service",
    "covey.serve.app",
    "covey.swarm.server",
    "covey.swarm.trainer",
)


def layer_of(module: str) -> int:
    """The index in LAYERS (0 is the top) of `module`'s top-level name."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: {top!r} is in no layer of covey.layers.LAYERS")


def test_the_graph_sees_every_kind_of_import() -> None:
    edges = graph()
    assert "covey.trust.identity" in edges["covey.coordinator.liveness"]  # module level
    assert "covey.bench.swarm" in edges["covey.bench.swarm_codecs"]  # in a function
    assert "covey.coordinator.db" in edges["covey.coordinator.liveness"]  # TYPE_CHECKING
    assert "covey.coordinator.rejected" in edges["covey.coordinator.auth"]  # relative


def test_cycles_are_found() -> None:
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []


def test_no_import_cycles() -> None:
    found = cycles()
    assert not found, "modules that import each other (directly or through others):\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )


def test_every_top_level_module_has_one_layer() -> None:
    named = [n for layer in LAYERS for n in layer]
    assert len(named) == len(set(named)), "a name in two layers"
    tops = {m.split(".")[1] if "." in m else "__init__" for m in modules()}
    assert tops == set(named), (tops - set(named), set(named) - tops)


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{a} (line {line}) imports {b}: layer {LAYERS[layer_of(a)]} above {LAYERS[layer_of(b)]}"
        for a, targets in graph().items()
        for b, line in targets.items()
        if layer_of(b) < layer_of(a)
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


@pytest.mark.parametrize("module", HONEST_PEERS)
def test_honest_peers_import_no_adversary_code(module: str) -> None:
    assert module in modules(), f"{module} is gone: name the honest module that replaced it"
    reached = reachable(module)
    bad = [" -> ".join(reached[m]) for m in sorted(ADVERSARY & reached.keys())]
    assert not bad, f"{module} reaches adversary code:\n" + "\n".join(bad)


def test_only_starters_reach_adversary_code() -> None:
    assert modules().keys() >= ADVERSARY
    bad = [
        " -> ".join(chain)
        for m in sorted(modules())
        if m not in ADVERSARY and not m.startswith(STARTERS)
        for a, chain in reachable(m).items()
        if a in ADVERSARY
    ]
    assert not bad, "modules that are not starters reach adversary code:\n" + "\n".join(bad)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_over_the_limit() -> None:
    sizes = {str(p.relative_to(ROOT)): lines(p) for p in modules().values()}
    over = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them along a seam): {over}"
