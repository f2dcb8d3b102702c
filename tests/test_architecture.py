"""The package's imports point down its layers and never form a cycle; every package is
in the wheel.

Layers, bottom to top: errors -> dirs -> model -> step -> profiling -> backends -> engine
-> server -> cli -> __main__ (the console script's entry). A module may import its own layer
and the layers below it; every import statement counts, module level or inside a function.
"""

import ast
import tomllib
from pathlib import Path

import pytest

PACKAGE = "rocforge_rt"
ROOT = Path(__file__).resolve().parents[1]
LAYERS = (
    "errors", "dirs", "model", "step", "profiling", "backends", "engine", "server", "cli",
    "__main__",
)  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


MODULES = package_modules()


def imported_modules(name: str, path: Path) -> set[str]:
    """The package modules that `name` imports (a `from pkg import sub` names pkg.sub)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            found.update(f"{stem}.{alias.name}" for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


IMPORTS = {name: imported_modules(name, path) for name, path in MODULES.items()}


def layer(module: str) -> str | None:
    """The layer of a package module (None for the package's own __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_belongs_to_a_layer() -> None:
    unknown = sorted(m for m in MODULES if m != PACKAGE and layer(m) not in LAYERS)
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown}"


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{source} -> {target}"
        for source, targets in IMPORTS.items()
        for target in targets
        if layer(source) is not None
        and layer(target) is not None
        and LAYERS.index(layer(target)) > LAYERS.index(layer(source))
    ]
    assert not upward, "imports pointing up:\n" + "\n".join(sorted(upward))


def test_profiling_imports_no_backend_engine_or_server() -> None:
    edges = [
        f"{source} -> {target}"
        for source, targets in IMPORTS.items()
        if layer(source) == "profiling"
        for target in targets
        if layer(target) in ("backends", "engine", "server")
    ]
    assert not edges, edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_module_import_cycle() -> None:
    cycle = find_cycle(IMPORTS)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def package_of(module: str) -> str:
    """The package (folder) a module lives in; a package's __init__ is its own."""
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def test_no_package_import_cycle() -> None:
    packages: dict[str, set[str]] = {}
    for source, targets in IMPORTS.items():
        for target in targets:
            here, there = package_of(source), package_of(target)
            if here != there and there != PACKAGE:
                packages.setdefault(here, set()).add(there)
    cycle = find_cycle(packages)
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    ("graph", "cyclic"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"a"}}, True),
    ],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], cyclic: bool) -> None:
    assert (find_cycle(graph) is not None) == cyclic


def test_pyproject_lists_every_package_folder() -> None:
    """The wheel holds the packages pyproject.toml lists (not found: two live outside
    rocforge_rt/), so a new folder must be listed there too."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    folders = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert folders <= listed, f"not in pyproject.toml's packages: {sorted(folders - listed)}"
