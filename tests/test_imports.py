"""The import graph of `hypic_jax`: no cycles, and the layers import downwards only.

Layers, lowest first (`LAYERS`): the definitions that import nothing of the package (`options`, `core.summary`,
`checkpoint.embedded`); the kernels; the transfer-operator core; the stitching of layouts; the models; checkpoints;
the cache; parallelism; the engine; training; the server, the command line, the demo and the package's own
`__init__`. Every import counts, module-level and function-local alike (a local import defers the dependency, it
does not remove it), with `from . import` resolved. The graph is built from the source with `ast` alone: nothing
is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hypic_jax",)

BASE = ("hypic_jax.options", "hypic_jax.core.summary", "hypic_jax.checkpoint.embedded")
LAYERS = (
    ("base", BASE),
    ("kernels", ("hypic_jax.kernels",)),
    ("core", ("hypic_jax.core",)),
    ("stitch", ("hypic_jax.stitch",)),
    ("models", ("hypic_jax.models",)),
    ("checkpoint", ("hypic_jax.checkpoint",)),
    ("cache", ("hypic_jax.cache",)),
    ("parallel", ("hypic_jax.parallel",)),
    ("engine", ("hypic_jax.engine",)),
    ("train", ("hypic_jax.train",)),
    ("top", ("hypic_jax.serve", "hypic_jax.cli", "hypic_jax.demo", "hypic_jax")),
)


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


def layer_of(module: str) -> int:
    """The index in `LAYERS` of the layer holding `module` (the most specific prefix wins)."""
    best, depth = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (_under(module, prefix) if prefix != "hypic_jax" else module == prefix) and len(prefix) > depth:
                best, depth = index, len(prefix)
    assert best is not None, f"{module} belongs to no layer of LAYERS"
    return best


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT, PACKAGES)


def test_graph_sees_the_package(graph):
    """The walk finds the layers this file is about, and function-local imports count."""
    assert {"hypic_jax.core.linear_attn.kernel", "hypic_jax.kernels.gdn", "hypic_jax.models",
            "hypic_jax.checkpoint.hf.base", "hypic_jax.engine.engine"} <= set(graph)
    assert "hypic_jax.kernels.gdn" in graph["hypic_jax.core.linear_attn.kernel"]
    assert "hypic_jax.engine" in graph["hypic_jax"]  # imported inside `hypic_jax.__getattr__`


def test_no_import_cycles(graph):
    assert_acyclic(graph)


def test_every_module_belongs_to_a_layer(graph):
    for module in graph:
        layer_of(module)


def test_layers_import_downwards_only(graph):
    """A module imports modules of its own layer or of layers below it, never above."""
    bad = sorted((m, t, LAYERS[layer_of(t)][0]) for m, targets in graph.items() for t in targets
                 if layer_of(t) > layer_of(m))
    assert not bad, "imports of a layer above: " + "; ".join(f"{m} -> {t} ({name})" for m, t, name in bad)


def test_the_base_definitions_import_nothing_of_the_package(graph):
    for module in BASE:
        assert not graph[module], f"{module} imports {sorted(graph[module])}"


def test_kernels_import_only_kernels_and_the_base(graph):
    bad = {(m, t) for m, targets in graph.items() if _under(m, "hypic_jax.kernels")
           for t in targets if not (_under(t, "hypic_jax.kernels") or t in BASE)}
    assert not bad, f"kernel modules importing above their layer: {sorted(bad)}"


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
