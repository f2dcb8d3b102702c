"""The package's imports point down its layers and never form a cycle; every package is
in the wheel.

Layers, bottom to top: errors -> dirs -> model -> step -> profiling -> backends -> engine
-> server -> cli -> __main__ (the console script's entry). A module may import its own layer
and the layers below it; every import statement counts, module level or inside a function.
"""

import ast
import re
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


PROBES = ("getattr", "hasattr", "setattr")
# The engine and the server reach a backend through its typed contract only (`Backend` and
# `BackendCaps`, backends/contract.py). The attribute probes left are on objects that are no
# backend and have no typed form: (module, the probed object's source text) -> the reason.
PROBES_ALLOWED = {
    ("rocforge_rt.server.command_line", "action"): "argparse's Action, our environment_variable",
    ("rocforge_rt.server.http.app", "exc"): "any exception: status_code, detail where it has them",
    ("rocforge_rt.server.logs", "record"): "a LogRecord: `fields` where the call passed extra=",
}


def attribute_probes(source: str) -> list[tuple[int, str]]:
    """(line, the probed object's source text) of every getattr, hasattr and setattr call."""
    return [
        (node.lineno, ast.unparse(node.args[0]) if node.args else "")
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES
    ]


def test_the_engine_and_the_server_probe_no_attributes() -> None:
    """No getattr, hasattr or setattr in the engine or the server, but on the objects
    PROBES_ALLOWED lists: a backend's members and capabilities are declared, not probed."""
    probes = [
        f"{name}:{line}: {what}"
        for name, path in MODULES.items()
        if layer(name) in ("engine", "server")
        for line, what in attribute_probes(path.read_text())
        if (name, what) not in PROBES_ALLOWED
    ]
    assert not probes, "attribute probes:\n" + "\n".join(probes)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("getattr(backend, 'kv_dtype', 'f16')", [(1, "backend")]),
        ("x = 1\nif hasattr(self.backend, 'warm_up'): pass", [(2, "self.backend")]),
        ("setattr(engine.backend, 'mode', m)", [(1, "engine.backend")]),
        ("backend.caps.kv_dtype", []),
    ],
)
def test_the_probe_finder_finds_probes(source: str, found: list[tuple[int, str]]) -> None:
    assert attribute_probes(source) == found


# A kernel variant stub: a kernel definition (RF_KERNEL or RF_KERNEL_BOUNDS[_ONE](...), then
# `void name(params) {body}`) whose body, comments dropped, is one statement calling a
# template instantiation (`callee<...>(...);`) or a function-like macro (an upper-case name).
# Such kernels are rows of rocforge_rt/backends/gpu/kernel_variants.py, generated at compile.
_KERNEL_DEFINITION = re.compile(r"\bRF_KERNEL(?:_BOUNDS(?:_ONE)?\s*\([^)]*\))?\s+void\s+(\w+)\s*\(")
_FORWARDING_BODY = re.compile(r"\s*(?:\w+\s*<[^;{}]*>|[A-Z][A-Z0-9_]*)\s*\([^;]*\)\s*;\s*")


def _closing(code: str, start: int, pair: str) -> int:
    """The index of the bracket that closes the one opened just before `start`."""
    depth = 1
    for i in range(start, len(code)):
        depth += (code[i] == pair[0]) - (code[i] == pair[1])
        if depth == 0:
            return i
    raise ValueError(f"unbalanced {pair}")


def variant_stubs(source: str) -> list[str]:
    """The kernels of a kernel source defined as variant stubs (see above)."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S)
    stubs = []
    for match in _KERNEL_DEFINITION.finditer(code):
        after = _closing(code, match.end(), "()") + 1
        if not code[after:].lstrip().startswith("{"):
            continue  # a declaration
        open_brace = code.index("{", after) + 1
        if _FORWARDING_BODY.fullmatch(code[open_brace : _closing(code, open_brace, "{}")]):
            stubs.append(match[1])
    return stubs


def test_no_kernel_source_defines_a_variant_stub() -> None:
    found = {
        path.name: variant_stubs(path.read_text())
        for path in sorted((ROOT / "kernels").glob("*.hip"))
    }
    assert not {name: stubs for name, stubs in found.items() if stubs}, (
        "kernel variants belong in rocforge_rt/backends/gpu/kernel_variants.py"
    )


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("RF_KERNEL_BOUNDS(RF_GEMV_THREADS) void rf_gemv_q4_0_b1_n2(RF_GEMV_PARAMS) {\n"
         "    RF_GEMV_CALL(rf_q4_0_format, 2, false, 1);\n}\n", ["rf_gemv_q4_0_b1_n2"]),
        ("RF_KERNEL_BOUNDS(64)\nvoid rf_embed_q8_0(const uint8_t* t, int n) {\n"
         "    rf_embed_rows<rf_q8_0_value>(t, n);  // the shared loop\n}\n", ["rf_embed_q8_0"]),
        ("RF_KERNEL void rf_a(int n) { RF_ATTN_DECODE(32, false); }", ["rf_a"]),
        ("RF_KERNEL void rf_b(int n) { rf_helper(n); }", []),  # a plain function, no variant
        ("RF_KERNEL void rf_c(int n) { rf_pdl_begin(); rf_go<1>(n); }", []),
        ("RF_KERNEL_BOUNDS(32) void rf_d(int n);", []),  # a declaration
    ],
)  # fmt: skip
def test_the_stub_finder_finds_stubs(source: str, found: list[str]) -> None:
    assert variant_stubs(source) == found


MAX_MODULE_LINES = 500
# Modules past MAX_MODULE_LINES on purpose: path -> why. A module listed here that is no
# longer that long fails the test too, so the list stays true.
LONG_MODULES = {
    "scripts/hardening_bars.py": "issue 62's six bars as one runnable record: each scenario"
    " beside its bar, sharing the serve and /proc helpers and one parser of their parameters",
    "scripts/bench_serve.py": "one benchmark and its report: the daemon run, the engine-only"
    " run, llama-batched-bench beside them, and the table and plot of their one JSON",
}


def test_no_module_is_over_500_lines_but_the_listed_ones() -> None:
    """The package, the client and the scripts (not tests/, not kernels/)."""
    sources = [
        *(ROOT / PACKAGE).rglob("*.py"),
        *(ROOT / "clients").rglob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
    ]
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sources}
    too_long = sorted(
        f"{path}: {n} lines"
        for path, n in lines.items()
        if n > MAX_MODULE_LINES and path not in LONG_MODULES
    )
    assert not too_long, (
        f"over {MAX_MODULE_LINES} lines (split by concern, or list in LONG_MODULES with why):\n"
        + "\n".join(too_long)
    )
    short = sorted(path for path in LONG_MODULES if lines.get(path, 0) <= MAX_MODULE_LINES)
    assert not short, f"LONG_MODULES lists modules no longer over {MAX_MODULE_LINES}: {short}"
