"""The packages' layering, and the worker's rooms', read from their import statements.

From the top: the CLI (``switchboard``); the offline tools (``bench``, ``training``); the
serving processes (``gateway``, ``worker``) and what they build on (``adapters``,
``kernels``); at the bottom the pieces every process shares (``runtime``, ``rpc``). A
package may import only packages below it, so nothing can come to depend on the CLI and
the serving images never load training or benchmark code. Function-level imports count:
they run too, only later.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = {
    "switchboard",
    "bench",
    "training",
    "gateway",
    "worker",
    "adapters",
    "switchboard_kernels",
    "runtime",
    "rpc",
}
# What each package must not import (the packages above it, or beside it for runtime).
FORBIDDEN = {
    "bench": {"switchboard"},
    "training": {"switchboard", "bench"},
    "gateway": {"switchboard", "bench", "training", "worker"},
    "worker": {"switchboard", "bench", "training", "gateway"},
    "adapters": {"switchboard", "bench", "training"},
    "switchboard_kernels": {"switchboard", "bench", "training"},
    "rpc": FIRST_PARTY - {"rpc"},
    "runtime": FIRST_PARTY - {"runtime", "rpc"},
}


# Inside the worker, from the bottom: each folder (or top-level module) may import only those
# on lower rows, or its own. The core (requests, blocks, scheduling, settings) sits below the
# model, speculation, tensor parallelism and the engine that drives them all.
WORKER_LAYERS = [
    {"errors"},
    {"text", "sampling"},
    {"core"},
    {"model"},
    {"parallel", "spec_decode"},
    {"engine"},
    {"serving", "llm"},
    {"__init__"},
]


def imported_modules(source: str, module: str) -> set[str]:
    """The dotted names of every module `source` (the text of `module`) imports from."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = module.split(".")[: -node.level]
                names = [".".join([*base, node.module or ""])]
            else:
                names = [node.module or ""]
        else:
            continue
        found |= set(names)
    return found


def imported_packages(source: str, module: str) -> set[str]:
    """The top-level first-party packages `source` (the text of `module`) imports."""
    return {name.split(".")[0] for name in imported_modules(source, module)} & FIRST_PARTY


def modules(package: str) -> list[tuple[str, Path]]:
    """Every module of `package` as (dotted name, file); a package's own module keeps its
    ``__init__`` so relative imports resolve from inside the package."""
    files = sorted((ROOT / package).rglob("*.py"))
    return [(".".join(p.relative_to(ROOT).with_suffix("").parts), p) for p in files]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_a_layer_above_it(package):
    assert modules(package), f"{package}/ has no modules: is the layer list out of date?"
    violations = [
        f"{name} imports {sorted(bad)}"
        for name, path in modules(package)
        if (bad := imported_packages(path.read_text(), name) & FORBIDDEN[package])
    ]
    assert violations == []


def worker_room(dotted: str) -> str:
    """``worker.core.scheduler`` -> ``core``; ``worker.errors`` -> ``errors``; ``worker`` ->
    ``__init__``."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_workers_rooms_import_only_rooms_below_them():
    rank = {room: i for i, rooms in enumerate(WORKER_LAYERS) for room in rooms}
    violations = []
    for name, path in modules("worker"):
        room = worker_room(name)
        assert room in rank, f"{name}: worker/{room} has no row in WORKER_LAYERS"
        for imported in imported_modules(path.read_text(), name):
            if imported.split(".")[0] != "worker":
                continue
            other = worker_room(imported)
            if other != room and rank[other] >= rank[room]:
                violations.append(f"{name} ({room}) imports {imported} ({other})")
    assert violations == []


def test_the_workers_rooms_form_a_graph_without_cycles():
    """Said directly, so that two rooms on one row of WORKER_LAYERS cannot hide a cycle."""
    edges: dict[str, set[str]] = {}
    for name, path in modules("worker"):
        room = worker_room(name)
        imported = imported_modules(path.read_text(), name)
        edges.setdefault(room, set()).update(
            worker_room(m) for m in imported if m.split(".")[0] == "worker"
        )
        edges[room].discard(room)
    finished: set[str] = set()

    def visit(room: str, trail: list[str]) -> None:
        assert room not in trail, f"cycle: {' -> '.join([*trail, room])}"
        if room not in finished:
            for other in sorted(edges.get(room, ())):
                visit(other, [*trail, room])
            finished.add(room)

    for room in sorted(edges):
        visit(room, [])


def test_every_first_party_package_has_a_place_in_the_layers():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "docker"}
    assert packages == FIRST_PARTY


def test_the_check_sees_every_kind_of_import():
    """Each form below is an upward import the layering test must catch."""
    for source in (
        "import switchboard.cli",
        "from switchboard import cli",
        "def f():\n    from switchboard.cli import main\n",
        "from ..switchboard import cli",
    ):
        assert imported_packages(source, "worker.engine") == {"switchboard"}, source
    assert imported_packages("import os\nfrom . import scheduler", "worker.engine") == {"worker"}
    relative = imported_modules("from ..core import scheduler", "worker.engine.step")
    assert {worker_room(m) for m in relative} == {"core"}
