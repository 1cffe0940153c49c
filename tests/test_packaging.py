"""A real package: scripts/setup.sh's torch policy (pin only on CI / --cpu / no torch, never
replace a CUDA torch, fail when an install fails), `scaleout --version`, and package data found
through importlib.resources."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.full_system

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "scripts" / "setup.sh"


def _fake_torch(tmp: Path, version: str | None, cuda: str | None = None) -> Path:
    """A directory that shadows torch: the given version (CUDA build if ``cuda``), or an import
    error."""
    pkg = tmp / "faketorch" / "torch"
    pkg.mkdir(parents=True)
    if version is None:
        (pkg / "__init__.py").write_text("raise ImportError('no torch here')\n")
    else:
        (pkg / "__init__.py").write_text(
            f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n"
        )
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
        (
            "2.5.1+cpu",
            None,
            [],
            {"CI": "true"},
            "install (CPU torch 2.5.1+cpu, pinned to 2.13.0 on CI / with --cpu)",
        ),
        ("2.5.1+cpu", None, ["--cpu"], {}, "install (CPU torch 2.5.1+cpu"),
        ("2.13.0+cpu", None, ["--test"], {"CI": "true"}, "keep (torch 2.13.0+cpu)"),
        (None, None, [], {}, "install (no torch installed)"),
    ],
)
def test_setup_torch_policy(tmp_path: Path, version, cuda, args, env, expect) -> None:
    r = _setup(
        SETUP, _fake_torch(tmp_path, version, cuda), *args, SCALEOUT_SETUP_DRY_RUN="1", **env
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"[setup] torch: {expect}"), r.stdout


def test_setup_rejects_unknown_option(tmp_path: Path) -> None:
    r = _setup(SETUP, _fake_torch(tmp_path, "2.13.0+cpu"), "--gpu")
    assert r.returncode == 2 and "unknown option --gpu (expected --test, --cpu)" in r.stderr


@pytest.mark.parametrize("torch_version", ["2.13.0+cpu", None])
def test_failed_pip_install_fails_setup(tmp_path: Path, torch_version: str | None) -> None:
    """pip exits 1 (here: a python whose `-m pip` always fails), at the torch install or at the
    editable install of scaleout: setup.sh must exit non-zero, not print its way past it."""
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
    r = _setup(
        repo / "scripts" / "setup.sh", _fake_torch(tmp_path, torch_version), python=str(wrapper)
    )
    assert r.returncode != 0, r.stdout + r.stderr
    assert "ERROR: no network" in r.stdout + r.stderr
    assert not list(repo.glob(".setup-stamp-*"))


def test_version_and_package_data() -> None:
    import scaleout
    from scaleout.bench.packing import DEFAULT_HIST
    from scaleout.config.load import CONFIG_DIR

    r = subprocess.run(
        [sys.executable, "-m", "scaleout", "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == f"scaleout {scaleout.__version__}"
    assert {p.name for p in CONFIG_DIR.glob("*.yaml")} == {
        p.name for p in (REPO / "configs").glob("*.yaml")
    }
    assert DEFAULT_HIST.read_text().startswith(
        "# Wikipedia BERT pre-training sequence-length histogram"
    )


# -- the wheel, installed and run outside the checkout
# ------------------------------------------------------
_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    "runs",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "bench-results",
    ".setup-stamp-*",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """`pip wheel --no-deps` of a copy of this checkout (symlinks kept), installed into a venv
    that sees the system's torch (--system-site-packages). Returns (venv bin dir, the built
    wheel)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=_NOT_SOURCE)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            *isolation,
            "-w",
            str(tmp / "whl"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_no_checkout_env(),
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (whl,) = (tmp / "whl").glob("scaleout-*.whl")
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(tmp / "venv")],
        check=True,
        timeout=300,
    )
    bin_dir = tmp / "venv" / "bin"
    inst = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "--no-deps", str(whl)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_no_checkout_env(),
    )
    assert inst.returncode == 0, inst.stdout[-2000:] + inst.stderr[-2000:]
    return bin_dir, whl


