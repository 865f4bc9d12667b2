"""Our top-level packages are ours alone in the environment.

transformers 5.x began to require Hugging Face's ``kernels`` distribution, whose top-level
package shadowed the one we then called ``kernels`` (site-packages comes before an editable
install's path, and a wheel install would have written both into one folder). These tests
name the clash at once instead of as dozens of import errors.
"""

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def wheel_packages() -> list[str]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        config = tomllib.load(file)
    return config["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]


def test_no_installed_distribution_provides_a_package_of_ours():
    providers = importlib.metadata.packages_distributions()
    clashes = {
        name: sorted(set(providers[name]) - {"switchboard"})
        for name in wheel_packages()
        if set(providers.get(name, ())) - {"switchboard"}
    }
    assert clashes == {}, f"installed distributions that also provide our packages: {clashes}"


def test_each_package_imports_from_this_checkout_outside_it(tmp_path):
    """From another folder (as the console scripts run), each name resolves to our sources."""
    names = wheel_packages()
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n"
    script += "    print(importlib.import_module(name).__file__)\n"
    result = subprocess.run(
        [sys.executable, "-c", script, *names],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    files = dict(zip(names, result.stdout.split(), strict=True))
    outside = {name: f for name, f in files.items() if not Path(f).is_relative_to(ROOT)}
    assert outside == {}
