"""The dependency locks agree with pyproject.toml, and `make install` installs exactly them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_lockfile():
    """locks/lockfile.py, the script `make lock` and the image builds run."""
    spec = importlib.util.spec_from_file_location("lockfile", ROOT / "locks" / "lockfile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


lockfile = load_lockfile()


def copy_project(tmp_path: Path) -> Path:
    (tmp_path / "docker").mkdir()
    shutil.copytree(ROOT / "locks", tmp_path / "locks")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(
        ROOT / "docker" / "gateway-requirements.txt", tmp_path / "docker/gateway-requirements.txt"
    )
    return tmp_path


def test_the_locks_agree_with_pyproject_and_with_each_other():
    assert lockfile.problems() == []


def test_a_dependency_added_without_refreshing_the_lock_is_caught(tmp_path):
    root = copy_project(tmp_path)
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(
        text.replace('"jsonschema>=4.20",', '"jsonschema>=4.20",\n    "zstandard>=0.20",')
    )
    assert lockfile.problems(root) == [
        "runtime.txt does not pin zstandard ('zstandard>=0.20' in pyproject.toml)",
        "dev.txt does not pin zstandard ('zstandard>=0.20' in pyproject.toml)",
    ]


def test_a_tightened_removed_or_unhashed_dependency_is_caught(tmp_path):
    root = copy_project(tmp_path)
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text()
    assert '"jsonschema>=4.20",' in text and '"pytest>=8",' in text
    pyproject.write_text(
        text.replace('"jsonschema>=4.20",', '"jsonschema>=999",').replace('"pytest>=8",', "")
    )
    dev = root / "locks" / "dev.txt"
    pin = lockfile.read_lock(dev)["ruff"]
    dev.write_text(dev.read_text().replace(pin.text, pin.text.split(" \\")[0]))
    found = lockfile.problems(root)
    assert any(p.startswith("runtime.txt pins jsonschema==") for p in found), found
    assert "dev.txt locks pytest for pyproject.toml, which no longer declares it" in found
    assert "dev.txt: ruff has no hash" in found


def test_the_cuda_image_gets_every_runtime_pin_but_torch():
    runtime = lockfile.read_lock(ROOT / "locks" / "runtime.txt")
    text = lockfile.without(ROOT / "locks" / "runtime.txt", {"torch"})
    reread = {
        line.split("==")[0] for line in text.splitlines() if line and not line.startswith(" ")
    }
    assert reread == {pin.name for pin in runtime.values()} - {"torch"}
    assert text.count("--hash=") == sum(
        len(p.hashes) for p in runtime.values() if p.name != "torch"
    )


def test_the_environment_is_exactly_the_lock():
    """What `pip freeze` shows in the virtualenv `make install` made equals the locks."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not the project's virtualenv ({sys.prefix}): `make install` makes it")
    expected: dict[str, str] = {}
    for name in ("dev.txt", "build.txt", "model.txt"):
        expected |= {n: p.version for n, p in lockfile.read_lock(ROOT / "locks" / name).items()}
    installed = {
        lockfile.normalize(dist.metadata["Name"]): dist.version
        for dist in importlib.metadata.distributions()
    }
    installed.pop("switchboard")  # the project itself, installed editable
    installed.pop("pip")  # the virtualenv's own installer, from the Python that made it
    assert installed == expected, "the virtualenv is not the lock: `make clean install`"
