"""Every launcher environment, read from constructed variables, and the detection order.

The same readers are exercised for real under the local launcher (test_world.py), mpiexec
(test_mpi.py), srun (test_slurm.py) and horovodrun when installed (test_horovod.py).
"""

from __future__ import annotations

import pytest

from scaleout.env import DETECTION_ORDER, detect_environment
from scaleout.env.readers import SlurmEnv
from scaleout.errors import UserError

TORCHRUN = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
SLURM = {"SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3", "SLURM_NTASKS": "7", "SLURM_NNODES": "4",
         "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_NODELIST": "gpu[001-003,007]", "SLURM_JOB_ID": "4242",
         "SLURM_STEP_ID": "0"}
OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SCALEOUT_MPI_NODE_RANK": "1", "SCALEOUT_MPI_NUM_NODES": "2",
        "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
         "SCALEOUT_MPI_NODE_RANK": "1", "SCALEOUT_MPI_NUM_NODES": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "1"}
HOROVOD = {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
           "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5"}
LOCAL = {"SCALEOUT_RANK": "3", "SCALEOUT_LOCAL_RANK": "1", "SCALEOUT_NODE_RANK": "1", "SCALEOUT_NNODES": "2",
         "SCALEOUT_NPROC_PER_NODE": "2", "SCALEOUT_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "7"}


def _spec(env, explicit=None):
    reader = detect_environment(env, explicit)
    return reader.name, reader.read(env)


def _key(spec):
    return (spec.rank, spec.local_rank, spec.node_rank, spec.num_nodes, spec.local_size, spec.world_size)


def test_torchrun() -> None:
    name, s = _spec(TORCHRUN)
    assert name == "torchrun" and _key(s) == (5, 1, 1, 2, 4, 8) and (s.master_addr, s.master_port) == ("10.0.0.1", 29500)
    env = {k: v for k, v in TORCHRUN.items() if k not in ("GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    assert _key(_spec(env)[1]) == (5, 1, 1, 2, 4, 8)  # node rank derived from RANK // LOCAL_WORLD_SIZE


def test_slurm_uneven_tasks_and_nodelist() -> None:
    name, s = _spec(SLURM)
    assert name == "slurm"
    assert _key(s) == (6, 0, 3, 4, 1, 7)
    assert s.tasks_per_node == (2, 2, 2, 1)
    assert s.master_addr == "gpu001"  # first host of the nodelist
    assert s.master_port == SlurmEnv.port_for_job(4242)
    assert _spec({**SLURM, "MASTER_ADDR": "ib0", "MASTER_PORT": "999"})[1].master_port == 999
    # step variables win over the job's (a step on 2 of the job's 4 nodes)
    step = {**SLURM, "SLURM_PROCID": "2", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[003,007]"}
    s2 = _spec(step)[1]
    assert _key(s2) == (2, 0, 1, 2, 2, 4) and s2.master_addr == "gpu003"


def test_slurm_batch_script_is_not_a_task() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert detect_environment(env).name == "single"


def test_mpi_openmpi_and_mpich() -> None:
    assert _spec(OMPI)[0] == "mpi" and _key(_spec(OMPI)[1]) == (3, 1, 1, 2, 2, 4)
    assert _key(_spec(MPICH)[1]) == (2, 0, 1, 2, 2, 4)


def test_horovod() -> None:
    name, s = _spec({**HOROVOD, **OMPI})  # horovodrun over MPI sets both: Horovod wins
    assert name == "horovod" and _key(s) == (3, 1, 1, 2, 2, 4)


def test_local_launcher() -> None:
    name, s = _spec({**LOCAL, **TORCHRUN})  # the local launcher also sets torchrun's variables
    assert name == "local" and _key(s) == (3, 1, 1, 2, 2, 4) and s.tasks_per_node == (2, 2)


def test_single_and_order() -> None:
    name, s = _spec({})
    assert name == "single" and _key(s) == (0, 0, 0, 1, 1, 1)
    assert DETECTION_ORDER == ("local", "torchrun", "horovod", "mpi", "slurm", "single")
    # inside an allocation mpirun ranks see SLURM_* too: MPI wins over Slurm
    assert detect_environment({**SLURM, **OMPI}).name == "mpi"


def test_explicit_choice_overrides_detection() -> None:
    env = {**SLURM, **TORCHRUN}
    assert detect_environment(env).name == "torchrun"
    assert detect_environment(env, "slurm").name == "slurm"
    assert detect_environment({**env, "SCALEOUT_ENV": "slurm"}).name == "slurm"
    with pytest.raises(UserError, match="launch.env='pbs'"):
        detect_environment(env, "pbs")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({**TORCHRUN, "RANK": "x"}, "RANK='x' is not an integer"),
        ({**TORCHRUN, "RANK": "9"}, "rank 9 not in [0, world_size=8)"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}, "SLURM_TASKS_PER_NODE is not set"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "2(x3)"}, "describes 3 nodes, expected 4"),
        ({**SLURM, "SLURM_NTASKS": "9"}, "sums to 7, expected SLURM_NTASKS=9"),
        ({**SLURM, "SLURM_JOB_NODELIST": "gpu[001-"}, "unclosed"),
        ({**HOROVOD, "HOROVOD_LOCAL_RANK": "2"}, "local rank 2 not in [0, 2)"),
        ({k: v for k, v in LOCAL.items() if k != "SCALEOUT_NNODES"}, "SCALEOUT_NNODES is not set"),
    ],
)
def test_bad_variables_are_one_line_errors(env, needle) -> None:
    with pytest.raises(UserError) as exc:  # EnvironmentError_ or NodelistError
        detect_environment(env).read(env)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_forced_slurm_outside_srun_is_refused() -> None:
    """launch.env=slurm in the batch shell (no srun): one line, instead of waiting for SLURM_NTASKS peers."""
    from scaleout.errors import EnvironmentError_

    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    reader = detect_environment(env, "slurm")
    with pytest.raises(EnvironmentError_, match=r"^slurm environment: SLURM_STEP_ID is not set, so srun did not start"):
        reader.read(env)
    assert reader.read({**env, "SLURM_STEPID": "3"}).rank == 6  # older Slurm spells it STEPID
