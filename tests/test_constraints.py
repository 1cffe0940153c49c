"""constraints.txt pins what scripts/setup.sh --test installs (pip -c), so a fresh venv gets what
CI got: every package of the extras it installs has an exact pin, and the pin is inside
pyproject's range (the ranges stay ranges for users who install scaleout into their own
environment)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
SETUP_TEST_EXTRAS = (  # setup.sh --test
    "mpi-local",
    "slurm",
    "plot",
    "data",
    "tb",
    "bench",
    "dev",
    "dali",
    "test",
)


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _lists() -> dict[str, list[str]]:
    """pyproject's ``name = [ "req", ... ]`` lists (dependencies and the extras), read as text:
    tomllib is Python >= 3.11 and scaleout supports 3.10."""
    text = (REPO / "pyproject.toml").read_text()
    return {
        m.group(1): re.findall(r'"([^"]+)"', re.sub(r"#.*", "", m.group(2)))
        for m in re.finditer(r'^"?([\w-]+)"? = \[(.*?)\]', text, re.S | re.M)
    }


def test_setup_extras_are_in_step_with_setup_sh() -> None:
    assert f'extras="{",".join(SETUP_TEST_EXTRAS)}"' in (REPO / "scripts" / "setup.sh").read_text()


def test_every_installed_extra_is_pinned_inside_its_range() -> None:
    lists = _lists()
    pins = _pins()
    assert "torch" in pins
    problems = []
    for extra in SETUP_TEST_EXTRAS:
        for spec in lists[extra]:
            req = Requirement(spec)
            pin = pins.get(canonicalize_name(req.name))
            if pin is None:
                problems.append(f"{req.name} (extra {extra}) has no pin in constraints.txt")
            elif not req.specifier.contains(pin, prereleases=True):
                problems.append(f"{req.name}=={pin} is outside pyproject's {spec!r}")
    for spec in lists["dependencies"]:
        req = Requirement(spec)
        pin = pins.get(canonicalize_name(req.name))
        if pin is not None and not req.specifier.contains(pin, prereleases=True):
            problems.append(f"{req.name}=={pin} is outside pyproject's {spec!r}")
    assert not problems, "\n".join(problems)
