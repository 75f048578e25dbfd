"""The package layering, read from the source: every import, function-level ones included.

Packages import one way, ``accounting``, ``shuffler`` <- ``clients`` <- ``server`` <- ``deploy``, always under the
one installed namespace ``shuffledp``; no module imports itself back through another (no cycles); ``accounting``
pulls in no torch, flwr or grpc, and ``shuffler`` no torch or flwr. Lazy imports by name
(a module named in a string: ``importlib.import_module``, ``python -m``, the dispatcher's table) count too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("accounting", "shuffler", "clients", "server", "deploy")
#: A package may import the packages of a lower rank and its own modules, nothing else.
RANK = {"accounting": 0, "shuffler": 0, "clients": 1, "server": 2, "deploy": 3}
FORBIDDEN_THIRD_PARTY = {"accounting": {"torch", "flwr", "grpc"}, "shuffler": {"torch", "flwr"}}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            name = f"shuffledp.{package}" if path.stem == "__init__" else f"shuffledp.{package}.{path.stem}"
            found[name] = path
    return found


def _imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """``(line, imported module or name)`` for every import in ``path``, at any depth, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.stem == "__init__" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("shuffledp.") \
                and " " not in node.value:
            yield node.lineno, node.value.split(":")[0]  # a module named in a string (lazy dispatch, -m)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The first-party module ``name`` refers to (``pkg.mod.attr`` -> ``pkg.mod``), or None for third party."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {_resolve(name, modules) for _, name in _imports(path, module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def test_every_package_is_found() -> None:
    packages = {name.split(".")[1] for name in _modules()}
    assert packages == set(PACKAGES)
    assert "shuffledp.server.app" in _modules() and "shuffledp.deploy.cli" in _modules()


@pytest.mark.parametrize("package", PACKAGES)
def test_first_party_imports_use_the_shuffledp_namespace_and_point_down(package: str) -> None:
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        if module.split(".")[1] != package:
            continue
        for line, name in _imports(path, module):
            top = name.split(".")[0]
            if top in PACKAGES:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name!r} outside the shuffledp namespace")
            target = _resolve(name, modules)
            if target is None:
                if top in FORBIDDEN_THIRD_PARTY.get(package, ()):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name!r}")
                continue
            other = target.split(".")[1]
            if other != package and RANK[other] >= RANK[package]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({package} may import only "
                             f"{sorted(p for p in PACKAGES if RANK[p] < RANK[package]) or 'itself'})")
    assert wrong == []


def test_there_are_no_import_cycles() -> None:
    graph = _graph()
    # Tarjan's strongly connected components; any component of more than one module is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_checks_catch_what_they_check(tmp_path: Path) -> None:
    """The walker sees function-level, relative and by-name imports (a cycle hidden in a function is found)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from shuffledp.deploy import local\n    from . import job\n"
                   "    importlib.import_module('shuffledp.clients.app')\n    import accounting.bounds\n")
    found = sorted(name for _, name in _imports(src, "shuffledp.server.m"))
    assert found == ["accounting.bounds", "shuffledp.clients.app", "shuffledp.deploy.local", "shuffledp.server.job"]
