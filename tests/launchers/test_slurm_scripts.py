"""The sbatch scripts' shell logic, run in bash without Slurm (issue 26, review findings 13 and 14).

No cluster here: ``sbatch`` and ``srun`` are stub scripts on PATH that record their arguments; what
runs for real is slurm/env.sh and slurm/scaling_sweep.sh. (tests/launchers/test_slurm.py submits
the scripts
to the local Slurm.)
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SRUN_", "SWEEP_", "TORCH_NCCL_", "NCCL_", "RUN_"))
    }
    env.update(RUN_ROOT=str(tmp_path / "runs"), **extra)
    return env


def _stub(bin_dir: Path, name: str, log: Path, reply: str = "") -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >> "{log}"\n'
        f'printf "%s\\n" "{name}-env SWEEP_BATCH_PER_GPU=$SWEEP_BATCH_PER_GPU" >> "{log}"\n'
        f"{reply}\n"
    )
    path.chmod(0o755)


@pytest.mark.full_system
@pytest.mark.parametrize("given", [None, "3"])
def test_env_sh_leaves_nccl_async_error_handling_to_scaleout(
    tmp_path: Path, given: str | None
) -> None:
    """slurm/env.sh must not force TORCH_NCCL_ASYNC_ERROR_HANDLING (it forced 1: abort the
    communicators first, which can hang, where scaleout.init() and torch 2.13 choose 3); an
    exported value is kept."""
    env = _clean_env(tmp_path, SLURM_JOB_NAME="t")
    if given is not None:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = given
    r = subprocess.run(
        [
            "bash",
            "-c",
            'source slurm/env.sh >/dev/null; echo "value=${TORCH_NCCL_ASYNC_ERROR_HANDLING-unset}"',
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"value={given or 'unset'}", r.stdout


@pytest.mark.full_system
def test_scaling_sweep_submits_one_job_per_size_with_its_own_nodes(tmp_path: Path) -> None:
    """Run with bash outside a job: one sbatch per node count, each -N that count (an array held the
    largest size -- 256 nodes -- for every task)."""
    log = tmp_path / "calls.log"
    _stub(tmp_path / "bin", "sbatch", log, 'echo "Submitted batch job 7"')
    env = _clean_env(
        tmp_path,
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        SWEEP_NODES="1 2 4",
        SWEEP_TASKS_PER_NODE="8",
    )
    r = subprocess.run(
        ["bash", "slurm/scaling_sweep.sh", "train.max_steps=20"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [line.split() for line in log.read_text().splitlines() if line.startswith("sbatch ")]
    assert [c[c.index("-N") + 1] for c in calls] == ["1", "2", "4"], calls
    assert all(c[c.index("--ntasks-per-node") + 1] == "8" for c in calls), calls
    assert all(c[-2:] == ["slurm/scaling_sweep.sh", "train.max_steps=20"] for c in calls), calls
    assert "global batch 16: Submitted batch job 7" in r.stdout, r.stdout  # 2 x 1 x 8
    assert "global batch 64: Submitted batch job 7" in r.stdout, r.stdout  # 2 x 4 x 8


@pytest.mark.full_system
@pytest.mark.parametrize(
    "config,per_gpu,nodes,tpn,batch",
    [
        ("configs/bert_large_256x8.yaml", None, 1, 8, 16),
        ("configs/bert_large_256x8.yaml", None, 256, 8, 4096),  # the flagship's own global batch
        ("configs/resnet50_128x8.yaml", None, 4, 8, 35 * 32),
        ("configs/bert_tiny_cpu.yaml", "3", 2, 2, 12),
    ],
)
def test_scaling_sweep_point_weak_scales_the_global_batch(
    tmp_path: Path, config: str, per_gpu: str | None, nodes: int, tpn: int, batch: int
) -> None:
    """Inside a job: srun on all the job's nodes with train.global_batch = rows per GPU x GPUs
    (it kept the config's 4096 at every size: 512 rows per GPU on one node)."""
    log = tmp_path / "calls.log"
    _stub(tmp_path / "bin", "srun", log)
    env = _clean_env(
        tmp_path,
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="11",
        SLURM_JOB_NAME="sweep",
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_NTASKS_PER_NODE=str(tpn),
        SWEEP_CONFIG=config,
        **({"SWEEP_BATCH_PER_GPU": per_gpu} if per_gpu else {}),
    )
    r = subprocess.run(
        ["bash", "slurm/scaling_sweep.sh", "train.max_steps=20"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    [call] = [line.split() for line in log.read_text().splitlines() if line.startswith("srun ")]
    assert call[call.index("-N") + 1] == str(nodes), call
    assert call[call.index("--ntasks-per-node") + 1] == str(tpn), call
    assert f"train.global_batch={batch}" in call and call[-1] == "train.max_steps=20", call
    assert f"train.output_dir={tmp_path / 'runs' / 'sweep' / f'{nodes}n'}" in call, call


@pytest.mark.full_system
@pytest.mark.parametrize(
    "extra,args,message",
    [
        ({"SWEEP_CONFIG": "configs/bert_tiny_cpu.yaml"}, [], "SWEEP_BATCH_PER_GPU=''"),
        ({}, ["train.global_batch=64"], "set SWEEP_BATCH_PER_GPU instead"),
    ],
)
def test_scaling_sweep_refuses_what_would_not_weak_scale(
    tmp_path: Path, extra: dict[str, str], args: list[str], message: str
) -> None:
    _stub(
        tmp_path / "bin", "srun", tmp_path / "calls.log"
    )  # never the real one, even if not refused
    env = _clean_env(
        tmp_path,
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="11",
        SLURM_JOB_NUM_NODES="1",
        **extra,
    )
    r = subprocess.run(
        ["bash", "slurm/scaling_sweep.sh", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and message in r.stderr, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
