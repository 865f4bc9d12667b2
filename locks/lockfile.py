"""Our dependency locks (pip-compile's files, with hashes): read them, check them against
pyproject.toml, and pick lines out of them for the images (docs/dependencies.md).

    python locks/lockfile.py check              # do the locks agree with pyproject.toml?
    python locks/lockfile.py without torch FILE # FILE's entries but torch's (the CUDA image)

Reading and `without` use the standard library only (an image build runs them before
anything is installed); `check` also needs `packaging` for version specifiers.
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "locks"
# Where pip-compile says a pin comes straight from pyproject.toml's dependencies.
DIRECT = "switchboard (pyproject.toml)"
_ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalize(name: str) -> str:
    """PEP 503: case and runs of - _ . do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return normalize(match.group(1))


@dataclass(frozen=True, slots=True)
class Pin:
    """One entry of a lock: `name==version`, its hashes, whom pip-compile says it is for."""

    name: str  # normalized
    version: str
    hashes: tuple[str, ...]
    via: tuple[str, ...]
    text: str  # the entry's lines as written, for copying it into another requirements file


def read_lock(path: Path) -> dict[str, Pin]:
    """A lock's entries by normalized name (pip-compile's format: an entry at column 0, its
    `--hash` options and `# via` comments indented under it)."""
    pins: dict[str, Pin] = {}
    blocks: list[list[str]] = []
    for line in path.read_text().splitlines():
        if _ENTRY.match(line):
            blocks.append([line])
        elif blocks and line.startswith(" "):
            blocks[-1].append(line)
    for block in blocks:
        match = _ENTRY.match(block[0])
        assert match is not None
        body = [line.strip() for line in block[1:]]
        hashes = tuple(h for line in body for h in re.findall(r"--hash=(\S+)", line))
        via = _via(body)
        pin = Pin(normalize(match.group(1)), match.group(2), hashes, via, "\n".join(block))
        pins[pin.name] = pin
    return pins


def _via(body: list[str]) -> tuple[str, ...]:
    """The `# via` sources: one on the `# via X` line, or one per `#   X` line under it."""
    sources: list[str] = []
    for line in body:
        if line.startswith("# via"):
            rest = line.removeprefix("# via").strip()
            if rest:
                sources.append(rest)
        elif line.startswith("#   "):
            sources.append(line.removeprefix("#").strip())
    return tuple(sources)


def declared(pyproject: Path, *, extra: str | None = None) -> list[str]:
    """pyproject.toml's runtime requirements, plus those of `extra`."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    if extra is not None:
        lines += project["optional-dependencies"][extra]
    return lines


def problems(root: Path = ROOT) -> list[str]:
    """Every way the locks disagree with pyproject.toml or with each other ([] when none)."""
    pyproject = root / "pyproject.toml"
    locks = root / "locks"
    runtime, dev = read_lock(locks / "runtime.txt"), read_lock(locks / "dev.txt")
    build, gateway = read_lock(locks / "build.txt"), read_lock(locks / "gateway.txt")
    model = read_lock(locks / "model.txt")
    found: list[str] = []
    found += _direct_problems("runtime.txt", runtime, declared(pyproject))
    found += _direct_problems("dev.txt", dev, declared(pyproject, extra="dev"))
    build_requires = tomllib.loads(pyproject.read_text())["build-system"]["requires"]
    found += _satisfied("build.txt", build, build_requires)
    gateway_names = (root / "docker" / "gateway-requirements.txt").read_text()
    gateway_lines = [line.split("#", 1)[0].strip() for line in gateway_names.splitlines()]
    found += _satisfied("gateway.txt", gateway, [line for line in gateway_lines if line])
    found += [
        f"gateway.txt pins {name}, which runtime.txt does not"
        for name in gateway.keys() - runtime.keys()
    ]
    found += _disagreements({"runtime.txt": runtime, "dev.txt": dev, "build.txt": build,
                             "gateway.txt": gateway, "model.txt": model})  # fmt: skip
    for file, pins in (("runtime.txt", runtime), ("dev.txt", dev), ("build.txt", build),
                       ("gateway.txt", gateway), ("model.txt", model)):  # fmt: skip
        found += [f"{file}: {name} has no hash" for name, pin in pins.items() if not pin.hashes]
    return found


def _direct_problems(file: str, pins: dict[str, Pin], requirements: list[str]) -> list[str]:
    """Each declared requirement pinned at a version it allows, and each pin the lock calls
    a direct dependency still declared (a removed dependency leaves no orphan behind)."""
    found = _satisfied(file, pins, requirements)
    names = {requirement_name(line) for line in requirements}
    for name, pin in pins.items():
        if DIRECT in pin.via and name not in names:
            found.append(f"{file} locks {name} for pyproject.toml, which no longer declares it")
    return found


def _satisfied(file: str, pins: dict[str, Pin], requirements: list[str]) -> list[str]:
    from packaging.requirements import Requirement
    from packaging.version import Version

    found = []
    for line in requirements:
        requirement = Requirement(line)
        name = normalize(requirement.name)
        pin = pins.get(name)
        if pin is None:
            found.append(f"{file} does not pin {requirement.name} ({line!r} in pyproject.toml)")
        elif not requirement.specifier.contains(Version(pin.version), prereleases=True):
            found.append(f"{file} pins {name}=={pin.version}, which {line!r} does not allow")
    return found


def _disagreements(files: dict[str, dict[str, Pin]]) -> list[str]:
    versions: dict[str, dict[str, str]] = {}
    for file, pins in files.items():
        for name, pin in pins.items():
            versions.setdefault(name, {})[file] = pin.version
    return [
        f"{name} is pinned differently: {seen}"
        for name, seen in sorted(versions.items())
        if len(set(seen.values())) > 1
    ]


def without(path: Path, names: set[str]) -> str:
    """The lock at `path` as a requirements file, less the entries named."""
    pins = read_lock(path)
    kept = [pin.text for name, pin in pins.items() if name not in {normalize(n) for n in names}]
    return "\n".join(kept) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"] and len(argv) == 1:
        found = problems()
        for problem in found:
            print(problem, file=sys.stderr)
        if found:
            print("the locks disagree with pyproject.toml: run `make lock`", file=sys.stderr)
        return 1 if found else 0
    if argv[:1] == ["without"] and len(argv) == 3:
        sys.stdout.write(without(Path(argv[2]), set(argv[1].split(","))))
        return 0
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
