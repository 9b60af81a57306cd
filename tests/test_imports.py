"""The import graph of `hypic_jax` and `converters`: no cycles, and the layers import downwards only.

Layers, lowest first: the shared definitions (`hypic_jax.summary`) and the Pallas kernels (`hypic_jax.pallas`);
the transfer-operator core (`linear_attn`, `conv`, `rope`, `attention`); the models (`hypic_jax.models`); the
converters and checkpoints; the cache and the engine; the command line, demo and server. Every import counts,
module-level and function-local alike (a local import defers the dependency, it does not remove it), with
`from . import` resolved. The graph is built from the source with `ast` alone: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hypic_jax", "converters")

CORE = {"hypic_jax.linear_attn", "hypic_jax.conv", "hypic_jax.rope", "hypic_jax.attention"}
SHARED = "hypic_jax.summary"


def package_modules(root: Path, packages) -> dict[str, Path]:
    """Module name -> source file for every module of `packages` (directories under `root`)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _known(name: str, modules) -> str | None:
    """The longest prefix of a dotted name that is one of `modules` (None outside them)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return None


def imports_of(name: str, path: Path, modules) -> set[str]:
    """The modules of `modules` that module `name` (source `path`) imports anywhere in its body.

    `from X import Y` is an import of X.Y when that is a module, else of X; `import X.Y` is one of X.Y. The parent
    packages that Python runs on the way (X's __init__ for X.Y) are not counted: a submodule may import its
    package's siblings while the package's __init__ imports it.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            module = _known(target, modules)
            if module is not None and module != name:
                found.add(module)
    return found


def import_graph(root: Path, packages) -> dict[str, set[str]]:
    modules = package_modules(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def assert_acyclic(graph: dict[str, set[str]]) -> None:
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT, PACKAGES)


def test_graph_sees_the_package(graph):
    """The walk finds the layers this file is about, and function-local imports count."""
    assert {"hypic_jax.linear_attn", "hypic_jax.pallas.gdn", "hypic_jax.models", "converters.base"} <= set(graph)
    assert "hypic_jax.pallas.gdn" in graph["hypic_jax.linear_attn"]
    assert "hypic_jax.engine" in graph["hypic_jax"]  # imported inside `hypic_jax.__getattr__`


def test_no_import_cycles(graph):
    assert_acyclic(graph)


def test_kernels_import_only_kernels_and_the_shared_definitions(graph):
    """hypic_jax.pallas sits below the core: it never imports linear_attn, the models, spans or the engine."""
    bad = {(m, t) for m, targets in graph.items() if _under(m, "hypic_jax.pallas")
           for t in targets if not (_under(t, "hypic_jax.pallas") or t == SHARED)}
    assert not bad, f"kernel modules importing above their layer: {sorted(bad)}"


def test_shared_definitions_import_nothing_of_the_package(graph):
    assert not graph[SHARED], f"{SHARED} imports {sorted(graph[SHARED])}"


def test_core_imports_only_the_core_and_the_kernels(graph):
    bad = {(m, t) for m in CORE for t in graph[m]
           if not (t in CORE or t == SHARED or _under(t, "hypic_jax.pallas"))}
    assert not bad, f"core modules importing above their layer: {sorted(bad)}"


def test_models_never_import_converters_or_checkpoints(graph):
    bad = {(m, t) for m, targets in graph.items() if _under(m, "hypic_jax.models")
           for t in targets if _under(t, "converters") or t == "hypic_jax.checkpoint"}
    assert not bad, f"models importing the layer above them: {sorted(bad)}"


def test_checker_fails_on_a_cycle(tmp_path):
    """The same checker on a small package whose cycle hides behind a function-local relative import."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\nfrom pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n    return c\n")
    (pkg / "c.py").write_text("from .a import *\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph == {"pkg": set(), "pkg.sub": set(), "pkg.a": {"pkg.sub.b"}, "pkg.sub.b": {"pkg.c"},
                     "pkg.c": {"pkg.a"}}
    with pytest.raises(AssertionError, match=r"import cycle: pkg\.a -> pkg\.sub\.b -> pkg\.c -> pkg\.a"):
        assert_acyclic(graph)
    (pkg / "c.py").write_text("import os\n")
    assert_acyclic(import_graph(tmp_path, ["pkg"]))


def test_only_the_command_line_imports_the_server(graph):
    """hypic_jax.serve is the top layer: nothing below it imports it (the command line starts it)."""
    bad = {(m, t) for m, targets in graph.items() if not (_under(m, "hypic_jax.serve") or m == "hypic_jax.cli")
           for t in targets if _under(t, "hypic_jax.serve")}
    assert any(_under(t, "hypic_jax.serve") for t in graph["hypic_jax.cli"])
    assert not bad, f"modules importing the server: {sorted(bad)}"


def test_training_sits_above_the_models_and_the_engine(graph):
    """hypic_jax.train may use the models and the engine; only the server, the command line and the demo (which
    pick a default model) may import it, and it never imports the server."""
    users = {"hypic_jax.cli", "hypic_jax.demo"}
    bad = {(m, t) for m, targets in graph.items()
           if not (_under(m, "hypic_jax.train") or _under(m, "hypic_jax.serve") or m in users)
           for t in targets if _under(t, "hypic_jax.train")}
    assert "hypic_jax.models.qwen3_5" in graph["hypic_jax.train.trainer"]
    assert not bad, f"modules importing the trainer: {sorted(bad)}"
    up = {(m, t) for m, targets in graph.items() if _under(m, "hypic_jax.train")
          for t in targets if _under(t, "hypic_jax.serve") or t in users}
    assert not up, f"training importing the layers above it: {sorted(up)}"
