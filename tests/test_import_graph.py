"""The project's import graph has no circles: no module imports one that imports it back, directly or
through others.

Both module-level and function-local imports count: a local import is still a dependency, and
moving an import into a function to break a circle at import time leaves the two modules depending
on each other. Edges run to the module named (`from a.b import c` reaches `a.b.c` when that is a
module, else `a.b`); importing a submodule also runs its packages' `__init__`, but those implicit
edges are not counted: a package's `__init__` re-exporting its submodules is the usual layout, not a
circle. The graph is read from the source (ast), so the test imports nothing it checks.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("taco_triton", "autotune")


def module_files() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _statements(tree: ast.Module, at_import: bool):
    """Every node of `tree`, or with `at_import` those that run when the module is imported
    (not inside a function's body)."""
    if not at_import:
        yield from ast.walk(tree)
        return
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path], at_import: bool = False,
               external: bool = False) -> set[str]:
    """The project modules that `name` imports anywhere in its source (module level or in a
    function; with `at_import` only what runs when it is imported); with `external` also the
    top-level names of the other packages it imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _statements(ast.parse(path.read_text(), str(path)), at_import):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = target
            while resolved and resolved not in modules:  # `import a.b.c` where only a.b is ours, or an attribute
                resolved = resolved.rpartition(".")[0]
            if resolved and resolved != name:
                found.add(resolved)
            elif not resolved and external:
                found.add(target.split(".")[0])
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_relative_local_and_package_imports():
    graph = import_graph()
    assert "taco_triton.config" in graph["taco_triton.layout"]  # from .config import ...
    assert "taco_triton.kernels.compress" in graph["autotune.registry"]  # a function-local import
    assert "taco_triton.parallel" in graph["taco_triton.examples.gpt"]  # from ..parallel import (a package)
    assert "taco_triton.collectives.p2p" in graph["taco_triton.collectives"]  # from . import p2p


def test_the_circle_finder_finds_a_circle_through_three_modules():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    found = circles(import_graph())
    assert not found, "import circles (each group's modules reach one another):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


@pytest.mark.parametrize("lower, upper", [
    ("taco_triton.config", "taco_triton.kernels"),
    ("taco_triton.kernels", "autotune"),
    ("taco_triton.kernels", "taco_triton.collectives"),
    ("taco_triton.collectives", "taco_triton.parallel"),
    ("taco_triton.collectives", "taco_triton.policy"),
    ("taco_triton.policy", "taco_triton.parallel"),
    ("taco_triton.policy", "taco_triton.integrations"),
    ("taco_triton.parallel", "taco_triton.examples"),
    ("taco_triton.integrations", "taco_triton.examples"),
    ("taco_triton.parallel", "taco_triton.stepmodel"),
    ("taco_triton.integrations", "taco_triton.stepmodel"),
    ("taco_triton.stepmodel", "taco_triton.plan"),
    ("taco_triton.plan", "taco_triton.examples"),
    ("taco_triton.stepmodel", "taco_triton.examples"),
], ids=lambda s: s.rpartition(".")[2])
def test_the_flow_runs_one_way(lower, upper):
    """config -> kernels -> ops -> collectives -> policy -> parallel/integrations -> examples; the
    tuner sits above the kernels (it times them) and the kernels never import it. The step-time
    model (stepmodel, its entry plan) reads parallel/integrations and sits below the examples."""
    graph = import_graph()
    wrong = sorted(f"{m} -> {t}" for m, ts in graph.items() if m == lower or m.startswith(lower + ".")
                   for t in ts if t == upper or t.startswith(upper + "."))
    assert not wrong, wrong


#: The collectives' modules, lowest first: each imports only modules of its own or lower rows.
#: The CUDA seam and the process-group calls import no other collectives module; the
#: shapes (what each collective computes) and plans (how a call is prepared) never import the
#: driver, the call, or the public modules; the public API sits on top.
COLLECTIVES_LAYERS = [
    ["_streams", "_pg"],
    ["work"],
    ["_errors", "_handshake", "_worker"],
    ["_shapes"],
    ["_plan"],
    ["_driver"],
    ["_steady"],
    ["_call"],
    ["compressed", "p2p"],
]


def test_the_collectives_modules_import_only_lower_rows():
    graph = import_graph()
    pkg = "taco_triton.collectives"
    row = {f"{pkg}.{m}": i for i, mods in enumerate(COLLECTIVES_LAYERS) for m in mods}
    assert set(row) == {m for m in graph if m.startswith(pkg + ".")}, "every collectives module has a row"
    wrong = sorted(f"{m} -> {t}" for m in row for t in graph[m] if t == pkg or row.get(t, -1) > row[m])
    assert not wrong, wrong
    outside = sorted(f"{m} -> {t}" for m in row for t in graph[m]
                     if t.startswith(("taco_triton.parallel", "taco_triton.integrations", "taco_triton.policy")))
    assert not outside, outside


def test_the_state_imports_no_project_module():
    """`taco_triton.state` sits below everything (kernels, ops and collectives keep their state in it)."""
    found = sorted(import_graph()["taco_triton.state"])
    assert not found, found


def test_the_error_records_import_no_kernel_module():
    """Error records are host bookkeeping: the kernels write them through a launch argument."""
    kernels = sorted(t for t in import_graph()["taco_triton.collectives._errors"] if t.startswith("taco_triton.kernels"))
    assert not kernels, kernels


def test_importing_the_collectives_imports_no_triton():
    """Triton is imported by the first launch (`import taco_triton` must not import it: a CPU user
    sets TRITON_INTERPRET first): nothing the collectives' modules import when they are imported,
    directly or through other project modules, imports Triton."""
    modules = module_files()
    seen, todo, reaches = set(), [m for m in modules if m.startswith("taco_triton.collectives")], []
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        found = imports_of(name, modules[name], modules, at_import=True, external=True)
        if "triton" in found:
            reaches.append(name)
        todo.extend(found)
    assert not reaches, reaches
    assert "taco_triton.kernels.compress" in modules and "triton" in imports_of(
        "taco_triton.kernels.compress", modules["taco_triton.kernels.compress"], modules, at_import=True,
        external=True), "the reader sees a kernel module's Triton import"
