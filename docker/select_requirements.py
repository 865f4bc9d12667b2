"""Print pyproject.toml's requirement lines for the distributions named in a list file.

The package declares torch among its dependencies (the worker needs it), so the slim gateway
image installs the package with --no-deps plus only the gateway's requirements; this keeps
their versions in one place, pyproject.toml. Standard library only (it runs in the image
build before anything is installed).

    python docker/select_requirements.py pyproject.toml docker/gateway-requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalize(name: str) -> str:
    """PEP 503: case and runs of - _ . do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return normalize(match.group(1))


def read_names(path: Path) -> list[str]:
    """Names from a list file: one a line, `#` starts a comment."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [normalize(line) for line in lines if line]


def select(pyproject: Path, names: list[str]) -> list[str]:
    """The project's dependency lines for `names`, in their order; unknown names fail."""
    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    by_name = {requirement_name(line): line for line in declared}
    missing = [name for name in names if name not in by_name]
    if missing:
        raise SystemExit(f"not dependencies in {pyproject}: {', '.join(missing)}")
    return [by_name[name] for name in names]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    pyproject, names_file = map(Path, argv)
    print("\n".join(select(pyproject, read_names(names_file))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
