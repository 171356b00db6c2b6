"""The import graph of src/daftrain: packages import only downwards, and no module imports itself back.

Layers, low to high (docs/design.md): errors, allocator, calls, callbacks, rss, lineage, layout, params, config ->
kernels -> auto, pool -> saved -> budget -> integrations, demo; the package root re-exports from them; the command
line sits on top.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "daftrain"
LAYER = {"errors": 0.0, "allocator": 0.0, "calls": 0.0, "callbacks": 0.0, "rss": 0.05, "lineage": 0.05, "layout": 0.1,
         "params": 0.1, "config": 0.2, "kernels": 1, "auto": 2, "pool": 2, "saved": 3, "budget": 4, "integrations": 5,
         "demo": 5, "cli": 7}
ROOT_LAYER = 6  # the package root re-exports the public names; only the command line sits above it


def _module_name(path: Path) -> str:
    parts = ("daftrain", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """daftrain modules ``path`` imports, outside ``if TYPE_CHECKING:`` blocks."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    modules = {_module_name(p) for p in SRC.rglob("*.py")}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("daftrain"):
                # ``from .pkg import module`` depends on that module; ``from .module import name`` on the module.
                for alias in node.names:
                    found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("daftrain"))
    return {t for t in found if t in modules and t != name}


@functools.cache
def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in SRC.rglob("*.py")}


def _layer(module: str) -> float:
    parts = module.split(".")
    return LAYER[parts[1]] if len(parts) > 1 else ROOT_LAYER


def test_every_top_level_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in SRC.iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert units == set(LAYER), units ^ set(LAYER)


@pytest.mark.parametrize("module", sorted(_graph()))
def test_imports_go_down_or_sideways_within_a_package(module):
    own = _layer(module)
    for target in _graph()[module]:
        same_package = target.split(".")[1:2] == module.split(".")[1:2]
        assert same_package or _layer(target) < own, f"{module} imports {target}, a layer above or beside it"


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
