"""No import cycle between videotrain modules, and every module imports.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import``
anywhere in a file counts, including the lazy ones inside functions (a cycle hidden in a
function body is still two modules that cannot be understood, tested or moved apart).
``from videotrain.pkg import name`` is an edge to ``videotrain.pkg.name`` when that is a
module, else to the package ``videotrain.pkg``; relative imports are resolved. A module is
not counted as importing the packages above it (importing ``videotrain.bench.cli`` runs
``videotrain/bench/__init__.py`` first, which is Python's doing, not a dependency the code
states).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

import videotrain

ROOT_PACKAGE = "videotrain"
PACKAGE_DIR = Path(videotrain.__file__).parent

# (importing module, imported module) -> the lines of the importing file that state it
Edges = dict[tuple[str, str], list[int]]


def module_files(package_dir: Path = PACKAGE_DIR, root: str = ROOT_PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (``videotrain.data.decode``), packages by
    their ``__init__.py``."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (root, *path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(target: str, known: Iterable[str] | set[str]) -> str | None:
    """The deepest known module that ``target`` (a dotted name) names or lies in."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in known:
            return name
    return None


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> Edges:
    """The package modules ``module`` imports anywhere in ``source``, each with its lines."""
    package = module if is_package else module.rpartition(".")[0]
    edges: Edges = {}
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from ..pkg import y
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # a submodule by name, else an attribute of the module (or package) itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for target in targets:
            resolved = _resolve(target, known)
            if resolved is not None and resolved != module:
                edges.setdefault((module, resolved), []).append(node.lineno)
    return edges


def import_graph(files: Mapping[str, Path]) -> Edges:
    """Edges between the modules of ``files`` (``module_files``), with the lines stating them."""
    known = set(files)
    edges: Edges = {}
    for module, path in files.items():
        edges.update(imports_of(path.read_text(), module, path.name == "__init__.py", known))
    return edges


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> successors) that hold a
    cycle: two or more nodes, or one node with an edge to itself. Each sorted, in sorted order."""
    nodes = sorted(set(graph) | {w for succ in graph.values() for w in succ})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in nodes:  # iterative DFS: no recursion limit on a deep chain
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, successors = work[-1]
            for w in successors:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1 or v in graph.get(v, ()):
                        found.append(sorted(component))
    return sorted(found)


def shortest_cycle(graph: Mapping[str, Iterable[str]], component: list[str]) -> list[str]:
    """One shortest cycle through the first node of ``component``, inside it:
    ``[a, b, ..., a]``."""
    start, inside = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if v != start else [start, start]
            if w in inside and w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{component} holds no cycle through {start}")


def describe_cycles(edges: Edges, files: Mapping[str, Path],
                    root: Path = PACKAGE_DIR.parent) -> list[str]:
    """One entry per knot of modules that import each other: its shortest loop, then every
    import inside the knot with the file and line that states it."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    entries = []
    for component in strongly_connected(graph):
        inside = set(component)
        lines = [" -> ".join(shortest_cycle(graph, component))]
        for (a, b), linenos in sorted(edges.items()):
            if a in inside and b in inside:
                where = files[a].relative_to(root).as_posix()
                lines.append(f"    {where}:{','.join(map(str, sorted(set(linenos))))} "
                             f"imports {b}")
        entries.append("\n".join(lines))
    return entries


# ---------------------------------------------------------------------- the finder itself
def test_strongly_connected_finds_the_cycles_of_a_hand_graph() -> None:
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["f"], "f": ["e", "g"],
             "g": ["g"], "h": ["a"], "i": ["j"], "j": []}
    assert strongly_connected(graph) == [["a", "b", "c"], ["e", "f"], ["g"]]
    assert shortest_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert shortest_cycle(graph, ["g"]) == ["g", "g"]
    acyclic = {"a": ["b", "c"], "b": ["c"], "c": [], "d": ["a"]}
    assert strongly_connected(acyclic) == []


def test_a_long_chain_closed_at_the_end_is_one_cycle() -> None:
    chain = {str(i): [str(i + 1)] for i in range(5000)}  # deeper than the recursion limit
    assert strongly_connected(chain) == []
    chain["5000"] = ["0"]
    (component,) = strongly_connected(chain)
    assert len(component) == 5001


def test_imports_of_counts_lazy_relative_and_submodule_imports() -> None:
    known = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.sub.d"}
    source = (
        "import os\n"
        "from pkg.sub import c\n"                 # a submodule by name: pkg.sub.c
        "from pkg.sub import CONSTANT\n"          # an attribute: the package pkg.sub
        "def f():\n"
        "    from . import b\n"                   # lazy and relative: pkg.b
        "    import pkg.sub.d as d\n"             # lazy: pkg.sub.d
        "    from .sub.c import thing\n"          # relative into a submodule: pkg.sub.c
        "    from pkg.a import helper\n"          # itself: no edge
    )
    edges = imports_of(source, "pkg.a", is_package=False, known=known)
    assert edges == {("pkg.a", "pkg.sub.c"): [2, 7], ("pkg.a", "pkg.sub"): [3],
                     ("pkg.a", "pkg.b"): [5], ("pkg.a", "pkg.sub.d"): [6]}
    # in a package's __init__, "." is the package itself; ".." its parent
    init = imports_of("from . import c\nfrom .. import a\n", "pkg.sub", is_package=True,
                      known=known)
    assert init == {("pkg.sub", "pkg.sub.c"): [1], ("pkg.sub", "pkg.a"): [2]}


def test_a_lazy_import_back_is_reported_as_a_cycle(tmp_path: Path) -> None:
    """Two files that import each other, one of them only inside a function: one cycle,
    named with the file and line of each import."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import run\n")
    (pkg / "b.py").write_text("def run():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    files = module_files(pkg, "pkg")
    edges = import_graph(files)
    assert set(edges) == {("pkg.a", "pkg.b"), ("pkg.b", "pkg.a"), ("pkg.c", "pkg.a")}
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    assert strongly_connected(graph) == [["pkg.a", "pkg.b"]]
    (cycle,) = describe_cycles(edges, files, tmp_path)
    assert cycle.splitlines() == ["pkg.a -> pkg.b -> pkg.a", "    pkg/a.py:1 imports pkg.b",
                                  "    pkg/b.py:2 imports pkg.a"]


# ---------------------------------------------------------------------- the package
def test_no_import_cycle_between_videotrain_modules() -> None:
    files = module_files()
    cycles = describe_cycles(import_graph(files), files)
    assert not cycles, "import cycles between videotrain modules:\n" + "\n".join(cycles)


def test_every_module_imports() -> None:
    """Every module pkgutil finds imports (a broken import fails here, not in the one command
    that reaches it), and the graph above covered exactly these modules."""
    failed: list[str] = []
    names = [ROOT_PACKAGE]
    for info in pkgutil.walk_packages(videotrain.__path__, f"{ROOT_PACKAGE}.",
                                      onerror=lambda name: failed.append(f"{name}: walk")):
        names.append(info.name)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - every failure is listed below
            failed.append(f"{name}: {type(err).__name__}: {err}")
    assert not failed, "modules that fail to import:\n" + "\n".join(failed)
    assert sorted(names) == sorted(module_files())
