"""The packages' layering, read from their import statements (issue 29).

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
    "gateway": {"switchboard", "bench", "training"},
    "worker": {"switchboard", "bench", "training"},
    "adapters": {"switchboard", "bench", "training"},
    "switchboard_kernels": {"switchboard", "bench", "training"},
    "rpc": FIRST_PARTY - {"rpc"},
    "runtime": FIRST_PARTY - {"runtime", "rpc"},
}


def imported_packages(source: str, module: str) -> set[str]:
    """The top-level first-party packages `source` (the text of `module`) imports."""
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
        found |= {name.split(".")[0] for name in names} & FIRST_PARTY
    return found


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
