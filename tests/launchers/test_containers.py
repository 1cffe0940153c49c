"""Containers under `scaleout slurm run` and submitit (launch.container), and the step's shape from
the allocation (launchers/slurm_fit.py: `sbatch -N k slurm/<x>.sh` alone runs on k nodes).

Pyxis (--container-image/--container-mounts/--container-workdir/--container-env) is a SPANK plugin
with enroot behind it that this machine does not have: its options are checked where they end up,
every srun the supervisor starts (a recording srun on PATH), and submitit's generated script. The
OCI path (srun --container) runs for real on the local Slurm: tests/launchers/test_slurm_oci.py.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.config import load_config
from scaleout.errors import ConfigError, UserError
from scaleout.launchers.container import srun_args as container_srun
from scaleout.launchers.slurm_supervisor import Allocation, TrainCommand

ROOT = Path(__file__).resolve().parents[2]
PYXIS = [
    "launch.container.image=nvcr.io#nvidia/pytorch:24.01-py3",
    "launch.container.mounts=/lustre/data:/data:ro,/scratch/$USER:/results",
    "launch.container.workdir=/workspace/scaleout",
    "launch.container.env=NCCL_IB_DISABLE,NCCL_SOCKET_IFNAME",
]
PYXIS_ARGS = [
    "--container-image=nvcr.io#nvidia/pytorch:24.01-py3",
    "--container-mounts=/lustre/data:/data:ro,/scratch/$USER:/results",
    "--container-workdir=/workspace/scaleout",
    "--container-env=NCCL_IB_DISABLE,NCCL_SOCKET_IFNAME",
]
TINY_SCHEDULE = [
    "train.global_batch=8",
    "optim.lr=1e-3",
    "optim.warmup_steps=1",
    "optim.total_steps=4",
    "train.max_steps=4",
]


def _cmd(*overrides: str, config: str = "configs/bert_large_256x8.yaml") -> TrainCommand:
    return TrainCommand.parse(["--", "scaleout", "train", config, *overrides])


@pytest.mark.unit
def test_container_keys_become_srun_options_as_given() -> None:
    assert container_srun(load_config("bert_tiny_cpu", PYXIS).launch.container) == PYXIS_ARGS
    oci = load_config("bert_tiny_cpu", ["launch.container.bundle=/opt/bundles/scaleout"])
    assert container_srun(oci.launch.container) == ["--container=/opt/bundles/scaleout"]
    assert container_srun(load_config("bert_tiny_cpu", []).launch.container) == []


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["launch.container.bundle=/b", "launch.container.image=img"],
            "launch.container.bundle='/b' and launch.container.image='img': expected one",
        ),
        (["launch.container.mounts=/d:/d"], "launch.container.mounts='/d:/d' needs launch."),
        (["launch.spares=-1"], "launch.spares"),
    ],
)
def test_container_keys_refuse_what_cannot_run(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match="launch") as err:
        load_config("bert_tiny_cpu", overrides)
    assert message in str(err.value) and "\n" not in str(err.value).strip()


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,nodes,tpn,want_nnodes,want_extra",
    [
        # the node count from the allocation, the ranks per node from its tasks
        (TINY_SCHEDULE, 2, 2, 2, ["launch.nnodes=2", "launch.nproc_per_node=2"]),
        # spares are a key: 3 nodes, one kept back
        (
            [*TINY_SCHEDULE, "launch.spares=1"],
            3,
            2,
            2,
            ["launch.nnodes=2", "launch.nproc_per_node=2"],
        ),
        # launch.nnodes on the command line still wins; the other nodes are spares
        ([*TINY_SCHEDULE, "launch.nnodes=2"], 3, 2, 2, ["launch.nproc_per_node=2"]),
        # the recipe's own global batch keeps its schedule on any GPU count
        (["train.global_batch=4096"], 2, 2, 2, ["launch.nnodes=2", "launch.nproc_per_node=2"]),
        # the recipe's own shape: nothing to follow
        ([], 256, 8, 256, ["launch.nnodes=256", "launch.nproc_per_node=8"]),
    ],
)
def test_the_step_takes_its_shape_from_the_allocation(
    overrides: list[str], nodes: int, tpn: int, want_nnodes: int, want_extra: list[str]
) -> None:
    alloc = Allocation("7", [f"n{i}" for i in range(1, nodes + 1)], tpn)
    cmd = _cmd(*overrides).fitted(alloc)
    assert cmd.nnodes == want_nnodes
    assert cmd.argv[-len(want_extra) :] == want_extra, cmd.argv


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,nodes,message",
    [
        # the 256-node recipe on 2x2 GPUs: its 4096 rows would be 1024 per GPU with a schedule
        # written for 4096 over 2048 GPUs
        (
            [],
            2,
            "its schedule is for 256x8 GPUs at train.global_batch=4096; this step has 2x2: "
            "expected train.global_batch=8 (2 per GPU)",
        ),
        (
            ["train.global_batch=16", "train.max_steps=9"],
            2,
            "train.global_batch=16 is not configs/bert_large_256x8.yaml's 4096 but optim.lr, "
            "optim.warmup_steps, optim.total_steps keep its schedule",
        ),
        (
            [*TINY_SCHEDULE, "launch.spares=2"],
            2,
            "launch.spares=2 leaves no node of the allocation's 2",
        ),
        ([*TINY_SCHEDULE, "launch.nnodes=3"], 2, "launch.nnodes=3 but the allocation has 2 nodes"),
        (
            [*TINY_SCHEDULE, "launch.nnodes=1", "launch.spares=0"],
            2,
            "launch.nnodes=1 + launch.spares=0 != the allocation's 2 nodes",
        ),
    ],
)
def test_a_step_that_does_not_fit_is_refused_in_one_line(
    overrides: list[str], nodes: int, message: str
) -> None:
    alloc = Allocation("7", [f"n{i}" for i in range(1, nodes + 1)], 2)
    with pytest.raises(UserError) as err:
        _cmd(*overrides).fitted(alloc)
    assert message in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.full_system
def test_pyxis_options_reach_every_srun_exactly_as_given(tmp_path: Path) -> None:
    """`scaleout slurm run` in a batch job's environment, with a recording srun on PATH (pyxis and
    enroot cannot run here): the first step dies (a software error), the supervisor starts a
    second; both sruns carry the four pyxis options verbatim, after srun's own options and before
    the command, and the step's command gets the allocation's shape."""
    bin_dir, log = tmp_path / "bin", tmp_path / "srun.log"
    bin_dir.mkdir()
    count = tmp_path / "count"
    (bin_dir / "srun").write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do printf "%s\\n" "$a"; done >> "{log}"\n'
        f'echo "-- end" >> "{log}"\n'
        f'n=$(cat "{count}" 2>/dev/null || echo 0); echo $((n + 1)) > "{count}"\n'
        '[ "$n" = 0 ] && exit 1\nexit 0\n'
    )
    (bin_dir / "srun").chmod(0o755)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "SCALEOUT_"))
    }
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        PYTHONPATH=str(ROOT),
        SLURM_JOB_ID="42",
        SLURM_JOB_NODELIST="dgx[001-002]",
        SLURM_TASKS_PER_NODE="8(x2)",
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaleout",
            "slurm",
            "run",
            "--",
            "scaleout",
            "train",
            "configs/bert_large_256x8.yaml",
            *PYXIS,
            *TINY_SCHEDULE[1:],
            "train.global_batch=32",
            f"train.output_dir={tmp_path}/run",
            f"checkpoint.dir={tmp_path}/run/ckpt",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    calls = [c.strip("\n").splitlines() for c in log.read_text().split("-- end\n") if c.strip()]
    assert len(calls) == 2, calls
    for argv in calls:
        at = argv.index(PYXIS_ARGS[0])
        assert argv[at : at + 4] == PYXIS_ARGS, argv
        assert argv[at - 1] == "--nodelist=dgx001,dgx002" and argv[at + 4] == "scaleout", argv
        assert argv[-2:] == ["launch.nnodes=2", "launch.nproc_per_node=8"], argv


@pytest.mark.unit
def test_submitit_passes_the_container_to_its_srun(tmp_path: Path) -> None:
    """submitit's generated sbatch script (nothing submitted): the pyxis options on its srun line;
    without Slurm they are refused in one line."""
    import submitit

    from scaleout.launchers.submit import SubmitSpec, container_srun_args, make_executor

    argv = ["train", "bert_tiny_cpu", *PYXIS]
    assert container_srun_args(argv) == PYXIS_ARGS
    spec = SubmitSpec(
        argv=argv, cluster="slurm", folder=str(tmp_path / "%j"), srun_args=container_srun_args(argv)
    )
    script = submitit.slurm.slurm._make_sbatch_string(
        command="python -m x", folder=str(tmp_path), **make_executor(spec).parameters
    )
    [srun] = [shlex.split(ln) for ln in script.splitlines() if ln.startswith("srun ")]
    at = srun.index(PYXIS_ARGS[0])
    assert srun[at : at + 4] == PYXIS_ARGS and srun[at + 4 :] == ["python", "-m", "x"], srun
    with pytest.raises(UserError, match="srun options, but this job runs on submitit's local"):
        make_executor(SubmitSpec(argv=argv, cluster="local", srun_args=PYXIS_ARGS))
