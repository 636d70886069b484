"""The lock (``requirements/``, written by ``scripts/lock.sh``): it admits what pyproject.toml and
the set-up's inputs ask for, the runtime lock agrees with the test lock, and the environment the
set-up made holds the locked versions, so a green run here is what a fresh machine installs."""

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
TEST_LOCK, RUNTIME_LOCK = ROOT / "requirements/test.txt", ROOT / "requirements/runtime.txt"
MODELS_LOCK, DEPLOY_LOCK = ROOT / "requirements/models.txt", ROOT / "deploy/requirements-check.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def pins(lock: Path) -> dict[str, Version]:
    """The lock's ``name==version`` lines, by canonical name."""
    found = {}
    for line in lock.read_text().splitlines():
        if match := PIN.match(line):
            found[canonicalize_name(match[1])] = Version(match[2])
    return found


def requirements(path: Path) -> list[Requirement]:
    """The requirement lines of an ``.in`` file (comments and blank lines left out)."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def pyproject_requirements() -> list[Requirement]:
    """pyproject.toml's dependencies, its test extra and its build requirements."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = [
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["test"],
        *project["build-system"]["requires"],
    ]
    return [Requirement(line) for line in listed]


@pytest.mark.parametrize(
    ("inputs", "lock"),
    [
        (pyproject_requirements() + requirements(ROOT / "requirements/setup.in"), TEST_LOCK),
        (requirements(ROOT / "requirements/models.in"), MODELS_LOCK),
        (requirements(ROOT / "deploy/requirements-check.in"), DEPLOY_LOCK),
    ],
    ids=["test", "models", "deploy-check"],
)
def test_the_lock_pins_every_input_within_its_range(inputs, lock):
    locked = pins(lock)
    missing = [str(r) for r in inputs if canonicalize_name(r.name) not in locked]
    outside = [
        f"{r} (locked {locked[canonicalize_name(r.name)]})"
        for r in inputs
        if canonicalize_name(r.name) in locked
        and not r.specifier.contains(locked[canonicalize_name(r.name)], prereleases=True)
    ]
    assert not missing and not outside, (
        f"{lock.relative_to(ROOT)} is stale: not pinned {missing}, pinned outside the range {outside}; "
        "run scripts/lock.sh (scripts/lock.sh --upgrade-package NAME for one package) and commit the lock"
    )


def test_the_runtime_lock_is_a_subset_of_the_test_lock_at_the_same_versions():
    runtime, test = pins(RUNTIME_LOCK), pins(TEST_LOCK)
    differ = {name: (str(v), str(test.get(name))) for name, v in runtime.items() if test.get(name) != v}
    assert not differ, f"requirements/runtime.txt and requirements/test.txt differ: {differ}; run scripts/lock.sh"
    assert "torch" in runtime and runtime["torch"].local == "cpu", "the lock takes torch's CPU build"


def test_the_environment_holds_the_locked_versions():
    """Every package installed here that the lock names is at its locked version (the project
    itself aside): the set-up installed from the lock, and nothing floated past it."""
    locked = pins(TEST_LOCK) | pins(MODELS_LOCK)
    installed = {
        canonicalize_name(dist.metadata["Name"]): Version(dist.version) for dist in importlib.metadata.distributions()
    }
    assert installed.keys() & locked.keys(), "nothing the lock names is installed: run scripts/setup.sh --test"
    differ = {
        name: (str(version), str(locked[name]))
        for name, version in installed.items()
        if locked.get(name, version) != version
    }
    assert not differ, f"installed (version, locked) {differ}: run scripts/setup.sh --test"
