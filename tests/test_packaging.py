"""A real package: scripts/setup.sh's torch policy (pin only on CI / --cpu / no torch, never replace a CUDA
torch, fail when an install fails), `scaleout --version`, and package data found through importlib.resources."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "scripts" / "setup.sh"


def _fake_torch(tmp: Path, version: str | None, cuda: str | None = None) -> Path:
    """A directory that shadows torch: the given version (CUDA build if ``cuda``), or an import error."""
    pkg = tmp / "faketorch" / "torch"
    pkg.mkdir(parents=True)
    if version is None:
        (pkg / "__init__.py").write_text("raise ImportError('no torch here')\n")
    else:
        (pkg / "__init__.py").write_text(f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n")
    return pkg.parent


def _setup(script: Path, fake: Path, *args: str, python: str = sys.executable, **env: str):
    keep = {k: v for k, v in os.environ.items() if k not in ("CI", "SCALEOUT_SETUP_DRY_RUN")}
    return subprocess.run(
        ["bash", str(script), *args],
        env={**keep, "PYTHONPATH": str(fake), "PYTHON": python, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("version", "cuda", "args", "env", "expect"),
    [
        # an NGC container's torch: kept even on CI
        (
            "2.6.0a0+ecf3bae40a",
            "12.6",
            [],
            {"CI": "true"},
            "keep (CUDA build 2.6.0a0+ecf3bae40a (CUDA 12.6) is never replaced)",
        ),
        ("2.6.0a0+ecf3bae40a", "12.6", ["--cpu"], {}, "keep (CUDA build"),
        ("2.5.1+cpu", None, [], {}, "keep (torch 2.5.1+cpu)"),  # a user's CPU torch in range: kept
        ("2.5.1+cpu", None, [], {"CI": "true"}, "install (CPU torch 2.5.1+cpu, pinned to 2.13.0 on CI / with --cpu)"),
        ("2.5.1+cpu", None, ["--cpu"], {}, "install (CPU torch 2.5.1+cpu"),
        ("2.13.0+cpu", None, ["--test"], {"CI": "true"}, "keep (torch 2.13.0+cpu)"),
        (None, None, [], {}, "install (no torch installed)"),
    ],
)
def test_setup_torch_policy(tmp_path: Path, version, cuda, args, env, expect) -> None:
    r = _setup(SETUP, _fake_torch(tmp_path, version, cuda), *args, SCALEOUT_SETUP_DRY_RUN="1", **env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"[setup] torch: {expect}"), r.stdout


def test_setup_rejects_unknown_option(tmp_path: Path) -> None:
    r = _setup(SETUP, _fake_torch(tmp_path, "2.13.0+cpu"), "--gpu")
    assert r.returncode == 2 and "unknown option --gpu (expected --test, --cpu)" in r.stderr


@pytest.mark.parametrize("torch_version", ["2.13.0+cpu", None])
def test_failed_pip_install_fails_setup(tmp_path: Path, torch_version: str | None) -> None:
    """pip exits 1 (here: a python whose `-m pip` always fails), at the torch install or at the editable
    install of scaleout: setup.sh must exit non-zero, not print its way past it."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for f in ("scripts/setup.sh", "pyproject.toml", "constraints.txt"):
        shutil.copy(REPO / f, repo / f)
    wrapper = tmp_path / "python"
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then echo "ERROR: no network" >&2; exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    r = _setup(repo / "scripts" / "setup.sh", _fake_torch(tmp_path, torch_version), python=str(wrapper))
    assert r.returncode != 0, r.stdout + r.stderr
    assert "ERROR: no network" in r.stdout + r.stderr
    assert not list(repo.glob(".setup-stamp-*"))


def test_version_and_package_data() -> None:
    import scaleout
    from scaleout.bench.packing import DEFAULT_HIST
    from scaleout.config.load import CONFIG_DIR

    r = subprocess.run([sys.executable, "-m", "scaleout", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"scaleout {scaleout.__version__}"
    assert {p.name for p in CONFIG_DIR.glob("*.yaml")} == {p.name for p in (REPO / "configs").glob("*.yaml")}
    assert DEFAULT_HIST.read_text().startswith("# Wikipedia BERT pre-training sequence-length histogram")
