"""Import layering: no import cycles in ``unicon`` + ``data_builders``, and every module imports on its own.

The import graph comes from grimp, which reads every ``import`` statement, including those inside
functions (a lazy import is still an import). Two graphs must be acyclic:

* **modules** -- ``a -> b`` when module ``a`` imports module ``b``;
* **packages** -- the same edges between the top-level parts of ``unicon`` (``unicon.models``,
  ``unicon.worlds``, ``unicon.core``, ...) and ``data_builders``; importing ``unicon.models.base``
  runs ``unicon/models/__init__.py`` first, so a cycle between two packages is a real cycle even
  when no two modules import each other.

Then every module is imported first, in a fresh interpreter, in sorted and in reverse-sorted order:
a hidden cycle (``importlib.import_module`` of a name, a module ``__getattr__``) fails there.

Last, the product explains the code, not its history: no numbered session or issue in ``src/``,
``configs/``, ``tests/``, ``README.md`` or ``docs/*.md``; dated history lives in ``docs/notebook/``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("unicon", "data_builders")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    sys.path.insert(0, str(REPO))  # data_builders lives at the repository root
    try:
        return grimp.build_graph(*PACKAGES, cache_dir=None)
    finally:
        sys.path.remove(str(REPO))


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of a directed graph, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for root in sorted(edges):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(edges.get(root, ())))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return None


def module_edges(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def package_of(module: str) -> str:
    """``unicon.models.ofa.unified`` -> ``unicon.models``; ``data_builders.shapes`` -> ``data_builders``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "unicon" else parts[0]


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_import_cycles(graph):
    cycle = find_cycle(module_edges(graph))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_import_cycles(graph):
    edges: dict[str, set[str]] = {}
    via: dict[tuple[str, str], str] = {}
    for module, imported in module_edges(graph).items():
        for target in imported:
            a, b = package_of(module), package_of(target)
            if a != b:
                edges.setdefault(a, set()).add(b)
                via.setdefault((a, b), f"{module} -> {target}")
    cycle = find_cycle(edges)
    assert cycle is None, "package import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(
        f"  {via[a, b]}" for a, b in zip(cycle, cycle[1:]))


#: The layers, lowest first: a package may import packages of its own layer or below, never above.
#: ``evaluation`` sits under ``training``: a training run calls the suites at epoch end (their
#: callbacks), while a suite never needs the training code and runs on any checkpoint by itself.
#: ``report`` sits over ``evaluation``: the page's suite sections come from the suite registry.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("unicon", "unicon.errors", "unicon.jsonsafe", "unicon.progress", "unicon.core", "unicon.config"),
    ("unicon.worlds",),
    ("unicon.data",),
    ("unicon.embedders",),
    ("unicon.models",),
    ("unicon.losses",),
    ("unicon.loggers", "unicon.lightning_loggers"),
    ("unicon.evaluation",),
    ("unicon.report",),
    ("unicon.training",),
    ("unicon.experiments", "unicon.bench", "unicon.study", "data_builders"),
    ("unicon.cli",),
)
#: Backends: modules of ``unicon.models`` that implement one model family each; none imports another.
BACKENDS = ("unicon.models.ofa", "unicon.models.janus", "unicon.models.decoupled")


def layer_of(package: str) -> int:
    for i, members in enumerate(LAYERS):
        if package in members:
            return i
    raise AssertionError(f"package {package} is in no layer of tests/test_layering.py: LAYERS; place it there")


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every module edge whose target's package sits in a higher layer than its source's."""
    return sorted(f"{module} -> {target}" for module, targets in edges.items() for target in targets
                  if layer_of(package_of(target)) > layer_of(package_of(module)))


def test_upward_imports_are_found():
    edges = {"unicon.models.base": {"unicon.training.run", "unicon.data.mixture"}}
    assert upward_imports(edges) == ["unicon.models.base -> unicon.training.run"]


def test_layers_import_downward_only(graph):
    bad = upward_imports(module_edges(graph))
    assert not bad, "imports from a lower layer into a higher one (see LAYERS):\n" + "\n".join(bad)


def test_no_backend_imports_another(graph):
    def backend(module: str) -> str | None:
        return next((b for b in BACKENDS if module == b or module.startswith(b + ".")), None)

    bad = sorted(f"{m} -> {t}" for m, targets in module_edges(graph).items() for t in targets
                 if backend(m) and backend(t) and backend(m) != backend(t))
    assert not bad, "one backend imports another; move the shared code to a neutral module:\n" + "\n".join(bad)


@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_every_module_imports_in_a_fresh_interpreter(graph, order):
    modules = sorted(graph.modules)
    if order == "reversed":
        modules.reverse()
    code = ("import importlib, sys\n"
            f"sys.path.insert(0, {str(REPO)!r})\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# "<session or issue> <number>", written so that this file's own text does not match it
HISTORY = re.compile(r"(?i)\b(" + "|".join(("session", "issue")) + r")\s+[0-9]+")


def history_files() -> list[Path]:
    """The product's text files: src/, configs/, tests/, README.md and docs/*.md (not docs/notebook/)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for root in ("src", "configs", "tests"):
        files += sorted(p for p in (REPO / root).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return files


def test_no_history_outside_the_notebook():
    hits = []
    for path in history_files():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:  # not a text file
            continue
        hits += [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
                 for n, line in enumerate(lines, 1) if HISTORY.search(line)]
    assert not hits, ("history belongs in docs/notebook/ (a dated file); the code, configs and README "
                      "say why, not when:\n" + "\n".join(hits))
