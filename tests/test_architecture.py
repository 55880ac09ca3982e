"""The package's shape: its imports run one way, and the core knows nothing of distribution.

Principle 4 of the design, checked on the source: a learner can follow the imports from any
file down to the engine without going around in a circle, and reads the core (autograd, layers,
model, optimizer) without meeting MPI. The import graph is read from the source with `ast`
(nothing is imported): an import counts where it runs when its module is loaded, that is,
anywhere but inside a function; relative imports are resolved; `from pkg import submodule`
imports the submodule, and a package's `__init__` is counted only where a name is taken from
it. An import inside a function is a deliberate late bind, and it may reach up the graph; but
moving an import into a function hides a circle from Python, not from a reader, so a second
test counts those too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minidist"

# The core: the engine (autograd and its operations, both kernel paths), the layers, the model,
# the optimizers, the data, the serial trainer and what it uses (chapters 1, 10, 11).
ENGINE = ["tensor", "functional", "operands", "shape_ops", "fused", "fused_fast", "kernels", "gradcheck", "nn",
          "model", "optim", "data", "recompute", "moe"]  # minidist/core/
CORE = [f"core.{name}" for name in ENGINE] + [
    "plan.recompute_cost", "precision", "precision.formats", "precision.mixed_precision", "precision.loss_scale",
    "precision.fp8", "training.train", "plan.memory",
]
# What is about distribution: the processes and messages, the strategies, and what is built on them.
DISTRIBUTED = [
    "comm", "parallel", "training.layout", "training.strategies", "demo", "demo_flags", "frameworks", "plan.search",
    "plan.predict", "lab", "bench", "assignments", "trace",
]
# The package root holds the entry points and their plumbing only; everything else lives in the
# folder of its layer (core, precision, comm, parallel, plan, training, frameworks, ...).
ROOT = {"__init__", "cli", "demo", "demo_flags", "runtime", "timeline"}


def module_files(package: Path) -> dict[str, Path]:
    """Every module of `package` by dotted name (a package by its own name, for its __init__)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _load_time_imports(tree: ast.Module, late: bool):
    """The import statements of a module: those that run when it is loaded (anywhere but inside
    a function), and with `late` also those inside functions."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            elif late or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.append(child)


def import_graph(package: Path = PACKAGE, late: bool = False) -> dict[str, set[str]]:
    """{module: the modules of the package it imports}."""
    files = module_files(package)
    graph = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _load_time_imports(ast.parse(path.read_text(encoding="utf-8"), str(path)), late):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: from its package (a module's parent, a package itself)
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module
                submodules = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in files]
                targets = submodules + ([source] if len(submodules) < len(node.names) else [])
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as [a, b, ..., a], or None (an iterative depth-first search)."""
    state = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if start in state:
            continue
        path, todo = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while todo:
            step = next(todo[-1], None)
            if step is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(step) == 1:
                return path[path.index(step):] + [step]
            elif step not in state:
                state[step] = 1
                path.append(step)
                todo.append(iter(sorted(graph[step])))
    return None


def path_to(graph: dict[str, set[str]], start: str, goal) -> list[str] | None:
    """The shortest import chain from `start` to a module for which goal(module) holds."""
    previous, frontier = {start: None}, [start]
    while frontier:
        following = []
        for module in frontier:
            if goal(module):
                chain = []
                while module is not None:
                    chain.append(module)
                    module = previous[module]
                return chain[::-1]
            for step in sorted(graph[module]):
                if step not in previous:
                    previous[step] = module
                    following.append(step)
        frontier = following
    return None


def _in(parts):
    names = [f"minidist.{p}" for p in parts]
    return lambda module: any(module == n or module.startswith(n + ".") for n in names)


def test_no_import_circles():
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_no_import_circles_through_late_imports_either():
    circle = find_circle(import_graph(late=True))
    assert circle is None, ("import circle, counting imports inside functions: " + " -> ".join(circle)
                            + " (move the name both sides need to the module that owns it)")


def test_the_core_knows_nothing_of_distribution():
    graph = import_graph(late=True)
    for name in CORE:
        assert f"minidist.{name}" in graph, f"minidist/{name.replace('.', '/')}.py is gone: update CORE"
        chain = path_to(graph, f"minidist.{name}", _in(DISTRIBUTED))
        assert chain is None, "the core imports distribution: " + " -> ".join(chain)


def test_the_graph_sees_circles(tmp_path):
    """The reader above finds what it should (a test that cannot fail is a defect): a circle
    through a relative import, a package's `from . import submodule` and an absolute import,
    and no circle where the import that closes it runs late (inside a function)."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "from .sub.c import THING\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "THING = 1\ntry:\n    import pkg.a\nexcept ImportError:\n    pass\n",
        "pkg/d.py": "from pkg import sub\n\ndef late():\n    from pkg import d2\n",
        "pkg/d2.py": "from .d import late\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.sub"} and graph["pkg.d2"] == {"pkg.d"}
    assert find_circle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    (tmp_path / "pkg/sub/c.py").write_text("THING = 1\n")
    assert find_circle(import_graph(tmp_path / "pkg")) is None
    assert find_circle(import_graph(tmp_path / "pkg", late=True)) == ["pkg.d", "pkg.d2", "pkg.d"]
    assert path_to(graph, "pkg.a", lambda m: m == "pkg.sub.c") == ["pkg.a", "pkg.b", "pkg.sub.c"]


@pytest.mark.parametrize("name", ["minidist.core.functional", "minidist.comm.p2p", "minidist.comm.collectives"])
def test_the_graph_reads_minidist(name):
    """A few edges the code plainly has, so that a broken reader cannot pass by seeing nothing."""
    want = {"minidist.core.functional": {"minidist.core.tensor", "minidist.core.fused", "minidist.core.fused_fast"},
            "minidist.comm.p2p": {"minidist.comm.world", "minidist.comm.traffic", "minidist.comm.waiting"},
            "minidist.comm.collectives": {"minidist.comm.algorithms", "minidist.comm.cost"}}[name]
    assert want <= import_graph()[name]


def test_no_two_checks_share_a_name():
    """A `check_*` function says which rule it checks by its name: two with one name (say,
    "check_layout" for a pipeline's shape and for a saved checkpoint) would leave a reader
    guessing which rule a call applies. The layout's one rule is `Layout.validate`."""
    where: dict[str, list[str]] = {}
    for name, path in module_files(PACKAGE).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("check_"):
                where.setdefault(node.name, []).append(name)
    shared = {fn: modules for fn, modules in where.items() if len(modules) > 1}
    assert not shared, f"check functions defined in more than one module: {shared}"


def test_the_core_folder_stands_alone():
    """minidist/core/ (chapter 1's engine) imports nothing of minidist outside it: the folder is
    the first layer, and every other one builds on it."""
    graph = import_graph(late=True)
    outside = {(module, target) for module, targets in graph.items() if module.startswith("minidist.core")
               for target in targets if not target.startswith("minidist.core")}
    assert not outside, f"the core reaches outside minidist/core/: {sorted(outside)}"
    assert {f"minidist.core.{name}" for name in ENGINE} <= set(graph)


def test_the_root_holds_only_entry_points():
    """A reader opening minidist/ sees the layers as folders: a new module goes into one."""
    loose = {path.stem for path in PACKAGE.glob("*.py")} - ROOT
    assert not loose, f"modules at the package root: {sorted(loose)}; move each into the folder of its layer"
    assert {"core", "precision", "comm", "parallel", "plan", "training"} <= {p.name for p in PACKAGE.iterdir() if p.is_dir()}
