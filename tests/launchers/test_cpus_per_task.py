"""submitit and ``scaleout launch --launcher slurm`` give each rank its share of the node's CPUs,
not Slurm's default of one (launchers/cpus.py, review gpu-day-two §13). Slurm is not run: the batch
script's lines run in a real ``sh`` with the variables Slurm would set, and ``srun`` is a stub on
PATH that prints its arguments and the CPU variables (a mock of srun only)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from scaleout.launchers import make_launcher
from scaleout.launchers.base import LaunchOptions
from scaleout.launchers.submit import SubmitSpec, make_executor

STUB = '#!/bin/sh\necho "srun $* cpus=$SRUN_CPUS_PER_TASK omp=$OMP_NUM_THREADS"\n'


def _sh(script: str, tmp: Path, **slurm: str) -> str:
    (tmp / "srun").write_text(STUB)
    (tmp / "srun").chmod(0o755)
    drop = ("SLURM_", "SRUN_", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(slurm, PATH=f"{tmp}:{env['PATH']}")
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.unit
def test_sbatch_wrap_gives_each_task_its_share_of_the_node(tmp_path: Path) -> None:
    """Fails on the base commit: no --exclusive, and srun ran with Slurm's 1 CPU per task."""
    launcher = make_launcher("slurm", LaunchOptions(time_min=5, gpus=True))
    args = launcher.sbatch_args(["scaleout", "train", "x.yaml"], 2, 8, tmp_path / "log")
    assert "--exclusive" in args and "--gpus-per-node=8" in args
    wrap = args[args.index("--wrap") + 1]
    line = _sh(wrap, tmp_path, SLURM_CPUS_ON_NODE="112")
    assert line.startswith("srun --kill-on-bad-exit=1 --cpus-per-task=14 "), line
    assert line.endswith("train x.yaml cpus=14 omp=14"), line
    # an explicit --cpus-per-task (SLURM_CPUS_PER_TASK in the job) or a user's export wins
    assert "cpus=6 omp=6" in _sh(wrap, tmp_path, SLURM_CPUS_ON_NODE="112", SLURM_CPUS_PER_TASK="6")
    assert "cpus=3 omp=2" in _sh(
        wrap, tmp_path, SLURM_CPUS_ON_NODE="112", SRUN_CPUS_PER_TASK="3", OMP_NUM_THREADS="2"
    )
    assert "cpus=1 " in _sh(wrap, tmp_path, SLURM_CPUS_ON_NODE="4")  # never 0


@pytest.mark.unit
def test_submitit_gives_each_task_its_share_of_the_node(tmp_path: Path) -> None:
    """Fails on the base commit: submitit's script asked for no CPUs per task."""
    import submitit

    ex = make_executor(
        SubmitSpec(argv=["smoke"], cluster="slurm", folder=str(tmp_path / "%j"), gpus_per_node=8)
    )
    assert ex.parameters.get("exclusive") is True
    script = submitit.slurm.slurm._make_sbatch_string(
        command="true", folder=str(tmp_path), **ex.parameters
    )
    assert "#SBATCH --exclusive" in script.splitlines()
    setup = script.split("# setup\n", 1)[1].split("\n\n", 1)[0]
    out = _sh(setup + '\nsrun "$@"', tmp_path, SLURM_CPUS_ON_NODE="224")
    assert out.endswith("cpus=28 omp=28"), out