def _no_checkout_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SCALEOUT_ENV")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _outside(
    bin_dir: Path, cwd: Path, *args: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bin_dir / "scaleout"), *args],
        cwd=cwd,
        env=_no_checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_wheel_contents(wheel_venv: tuple[Path, Path]) -> None:
    import zipfile

    names = zipfile.ZipFile(wheel_venv[1]).namelist()
    assert {n.split("/")[0] for n in names} == {
        "scaleout",
        f"{wheel_venv[1].name.split('-py')[0]}.dist-info",
    }
    top = [n for n in names if n.endswith("top_level.txt")]
    assert all(zipfile.ZipFile(wheel_venv[1]).read(t).decode().split() == ["scaleout"] for t in top)
    for shipped in (
        "scaleout/configs/bert_tiny_cpu.yaml",
        "scaleout/launchers/slurm_local/start.sh",
        "scaleout/launchers/slurm_local/slurm.conf.in",
        "scaleout/data/wikipedia_seqlen_hist_512.txt",
        "scaleout/launchers/local.py",
    ):
        assert shipped in names, shipped


def test_wheel_trains_and_benches_outside_the_checkout(
    wheel_venv: tuple[Path, Path], tmp_path: Path
) -> None:
    bin_dir, _ = wheel_venv
    where = subprocess.run(
        [
            str(bin_dir / "python"),
            "-c",
            "import scaleout, scaleout.launchers.local as l; print(scaleout.__file__); "
            "print(l.__file__)",
        ],
        cwd=tmp_path,
        env=_no_checkout_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0 and all(
        str(bin_dir.parent) in line for line in where.stdout.split()
    ), where
    assert _outside(bin_dir, tmp_path, "--version").stdout.startswith("scaleout ")
    r = _outside(
        bin_dir,
        tmp_path,
        "train",
        "bert_tiny_cpu",
        "train.global_batch=8",
        "data.eval_samples=16",
        "train.max_steps=2",
        "train.eval_every=2",
        "train.progress=false",
        "checkpoint.dir=null",
        "checkpoint.every_steps=0",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(
        (tmp_path / "runs" / "bert_tiny_cpu" / "report.json").read_text()
    )  # the config's output_dir
    assert report["steps"] == 2
    b = _outside(
        bin_dir,
        tmp_path,
        "bench",
        "packing",
        "--sequences",
        "2000",
        "--rows",
        "4",
        "--batches",
        "2",
        "--repeats",
        "1",
        "--out",
        "p.json",
        "--png",
        "",
    )
    assert b.returncode == 0, b.stdout[-2000:] + b.stderr[-2000:]
    config = json.loads((tmp_path / "p.json").read_text())
    assert config["config"]["hist"].startswith(str(bin_dir.parent)) and config[
        "ceiling"
    ] == pytest.approx(2.0013, abs=1e-4)


@pytest.mark.slurm
def test_wheel_slurm_up(wheel_venv: tuple[Path, Path], slurm_cluster, tmp_path: Path) -> None:
    """`scaleout slurm up` from the wheel on the (shared, running) local cluster: idempotent, and
    its start.sh / stop.sh templates are installed executable. Starting a second cluster from the
    wheel would collide with the shared one's ports, so the start itself is exercised by the
    checkout's fixture."""
    bin_dir, _ = wheel_venv
    r = _outside(bin_dir, tmp_path, "slurm", "up", timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("already running"), r.stdout + r.stderr
    assert "local Slurm cluster: up" in r.stdout
    here = subprocess.run(
        [str(bin_dir / "python"), "-c", "from scaleout.launchers.slurm import HERE; print(HERE)"],
        cwd=tmp_path,
        env=_no_checkout_env(),
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    assert here.startswith(str(bin_dir.parent))
    for script in ("start.sh", "stop.sh"):
        assert os.access(Path(here) / script, os.X_OK)
        assert (Path(here) / script).read_text() == (
            REPO / "launchers" / "slurm_local" / script
        ).read_text()
