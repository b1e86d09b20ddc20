"""No import cycle among the modules of ``pinrotate_core`` and ``flows``, lazy imports included.

Every module is parsed with ``ast`` (never imported): top-level imports, imports inside functions
and ``if TYPE_CHECKING:`` blocks all count, relative imports are resolved. A cycle hidden in a
function body is still a cycle in the design (issue 10). Cycles the project knows about and is
removing are listed in KNOWN_CYCLES; any other cycle fails, and so does a known one that is gone
(so the list only ever shrinks).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pinrotate_core", "flows")

# Each entry: the modules of one cycle (a strongly connected component), exactly. Empty it as they go.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the packages (``__init__`` names its package)."""
    out: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_modules(module: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The project modules ``module`` imports anywhere in its source (names trimmed to a known module)."""
    is_package = path.name == "__init__.py"
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()

    def add(name: str, *, own_name: bool = False) -> None:
        """An import of ``name``: it runs every package on the way down, then the module itself.
        ``own_name``: the import needs a name defined in ``name`` itself (not one of its submodules)."""
        # "a.b.C" names a thing in module a.b: the longest prefix that is a module of ours.
        while name and name not in known:
            name = name.rpartition(".")[0]
        parts = name.split(".") if name else []
        for depth in range(1, len(parts) + 1):
            step = ".".join(parts[:depth])
            if step not in known or step == module:
                continue
            if module.startswith(step + ".") and not (own_name and step == name):
                continue  # our own package: already initialising, reaching a submodule through it is fine
            found.add(step)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    add(submodule)
                else:
                    add(base, own_name=True)
    return found


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    files = module_files(root, packages)
    return {module: imported_modules(module, path, files) for module, path in files.items()}


def cycles(graph: Mapping[str, Iterable[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), plus self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: set[frozenset[str]] = set()
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.add(frozenset(component))
    return found


def describe(cycle: frozenset[str]) -> str:
    return " <-> ".join(sorted(cycle))


# -- the project ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def project_cycles() -> set[frozenset[str]]:
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 20 and "pinrotate_core.rotation" in graph, "the packages were not found"
    return cycles(graph)


def test_no_import_cycle_but_the_known_ones(project_cycles: set[frozenset[str]]) -> None:
    new = sorted(describe(c) for c in project_cycles - KNOWN_CYCLES)
    assert not new, "import cycles: " + "; ".join(new)


def test_every_known_cycle_still_exists(project_cycles: set[frozenset[str]]) -> None:
    gone = sorted(describe(c) for c in KNOWN_CYCLES - project_cycles)
    assert not gone, "no longer a cycle (or a different one now), remove from KNOWN_CYCLES: " + "; ".join(gone)


# -- the detector itself --------------------------------------------------------------------------


def write_package(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_detector_finds_cycles_through_function_level_and_relative_imports(tmp_path: Path) -> None:
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from .sub.c import thing\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import typing\nif typing.TYPE_CHECKING:\n    from ..a import X\n",
        "pkg/d.py": "import pkg.e\n",
        "pkg/e.py": "def g():\n    import pkg.d as d\n",
        "pkg/ok.py": "from pkg import a\nfrom .sub import c\nimport os\n",
    })
    assert cycles(import_graph(tmp_path, ["pkg"])) == {frozenset({"pkg.a", "pkg.b", "pkg.sub.c"}),
                                                       frozenset({"pkg.d", "pkg.e"})}


def test_the_detector_tells_a_package_init_cycle_from_reaching_a_submodule(tmp_path: Path) -> None:
    write_package(tmp_path, {
        # pkg/__init__ imports x; x needs a name from pkg/__init__ itself: a real cycle.
        "pkg/__init__.py": "from .x import run\nHELPER = 1\n",
        "pkg/x.py": "from . import HELPER\nrun = HELPER\n",
        # sub/y reaches its sibling through its package: fine.
        "pkg/sub/__init__.py": "from .y import go\n",
        "pkg/sub/y.py": "from . import z\ngo = z\n",
        "pkg/sub/z.py": "",
    })
    assert cycles(import_graph(tmp_path, ["pkg"])) == {frozenset({"pkg", "pkg.x"})}
