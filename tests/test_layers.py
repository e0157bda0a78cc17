"""The package's layers, read from its source: no import cycle, and the runtimes on the ground floor.

The import graph is computed here with ast over the folders pyproject's package-dir maps into
`edgespec` (runtimes/ is edgespec.runtimes, ...). An import inside a function counts: it runs as soon
as the function does, so it ties the modules as firmly as one at the top. An import under
`if TYPE_CHECKING:` does not: it never runs (annotations only).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What a runtime may import from the package: other runtimes and the error classes. Not the exporters
# (torch and the export toolchain), not the model stores, not the engine layer above them.
RUNTIMES = "edgespec.runtimes"
RUNTIMES_MAY_IMPORT = ("edgespec.runtimes", "edgespec.errors")


def package_dirs() -> dict[str, Path]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        tomllib = pytest.importorskip("tomli")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {"edgespec": ROOT / "edgespec", **{pkg: ROOT / folder for pkg, folder in setuptools["package-dir"].items()}}


def modules() -> dict[str, Path]:
    found = {}
    for pkg, folder in package_dirs().items():
        for f in folder.rglob("*.py"):
            parts = [p for p in f.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found.setdefault(".".join([pkg, *parts]), f)
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skipped |= {id(n) for n in ast.walk(stmt)}
    return skipped


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports, anywhere in its file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skipped = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `from edgespec.models import store` names a module
                target = target.rpartition(".")[0]
            if target and target != name and not target.startswith(name + "."):  # a package's own parts
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_the_mapped_folders_and_imports_inside_functions(graph):
    assert "edgespec.runtimes.llamacpp" in graph and "edgespec.models.store" in graph
    assert "edgespec.exporters.bundle" in graph
    # Engine.load imports the loader inside the method: that edge must be seen
    assert "edgespec.loader" in graph["edgespec.engine"]


def test_no_import_cycle(graph):
    found = [c for c in cycles(graph) if not all(m.startswith("edgespec.bench") for m in c)]
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_runtimes_import_nothing_above_them(graph):
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if m == RUNTIMES or m.startswith(RUNTIMES + ".")
                 for t in targets if not any(t == a or t.startswith(a + ".") for a in RUNTIMES_MAY_IMPORT))
    assert not bad, "runtimes import from above the ground floor: " + ", ".join(bad)
